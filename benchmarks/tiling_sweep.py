"""Time the tensor-core kernel under other tilings (GPU), to tune flashjit.jit.tiling: warp/stage
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

# (head_dim, fp8 cache) -> (warps, stages, min CTAs per SM) variants; the first is the current choice
WARP_STAGES = {(128, False): [(4, 2, 1), (4, 3, 1), (4, 2, 3), (2, 4, 1)], (64, False): [(4, 4, 1), (4, 3, 1), (8, 2, 1)],
               (128, True): [(4, 2, 1), (4, 3, 1), (4, 2, 5), (2, 4, 1)]}
SHAPES = ["b1 L2048", "b1 L32768", "b16 L8192", "b64 L2048", "64 req log-uniform 128..32768", "b16 L8192 d64",
          "b16 L8192 e4m3", "b64 L8192 e4m3", "b16 L8192 e4m3 HND", "b16 L32768 window 4096",
          "b16 L32768 sinks 4 + window 4096"]


def set_tiling(tiling, head_dim, fp8, warps, stages, min_ctas, prefetch, heads_first, fused_merge):
    warp_table = tiling.TC_WARPS_FP8 if fp8 else tiling.TC_WARPS
    stage_table = tiling.TC_STAGES_FP8 if fp8 else tiling.TC_STAGES
    warp_table[head_dim], stage_table[head_dim], tiling.TC_MIN_CTAS[head_dim] = warps, stages, min_ctas
    tiling.L2_PREFETCH = tiling.L2_PREFETCH_FP8 = prefetch
    tiling.HEADS_FIRST, tiling.FUSED_MERGE = heads_first, fused_merge


def main():
    import torch

    import flashjit
    from flashjit.jit import tiling

    timer = Timer(torch, 15)
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    cases = [c for c in CASES if c.name in SHAPES and (c.head_dim, c.kv_dtype is not None) in WARP_STAGES
             and re.search(only, c.name)]
    for case in cases:
        batch = build_inputs(torch, case)
        fp8 = quantize(batch, case)
        warp_stages = WARP_STAGES[case.head_dim, fp8 is not None]
        chosen = (*warp_stages[0], tiling.L2_PREFETCH_FP8 if fp8 else tiling.L2_PREFETCH, tiling.HEADS_FIRST,
                  tiling.FUSED_MERGE)
        variants = ([(*ws, *chosen[3:]) for ws in warp_stages]
                    + [(*chosen[:3], p, *chosen[4:]) for p in (0, 128, 256) if p != chosen[3]]
                    + [(*chosen[:4], not chosen[4], chosen[5]), (*chosen[:5], not chosen[5])])
        prefetches, row = (tiling.L2_PREFETCH, tiling.L2_PREFETCH_FP8), []
        for warps, stages, min_ctas, prefetch, heads_first, fused_merge in variants:
            set_tiling(tiling, case.head_dim, fp8 is not None, warps, stages, min_ctas, prefetch, heads_first,
                       fused_merge)
            engine = flashjit.Engine(cache_dir=tempfile.mkdtemp())
            run, _, _ = flashjit_impl(torch, batch, case, engine, fp8)
            label = f"w{warps}s{stages}m{min_ctas}p{prefetch}{'h' if heads_first else ''}{'f' if fused_merge else ''}"
            row.append(f"{label} {timer.median_us(run):7.1f}")
        set_tiling(tiling, case.head_dim, fp8 is not None, *chosen)
        tiling.L2_PREFETCH, tiling.L2_PREFETCH_FP8 = prefetches
        print(f"{case.name:32s} " + "  ".join(row), flush=True)
        del batch, fp8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
