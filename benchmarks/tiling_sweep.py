"""Time the tensor-core kernel under other tilings (GPU), to tune flashjit.kernels.decode.tiling.

Warp/stage counts, the L2 prefetch hint, the grid order and the fused merge are each varied alone
from the current choice.

    python -m benchmarks.tiling_sweep [REGEX]     # only the shapes whose name matches
    python -m benchmarks.tiling_sweep --heads [REGEX]  # MHA, head_dims 96/256/512: candidate rows

--heads times each HEAD_CANDIDATES row (warps, stages, row layout, score split) of the MHA and
head_dim 96/256/512 shapes, beside the CUDA-core kernel where it serves the head_dim, each checked
against the float32 reference, and prints µs, GB/s and the share of the read floor.

Each variant is a tuning table (flashjit.kernels.decode.tiling.Tuning) handed to an engine that compiles its
kernels from it (the tiling is rendered into the source) and caches none of them.
"""

import argparse
import re
import tempfile

from benchmarks.cases import CASES
from benchmarks.inputs import build_inputs, quantize
from benchmarks.peers import flashjit_impl
from benchmarks.timing import Timer

# (head_dim, fp8 cache) -> (warps, stages, min CTAs per SM) variants; the first is the current choice
WARP_STAGES = {(128, False): [(4, 2, 1), (4, 3, 1), (4, 2, 3), (2, 4, 1)], (64, False): [(4, 4, 1), (4, 3, 1), (8, 2, 1)],
               (128, True): [(4, 2, 1), (4, 3, 1), (4, 2, 5), (2, 4, 1)]}
SHAPES = ["b1 L2048", "b1 L32768", "b16 L8192", "b64 L2048", "64 req log-uniform 128..32768", "b16 L8192 d64",
          "b16 L8192 e4m3", "b64 L8192 e4m3", "b16 L8192 e4m3 HND", "b16 L32768 window 4096",
          "b16 L32768 sinks 4 + window 4096"]


# MHA, head_dims 96/256/512: (head_dim, fp8 cache) -> tensor-core row changes; the first is the current row
HEAD_CANDIDATES = {
    (128, False): [{}, dict(stages=3), dict(warps=2, stages=4), dict(warps=8, stages=2)],
    (128, True): [{}, dict(stages=3), dict(warps=2, stages=4), dict(warps=2, stages=3)],
    (96, False): [{}, dict(min_ctas=1), dict(stages=3), dict(warps=3, stages=4, min_ctas=1), dict(warps=3, stages=3),
                  dict(warps=4, stages=2),  # threads not whole rows of 12 chunks: each key copied alone
                  dict(swizzle=False, k_pad=16, v_pad=16),  # 208-byte pitch: conflict-free, split sectors
                  dict(swizzle=False, k_pad=32, v_pad=32)],  # 224: whole sectors, two-way ldmatrix
    (96, True): [{}, dict(stages=3), dict(warps=3, stages=4), dict(warps=3, stages=3), dict(warps=4, stages=2),
                 dict(v_pad=32)],
    (256, False): [{}, dict(split_scores=True), dict(split_scores=True, stages=2)],
    (512, False): [{}, dict(split_scores=False, q_in_smem=True), dict(stages=3), dict(warps=4, stages=4),
                   dict(warps=4, stages=5)],
}
HEAD_SHAPES = ["b8 L16384 MHA 32/32", "b8 L16384 MHA 32/32 e4m3", "b8 L8192 d96 MHA 32/32", "b16 L8192 d96",
               "b16 L8192 d96 e4m3", "b16 L8192 d256", "b16 L8192 d512"]


def candidate_label(change: dict) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in change.items()) or "current"


def sweep_head_shapes(torch, timer, cache_dir, only: str):
    """Each HEAD_SHAPES row under its HEAD_CANDIDATES tensor-core rows and on CUDA cores where they serve it."""
    from benchmarks.cases import attended_bytes, kv_lengths
    from benchmarks.inputs import reference
    from benchmarks.read_floor import ReadFloor
    from benchmarks.measure import row_problem
    from flashjit.kernels.decode.spec import CUDA_CORE_HEAD_DIMS
    from flashjit.kernels.decode.tiling import TUNING

    read_floor = ReadFloor(torch)
    for case in [c for c in CASES if c.name in HEAD_SHAPES and re.search(only, c.name)]:
        batch = build_inputs(torch, case)
        fp8 = quantize(batch, case)
        nbytes = attended_bytes(case, kv_lengths(case))
        floor = read_floor.us(timer, nbytes)
        expected = reference(batch, case, fp8)

        def timed(label, table, tensor_cores):
            run, out, _ = flashjit_impl(torch, batch, case, tuned_engine(table, cache_dir), fp8,
                                        tensor_cores=tensor_cores)
            run()
            torch.cuda.synchronize()
            problem = row_problem(out, expected)[1]  # checked before it is timed
            us = timer.median_us(run)
            flag = "" if problem is None else f" WRONG ({problem}, against the float32 reference)"
            return f"{label} {us:7.1f} ({nbytes / us / 1e3:4.0f} GB/s, {floor / us:4.0%} of floor){flag}"

        row = [timed("cuda-cores", TUNING, False)] if case.head_dim in CUDA_CORE_HEAD_DIMS else []
        for change in HEAD_CANDIDATES[case.head_dim, fp8 is not None]:
            table = TUNING.with_rows(fp8=fp8 is not None, head_dim=case.head_dim, **change)
            row.append(timed(candidate_label(change), table, True))
        print(f"{case.name}:\n  " + "\n  ".join(row), flush=True)
        del batch, fp8, expected
        torch.cuda.empty_cache()


def tuned_table(table, head_dim, fp8, warps, stages, min_ctas, prefetch, heads_first, fused_merge):
    """table with one tensor-core row's warps, stages and CTAs per SM and the table-wide knobs changed."""
    return table.with_rows(fp8=fp8, head_dim=head_dim, warps=warps, stages=stages, min_ctas=min_ctas).replace(
        l2_prefetch=prefetch, heads_first=heads_first, fused_merge=fused_merge)


def tuned_engine(table, cache_dir):
    """An Engine whose kernels take their tiling from table: compiled on first use, kept in memory only."""
    import flashjit
    from flashjit.jit.compile import compile_source
    from flashjit.kernels.worklist_kernel import Kernel
    from flashjit.jit.render import render
    from flashjit.kernels.decode.tiling import decode_tiling
    from flashjit.masks.registry import masks

    class TunedEngine(flashjit.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._tuned = {}

        def get_kernel(self, spec):
            if spec not in self._tuned:
                tiling, mask = decode_tiling(spec, table), masks.get(spec.mask)
                cubin = compile_source(render(spec, mask, tiling), spec.arch, spec.name).cubin
                self._tuned[spec] = Kernel(spec, tiling, mask, cubin, f"{spec.name}+tuned")
            return self._tuned[spec]

    return TunedEngine(cache_dir=cache_dir)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="?", default="", metavar="REGEX", help="only the shapes whose name matches")
    parser.add_argument("--heads", action="store_true", help="MHA, head_dims 96/256/512: candidate rows")
    args = parser.parse_args(argv)
    only = args.only

    import torch

    from flashjit.kernels.decode.tiling import TUNING

    timer = Timer(torch, 15)
    cache_dir = tempfile.mkdtemp()  # the host planner's library; the kernels stay in memory
    if args.heads:
        sweep_head_shapes(torch, timer, cache_dir, only)
        return
    cases = [c for c in CASES if c.name in SHAPES and (c.head_dim, c.kv_dtype is not None) in WARP_STAGES
             and re.search(only, c.name)]
    for case in cases:
        batch = build_inputs(torch, case)
        fp8 = quantize(batch, case)
        warp_stages = WARP_STAGES[case.head_dim, fp8 is not None]
        chosen = (*warp_stages[0], TUNING.l2_prefetch, TUNING.heads_first, TUNING.fused_merge)
        variants = ([(*ws, *chosen[3:]) for ws in warp_stages]
                    + [(*chosen[:3], p, *chosen[4:]) for p in (0, 128, 256) if p != chosen[3]]
                    + [(*chosen[:4], not chosen[4], chosen[5]), (*chosen[:5], not chosen[5])])
        row = []
        for warps, stages, min_ctas, prefetch, heads_first, fused_merge in variants:
            table = tuned_table(TUNING, case.head_dim, fp8 is not None, warps, stages, min_ctas, prefetch, heads_first,
                                fused_merge)
            run, _, _ = flashjit_impl(torch, batch, case, tuned_engine(table, cache_dir), fp8)
            label = f"w{warps}s{stages}m{min_ctas}p{prefetch}{'h' if heads_first else ''}{'f' if fused_merge else ''}"
            row.append(f"{label} {timer.median_us(run):7.1f}")
        print(f"{case.name:32s} " + "  ".join(row), flush=True)
        del batch, fp8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
