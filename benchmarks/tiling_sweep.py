"""Time the tensor-core kernel under other warp/stage counts (GPU), to tune flashjit.tiling.

    python benchmarks/tiling_sweep.py
Each variant compiles into its own temporary cache (the tiling is rendered into the source).
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.decode import CASES, Timer, build_inputs, flashjit_impl  # noqa: E402

VARIANTS = {128: [(4, 3), (4, 2), (2, 4), (8, 2)], 64: [(4, 4), (4, 3), (8, 2)]}
SHAPES = ["b1 L32768", "b16 L8192", "b64 L2048", "64 req log-uniform 128..32768", "b16 L8192 d64"]


def main():
    import torch

    import flashjit
    from flashjit import tiling

    timer = Timer(torch, 15)
    cases = [c for c in CASES if c.name in SHAPES]
    for case in cases:
        batch = build_inputs(torch, case)
        row = []
        for warps, stages in VARIANTS[case.head_dim]:
            tiling.TC_WARPS[case.head_dim], tiling.TC_STAGES[case.head_dim] = warps, stages
            engine = flashjit.Engine(cache_dir=tempfile.mkdtemp())
            run, _, _ = flashjit_impl(torch, batch, case, engine)
            row.append(f"w{warps}s{stages} {timer.median_us(run):7.1f}")
        print(f"{case.name:32s} " + "  ".join(row), flush=True)
        del batch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
