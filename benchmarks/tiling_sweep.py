"""Time the tensor-core kernel under other tilings (GPU), to tune flashjit.tiling: warp/stage
counts, the L2 prefetch hint, the grid order and the fused merge, each varied alone from the current choice.

    python benchmarks/tiling_sweep.py [REGEX]     # only the shapes whose name matches
Each variant compiles into its own temporary cache (the tiling is rendered into the source).
"""

import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.decode import CASES, Timer, build_inputs, flashjit_impl, quantize  # noqa: E402

# (head_dim, fp8 cache) -> (warps, stages) variants; the first is the current choice
WARP_STAGES = {(128, False): [(4, 3), (4, 2), (2, 4)], (64, False): [(4, 4), (4, 3), (8, 2)],
            (128, True): [(4, 3), (4, 2), (2, 4)]}
SHAPES = ["b1 L2048", "b1 L32768", "b16 L8192", "b64 L2048", "64 req log-uniform 128..32768", "b16 L8192 d64",
          "b16 L8192 e4m3", "b64 L8192 e4m3", "b16 L8192 e4m3 HND", "b16 L32768 window 4096",
          "b16 L32768 sinks 4 + window 4096"]


def set_tiling(tiling, head_dim, stage_table, warps, stages, prefetch, heads_first, fused_merge):
    tiling.TC_WARPS[head_dim], stage_table[head_dim] = warps, stages
    tiling.L2_PREFETCH = tiling.L2_PREFETCH_FP8 = prefetch
    tiling.HEADS_FIRST, tiling.FUSED_MERGE = heads_first, fused_merge


def main():
    import torch

    import flashjit
    from flashjit import tiling

    timer = Timer(torch, 15)
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    cases = [c for c in CASES if c.name in SHAPES and (c.head_dim, c.kv_dtype is not None) in WARP_STAGES
             and re.search(only, c.name)]
    for case in cases:
        batch = build_inputs(torch, case)
        fp8 = quantize(batch, case)
        stage_table = tiling.TC_STAGES_FP8 if fp8 else tiling.TC_STAGES
        warp_stages = WARP_STAGES[case.head_dim, fp8 is not None]
        chosen = (*warp_stages[0], tiling.L2_PREFETCH_FP8 if fp8 else tiling.L2_PREFETCH, tiling.HEADS_FIRST,
                  tiling.FUSED_MERGE)
        variants = ([(*ws, *chosen[2:]) for ws in warp_stages]
                    + [(*chosen[:2], p, *chosen[3:]) for p in (0, 128, 256) if p != chosen[2]]
                    + [(*chosen[:3], not chosen[3], chosen[4]), (*chosen[:4], not chosen[4])])
        prefetches, row = (tiling.L2_PREFETCH, tiling.L2_PREFETCH_FP8), []
        for warps, stages, prefetch, heads_first, fused_merge in variants:
            set_tiling(tiling, case.head_dim, stage_table, warps, stages, prefetch, heads_first, fused_merge)
            engine = flashjit.Engine(cache_dir=tempfile.mkdtemp())
            run, _, _ = flashjit_impl(torch, batch, case, engine, fp8)
            label = f"w{warps}s{stages}p{prefetch}{'h' if heads_first else ''}{'f' if fused_merge else ''}"
            row.append(f"{label} {timer.median_us(run):7.1f}")
        set_tiling(tiling, case.head_dim, stage_table, *chosen)
        tiling.L2_PREFETCH, tiling.L2_PREFETCH_FP8 = prefetches
        print(f"{case.name:32s} " + "  ".join(row), flush=True)
        del batch, fp8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
