"""MLA decode benchmark: flashjit's BatchDecodeMLA against FlashInfer's MLA wrapper
(flashinfer.mla.BatchMLAPagedAttentionWrapper) and FlashMLA (flash_mla), where they import.

    python -m benchmarks.mla [--rows PATTERN] [--iters N] [--no-graph] [--json out.json]
    python -m benchmarks.mla --sweep [--rows PATTERN]   # flashjit under other MLA tilings and settings

Method as benchmarks/decode.py: random inputs, shuffled pages (page size 64, the size FlashMLA
requires), the L2 flushed before every timed call, CUDA events around the call alone, the median of
--iters calls; every implementation's output is checked row by row (benchmarks.measure.row_problem) against flashjit.serving.mla_reference
before it is timed (a wrong one is reported, not timed). Each row reports its time, GB/s over the
latent bytes attended plus q and out, the read floor (a streaming read of those bytes, timed the same
way: benchmarks/read_floor.py) and TFLOP/s (2 x 1088 flops per query row and key: the 576-wide score
and the 512-wide output). At 16 heads a step is memory-bound (compare with the floor); at 128 heads
compute-bound: the run first times a large bf16 GEMM (torch.matmul, 8192 cubed) the same way, and
each row gives its TFLOP/s as a share of that ceiling.

Skewed rows mix mostly short requests with a few long ones; q2/q4 rows are multi-token prediction
(speculative decoding). flashjit's graph column replays a CUDA graph of run() on a CUDA-graph
decoder, re-planned by plan() before every replay, outside the timed span (as a server plans once
a step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

PAGE_SIZE = 64
SM_SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2  # DeepSeek-V3's, with YaRN


@dataclasses.dataclass(frozen=True)
class Row:
    """batch requests of kv_len keys, of which the last `long` have long_len keys instead."""

    name: str
    batch: int
    kv_len: int
    heads: int
    q_len: int = 1
    kv: str = "bf16"
    long: int = 0
    long_len: int = 0

    @property
    def kv_lens(self) -> list[int]:
        return [self.kv_len] * (self.batch - self.long) + [self.long_len] * self.long

    @property
    def attended_bytes(self) -> int:
        latent = sum(self.kv_lens) * 576 * (1 if self.kv == "e4m3" else 2)
        return latent + self.batch * self.q_len * self.heads * (576 + 512) * 2

    @property
    def flops(self) -> int:
        return 2 * self.q_len * self.heads * sum(self.kv_lens) * (576 + 512)


ROWS = (Row("b64 L8192 h16", 64, 8192, 16), Row("b16 L8192 h128", 16, 8192, 128),
        Row("b64 L8192 h16 e4m3", 64, 8192, 16, kv="e4m3"), Row("b16 L8192 h128 e4m3", 16, 8192, 128, kv="e4m3"),
        Row("b64 L4096 h16 q2", 64, 4096, 16, q_len=2), Row("b128 L2048 h128", 128, 2048, 128),
        Row("b32 L4096 h128 q4", 32, 4096, 128, q_len=4),
        Row("skewed 60xL512 + 4xL32768 h16", 64, 512, 16, long=4, long_len=32768),
        Row("skewed 30xL1024 + 2xL16384 h128", 32, 1024, 128, long=2, long_len=16384))
GEMM_SIZE = 8192  # the bf16 GEMM whose TFLOP/s is each row's compute ceiling


def build(torch, row: Row, seed: int = 0) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.tensor(row.kv_lens, dtype=torch.int32)
    pages = (lens + PAGE_SIZE - 1) // PAGE_SIZE
    total = int(pages.sum())
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    cache = (torch.randn(total, PAGE_SIZE, 576, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    tokens = row.batch * row.q_len
    q = (torch.randn(tokens, row.heads, 576, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    inputs = dict(cache=cache, q_nope=q[..., :512].contiguous(), q_pe=q[..., 512:].contiguous(),
                  indptr=torch.cat([torch.zeros(1, dtype=torch.int32), pages.cumsum(0).to(torch.int32)]),
                  indices=perm.cuda(), last=(lens - (pages - 1) * PAGE_SIZE).to(torch.int32),
                  qo=torch.arange(row.batch + 1, dtype=torch.int32) * row.q_len, scale=None)
    if row.kv == "e4m3":
        from flashjit.serving.quantize import quantize_latent

        inputs["cache"], inputs["scale"] = quantize_latent(cache, "e4m3")
    return inputs


def reference(torch, row: Row, x: dict):
    from flashjit.serving.mla_reference import mla_reference

    cache = x["cache"].float() * (1.0 if x["scale"] is None else x["scale"])
    return mla_reference(x["q_nope"], x["q_pe"], cache, None, x["indptr"], x["indices"], x["last"],
                         qo_indptr=x["qo"], sm_scale=SM_SCALE)[0]


def flashjit_call(torch, row: Row, x: dict, engine=None, graph: bool = False):
    """flashjit's run() after one plan() (on a CUDA-graph decoder with graph); run.plan re-plans, as
    a server does once a step."""
    from flashjit.serving.batch_mla import BatchDecodeMLA

    sizes = dict(use_cuda_graph=True, max_batch_size=row.batch, max_num_pages=x["indices"].numel(),
                 max_q_len=row.q_len) if graph else {}
    decoder = BatchDecodeMLA(engine, **sizes)

    def plan():
        decoder.plan(x["indptr"], x["indices"], x["last"], row.heads, PAGE_SIZE, qo_indptr=x["qo"],
                     sm_scale=SM_SCALE, kv_dtype=None if row.kv == "bf16" else "e4m3")
    plan()
    out = torch.empty(x["q_nope"].shape, dtype=torch.bfloat16, device="cuda")
    scale = None if x["scale"] is None else x["scale"].item()
    def run():
        return decoder.run(x["q_nope"], x["q_pe"], x["cache"], out=out, ckv_scale=scale)
    run.plan = plan
    return run


def flashinfer_call(torch, row: Row, x: dict):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    if row.kv != "bf16":
        raise RuntimeError("FlashInfer's MLA wrapper takes 16-bit caches here")
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = BatchMLAPagedAttentionWrapper(workspace)
    kv_lens = torch.tensor(row.kv_lens, dtype=torch.int32, device="cuda")
    wrapper.plan(x["qo"].cuda(), x["indptr"].cuda(), x["indices"], kv_lens, row.heads, 512, 64, PAGE_SIZE,
                 row.q_len > 1, SM_SCALE, torch.bfloat16, torch.bfloat16)
    ckv, kpe = x["cache"][..., :512], x["cache"][..., 512:]
    return lambda: wrapper.run(x["q_nope"], x["q_pe"], ckv, kpe)


def flashmla_call(torch, row: Row, x: dict):
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    if row.kv != "bf16" or row.long:
        raise RuntimeError("FlashMLA's dense path is timed on bf16 caches of equal lengths here")
    seqlens = torch.full((row.batch,), row.kv_len, dtype=torch.int32, device="cuda")
    metadata, splits = get_mla_metadata(seqlens, row.q_len * row.heads, 1)
    table = x["indices"].view(row.batch, -1)
    q = torch.cat([x["q_nope"], x["q_pe"]], dim=-1).view(row.batch, row.q_len, row.heads, 576)
    cache = x["cache"].view(-1, PAGE_SIZE, 1, 576)

    def call():
        out, _ = flash_mla_with_kvcache(q, cache, table, seqlens, 512, metadata, splits, softmax_scale=SM_SCALE,
                                        causal=row.q_len > 1)
        return out.view(-1, row.heads, 512)
    return call


def flashjit_graph_call(torch, row: Row, x: dict):
    """A CUDA graph of flashjit's run() on a CUDA-graph decoder, re-planned before every replay
    (plan() outside the timed span, as a server plans once per step)."""
    from benchmarks.timing import capture

    run = flashjit_call(torch, row, x, graph=True)
    graph, out = capture(torch, run)

    def replay():
        graph.replay()
        return out
    replay.before = run.plan
    return replay


IMPLEMENTATIONS = {"flashjit": flashjit_call, "flashjit graph": flashjit_graph_call, "flashinfer": flashinfer_call,
                   "flashmla": flashmla_call}


def gemm_tflops(torch, timer) -> float:
    """The TFLOP/s of a large bf16 GEMM, timed as the rows are: the compute ceiling this GPU reaches."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(GEMM_SIZE, GEMM_SIZE, generator=gen, device="cuda").bfloat16() for _ in range(2))
    out = torch.empty_like(a)
    us = timer.median_us(lambda: torch.matmul(a, b, out=out))
    return 2 * GEMM_SIZE ** 3 / us / 1e6


def measure(torch, rows, iters: int, graphs: bool = True) -> list[dict]:
    from benchmarks.read_floor import ReadFloor
    from benchmarks.timing import Timer

    timer, floor = Timer(torch, iters), ReadFloor(torch)
    ceiling = gemm_tflops(torch, timer)
    print(f"{torch.cuda.get_device_name()}: bf16 GEMM ({GEMM_SIZE} cubed) {ceiling:.0f} TFLOP/s", flush=True)
    results = []
    for row in rows:
        x = build(torch, row)
        ref = reference(torch, row, x)
        entry = {"row": row.name, "bytes": row.attended_bytes, "flops": row.flops, "gemm_tflops": ceiling,
                 "floor_us": floor.us(timer, row.attended_bytes), "impls": {}}
        for name, make in IMPLEMENTATIONS.items():
            if name == "flashjit graph" and not graphs:
                continue
            try:
                call = make(torch, row, x)
                before = getattr(call, "before", None)  # a graph's re-plan before each replay
                err, problem = checked(torch, call, ref, before)
                if problem is None:
                    us = timer.median_us(call, before=before)
                    _, problem = checked(torch, call, ref, before)  # as the timed calls left it
                if problem:
                    entry["impls"][name] = {"error": f"wrong output: {problem}"}
                    continue
                entry["impls"][name] = {"us": us, "gbs": row.attended_bytes / us / 1e3,
                                        "tflops": row.flops / us / 1e6, "row_error": err}
            except Exception as exc:  # a peer that does not import or refuses the row is a note, not a failure
                entry["impls"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
        results.append(entry)
        print(format_row(entry), flush=True)
    return results


def checked(torch, call, ref, before=None):
    """benchmarks.measure.checked_output of a call (after before(), if given), the output of a call
    before NaN-filled first, so a call that reuses its output (a graph replay) must write it again."""
    from benchmarks.measure import checked_output

    call().fill_(float("nan"))
    if before is not None:
        before()
    return checked_output(call, ref, torch.cuda.synchronize)


def format_row(entry: dict) -> str:
    parts = [f"{entry['row']:<22} floor {entry['floor_us']:8.1f} us"]
    for name, r in entry["impls"].items():
        if "us" not in r:
            parts.append(f"{name}: {r['error']}")
            continue
        share = f", {r['tflops'] / entry['gemm_tflops']:.0%} of GEMM" if "gemm_tflops" in entry else ""
        parts.append(f"{name} {r['us']:8.1f} us {r['gbs']:6.0f} GB/s {r['tflops']:6.1f} TFLOP/s "
                     f"({entry['floor_us'] / r['us']:.0%} of floor{share})")
    eager, graph = entry["impls"].get("flashjit", {}), entry["impls"].get("flashjit graph", {})
    if "us" in eager and "us" in graph:
        parts.append(f"graph ÷ eager speed {eager['us'] / graph['us']:.2f}")
    return " | ".join(parts)


# (warps, tile, stages, min CTAs per SM) per (fp8, rows per CTA) of the mma.sync kernel; the table's own
# row is timed first (alone for a spec on the wgmma kernel, which has one shape)
SWEEP = {(False, 16): [(4, 64, 2, 1), (8, 64, 2, 1), (4, 32, 3, 1)],   # 16 warps at 64 rows spill (128 registers)
         (False, 64): [(8, 64, 2, 1), (8, 32, 2, 1)],
         (True, 16): [(4, 32, 2, 2), (4, 64, 2, 1), (8, 64, 3, 1)],
         (True, 64): [(8, 64, 2, 1), (8, 32, 3, 1)]}
# Settings of the whole table timed against it as it is: the fused merge's cells a thread at once.
SETTINGS = {"cells4": {"merge_cells": 4, "merge_chunk": 4}}


def tuned_engine(table):
    """An Engine whose MLA kernels take their tiling from table: compiled on first use, kept in memory."""
    import tempfile

    import flashjit
    from flashjit.jit.compile import compile_source
    from flashjit.jit.arch import WGMMA_COMPILE_ARCH
    from flashjit.kernels.worklist_kernel import Kernel
    from flashjit.kernels.mla.tiling import mla_tiling
    from flashjit.jit.render import render
    from flashjit.masks.registry import masks

    class TunedEngine(flashjit.Engine):
        def get_kernel(self, spec):
            tiling, mask = mla_tiling(spec, table), masks.get(spec.mask)
            arch = WGMMA_COMPILE_ARCH if tiling.wgmma else spec.arch  # the table may move a spec to wgmma
            cubin = compile_source(render(spec, mask, tiling), arch, spec.name).cubin
            return Kernel(spec, tiling, mask, cubin, f"{spec.name}+tuned")

    return TunedEngine(cache_dir=tempfile.mkdtemp())


def sweep_variants(spec) -> list[tuple[str, object]]:
    """(label, MLATuning) for each variant --sweep times a spec under: the table as it is first, then
    SWEEP's tilings of its mma.sync shape, then SETTINGS, and fp8 latents on the warpgroup kernel
    where the spec's rows fill its tiles."""
    import dataclasses

    from flashjit.kernels.mla.tiling import MLA_TUNING, cta_rows, uses_wgmma

    fp8, rows_per_cta, wgmma = spec.kv_is_fp8, cta_rows(spec.num_heads * spec.max_q_len), uses_wgmma(spec)
    current = MLA_TUNING.row(fp8, rows_per_cta, wgmma)
    tilings = [(current.warps, current.tile_tokens, current.stages, current.min_ctas)] + (
        [] if wgmma else SWEEP.get((fp8, rows_per_cta), []))
    variants = [(f"{'wgmma ' if wgmma else ''}w{warps}t{tile}s{stages}m{min_ctas}",
                 MLA_TUNING.with_rows(fp8=fp8, rows=rows_per_cta, wgmma=wgmma, warps=warps, tile_tokens=tile,
                                      stages=stages, min_ctas=min_ctas))
                for warps, tile, stages, min_ctas in dict.fromkeys(tilings)]
    variants += [(label, dataclasses.replace(MLA_TUNING, **changes)) for label, changes in SETTINGS.items()]
    on_wgmma = dataclasses.replace(MLA_TUNING, wgmma_fp8=True)
    if fp8 and not wgmma and uses_wgmma(spec, on_wgmma):
        variants.append(("wgmma fp8", on_wgmma))
    return variants


def sweep(torch, rows, iters: int):
    from benchmarks.measure import row_problem
    from benchmarks.timing import Timer
    from flashjit.kernels.mla.spec import MLASpec
    from flashjit.kernels.mla.tiling import cta_rows, mla_tiling

    timer = Timer(torch, iters)
    for row in rows:
        x = build(torch, row)
        ref = reference(torch, row, x)
        spec = MLASpec(num_heads=row.heads, kv_dtype=row.kv, page_size=PAGE_SIZE, max_q_len=row.q_len)
        rows_per_cta = cta_rows(row.heads * row.q_len)
        cells = []
        for label, table in sweep_variants(spec):
            if mla_tiling(spec, table).rows != rows_per_cta:  # fewer rows a CTA: this one's memory does not fit
                cells.append(f"{label} (no fit)")
                continue
            try:
                call = flashjit_call(torch, row, x, tuned_engine(table))
                _, problem = row_problem(call(), ref)
                cells.append(f"{label} {timer.median_us(call):7.1f}" if problem is None else f"{label} wrong ({problem})")
            except Exception as exc:  # a variant the kernel refuses (static_assert) is a note
                cells.append(f"{label} {type(exc).__name__}")
        print(f"{row.name:22s} " + "  ".join(cells), flush=True)


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=".", help="regex over row names (default: all)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sweep", action="store_true", help="time flashjit under other MLA tilings instead")
    parser.add_argument("--no-graph", action="store_true", help="leave out flashjit's CUDA-graph column")
    args = parser.parse_args(argv)
    rows = [row for row in ROWS if re.search(args.rows, row.name)]
    if args.sweep:
        return sweep(torch, rows, args.iters)
    results = measure(torch, rows, args.iters, graphs=not args.no_graph)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
