"""flashjit decode benchmark: flashjit against torch SDPA (cuDNN) and FlashInfer on a fixed set of shapes (CASES).

    python -m benchmarks.decode [--quick] [--json out.json]      # GPU: kernel times
    python -m benchmarks.decode compile [--json out.json]        # compile, cache and host costs (CPU ok)

Method: random inputs, shuffled page tables, the L2 flushed before every timed call (--flush: "dirty"
writes 256 MB, which leaves ~60 MB of dirty lines the timed call then pays to write back; "clean"
reads the 256 MB after writing them, so the call starts from a cold, clean L2, as a serving step
does and as rotating inputs larger than the L2 would, though stricter: the page table and work list
are cold too), CUDA events around the call alone, warm-up first, the median of --iters calls. Every
implementation is checked against flashjit.serving.reference (float32) before it is timed; a wrong
one is reported, not timed. Bandwidth counts the K/V bytes attended (a window counts only the
window) plus q and out, and is compared with a device-to-device copy measured in the same run. Each
row's "floor" is a streaming read of the same number of bytes under the same flush and timing
(benchmarks/read_floor.py): no kernel reading those bytes can take less.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.read_floor import ReadFloor

HEADS_QO, HEADS_KV, PAGE = 32, 8, 16
PEERS = ("sdpa-cudnn", "flashinfer", "flashinfer-tc")


@dataclasses.dataclass
class Case:
    name: str
    batch: int
    kv_len: int | None          # None: log-uniform lengths 128..32768
    head_dim: int = 128
    window: int | None = None   # sliding window (window_left)
    sinks: int | None = None    # with window: StreamingLLM sink tokens (mask sink_window)
    kv_dtype: str | None = None  # fp8 cache ("float8_e4m3fn", "float8_e5m2"); None: bf16
    base: str | None = None     # the bf16 row of the same shape, for the fp8 speedup
    kv_layout: str = "NHD"
    quick: bool = False


CASES = [
    Case("b1 L2048", 1, 2048, quick=True),
    Case("b1 L32768", 1, 32768),
    Case("b1 L131072", 1, 131072, quick=True),
    Case("b16 L8192", 16, 8192, quick=True),
    Case("b64 L2048", 64, 2048),
    Case("b64 L8192", 64, 8192, quick=True),
    Case("b256 L2048", 256, 2048),
    Case("64 req log-uniform 128..32768", 64, None, quick=True),
    Case("b16 L32768 window 4096", 16, 32768, window=4096, quick=True),
    Case("b16 L32768 sinks 4 + window 4096", 16, 32768, window=4096, sinks=4, quick=True),
    Case("b16 L8192 d64", 16, 8192, head_dim=64),
    Case("b16 L8192 d256", 16, 8192, head_dim=256),
    Case("b16 L32768", 16, 32768, quick=True),  # the dense context of the window rows
    Case("b16 L8192 e4m3", 16, 8192, kv_dtype="float8_e4m3fn", base="b16 L8192", quick=True),
    Case("b16 L8192 HND", 16, 8192, kv_layout="HND"),
    Case("b16 L8192 e4m3 HND", 16, 8192, kv_dtype="float8_e4m3fn", base="b16 L8192 HND", kv_layout="HND"),
    Case("b16 L8192 e5m2", 16, 8192, kv_dtype="float8_e5m2", base="b16 L8192"),
    Case("b64 L8192 e4m3", 64, 8192, kv_dtype="float8_e4m3fn", base="b64 L8192", quick=True),
]


# ---- timing helpers ---------------------------------------------------------------------------

class Timer:
    def __init__(self, torch, iters: int, flush: str = "dirty"):
        self.torch, self.iters, self.clean = torch, iters, flush == "clean"
        self.scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def median_us(self, fn, flush: bool = True) -> float:
        torch = self.torch
        for _ in range(3):
            fn()
        times = []
        for i in range(self.iters):
            if flush:
                self.scratch.fill_(i & 0xFF)
                if self.clean:  # the reads evict the written lines, which are written back now
                    self.scratch.view(torch.int64).sum()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def graph_us(self, fn) -> float:
        """Median per-call time of a CUDA graph replaying fn (launch gaps removed); L2 flushed."""
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.median_us(graph.replay)


READ_CEILING_BYTES = 2 * 2**30


def copy_ceiling_gbs(torch) -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    timer = Timer(torch, 10)
    us = timer.median_us(lambda: dst.copy_(src), flush=False)
    return 2 * src.numel() / us / 1e3


# ---- implementations --------------------------------------------------------------------------

def build_inputs(torch, case: Case, seed: int = 0):
    from flashjit.deploy.random_batches import make_batch

    gen = torch.Generator().manual_seed(seed)
    if case.kv_len is None:
        lengths = torch.exp(torch.empty(case.batch).uniform_(math.log(128), math.log(32768), generator=gen)).long().tolist()
    else:
        lengths = [case.kv_len] * case.batch
    return make_batch(lengths, num_qo_heads=HEADS_QO, num_kv_heads=HEADS_KV, head_dim=case.head_dim,
                      page_size=PAGE, seed=seed, spare_pages=0, kv_layout=case.kv_layout)


def mask_of(case, batch) -> tuple[str, dict]:
    """The case's mask and its plan parameters."""
    if case.sinks is not None:
        from flashjit import sink_window_params

        return "sink_window", sink_window_params(batch.kv_lens, 1, num_sink=case.sinks, window_left=case.window)
    if case.window:
        return "sliding_window", {"window_left": case.window}
    return "none", {}


@dataclasses.dataclass
class Fp8Cache:
    cache: tuple        # (k, v) in fp8
    scales: tuple       # (k_scale, v_scale) floats
    dequantized: tuple  # (k, v) float32, for the reference


def quantize(batch, case) -> Fp8Cache | None:
    from flashjit.serving.quantize import dequantize_kv, quantize_kv

    if case.kv_dtype is None:
        return None
    layout = case.kv_layout
    (k, k_scale), (v, v_scale) = (quantize_kv(c, case.kv_dtype, kv_layout=layout) for c in (batch.k_cache, batch.v_cache))
    return Fp8Cache((k, v), (k_scale.item(), v_scale.item()),
                    (dequantize_kv(k, k_scale, kv_layout=layout), dequantize_kv(v, v_scale, kv_layout=layout)))


def flashjit_impl(torch, batch, case, engine, fp8: Fp8Cache | None, tensor_cores=None):
    import flashjit

    decoder = flashjit.BatchDecode(engine)
    mask, params = mask_of(case, batch)
    options = {"mask": mask, "mask_params": params, "tensor_cores": tensor_cores, "kv_dtype": case.kv_dtype,
               "kv_layout": case.kv_layout}
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, HEADS_QO, HEADS_KV, case.head_dim, PAGE, **options)
    out = torch.empty_like(batch.q)
    cache, (k_scale, v_scale) = (fp8.cache, fp8.scales) if fp8 else ((batch.k_cache, batch.v_cache), (None, None))
    return lambda: decoder.run(batch.q, cache, out=out, k_scale=k_scale, v_scale=v_scale), out, decoder


def sdpa_impl(torch, batch, case):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flashjit.serving.reference import gather_request_kv

    lengths = batch.kv_lens
    if len(set(lengths)) != 1 or case.kv_dtype:
        return None  # padded varlen needs a mask cuDNN does not take, and it has no fp8 KV: n/a
    length = lengths[0]
    start = max(0, length - 1 - case.window) if case.window else 0
    keys = list(range(min(case.sinks or 0, start))) + list(range(start, length))  # the keys attended
    ks, vs = [], []
    for b in range(len(lengths)):
        ids = batch.indices[int(batch.indptr[b]):int(batch.indptr[b + 1])]
        ks.append(gather_request_kv(batch.k_cache, ids, length, case.kv_layout)[keys].transpose(0, 1))
        vs.append(gather_request_kv(batch.v_cache, ids, length, case.kv_layout)[keys].transpose(0, 1))
    k, v = torch.stack(ks), torch.stack(vs)
    q = batch.q[:, :, None, :].contiguous()
    out = torch.empty_like(q)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    return run, out[:, :, 0, :]


def flashinfer_impls(torch, batch, case, fp8: Fp8Cache | None):
    if case.sinks is not None:
        return {}, "FlashInfer's decode wrapper has no sinks + window mask (sink rows compare with SDPA only)"
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any import failure means "absent"
        return {}, f"FlashInfer not importable ({type(exc).__name__}: {exc})"
    impls = {}
    for tc in (False, True):
        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, case.kv_layout, use_tensor_cores=tc)
        wrapper.plan(batch.indptr.cuda(), batch.indices, batch.last_page_len.cuda(), HEADS_QO, HEADS_KV,
                     case.head_dim, PAGE, q_data_type=torch.bfloat16,
                     kv_data_type=getattr(torch, case.kv_dtype) if fp8 else torch.bfloat16,
                     window_left=case.window if case.window else -1)
        out = torch.empty_like(batch.q)
        cache = fp8.cache if fp8 else (batch.k_cache, batch.v_cache)
        scales = dict(k_scale=fp8.scales[0], v_scale=fp8.scales[1]) if fp8 else {}
        impls["flashinfer-tc" if tc else "flashinfer"] = (
            lambda w=wrapper, o=out: w.run(batch.q, cache, out=o, **scales), out)
    return impls, None


def attended_bytes(batch, case) -> int:
    tokens = sum(min(n, (case.sinks or 0) + case.window + 1) if case.window else n for n in batch.kv_lens)
    kv = 2 * tokens * HEADS_KV * case.head_dim * (1 if case.kv_dtype else 2)
    return kv + 2 * batch.q.numel() * 2


# ---- modes ------------------------------------------------------------------------------------

def bench_kernels(args) -> dict:
    import torch

    import flashjit
    from flashjit.serving.reference import decode_reference
    from flashjit.deploy.random_batches import rel_error

    engine = flashjit.Engine(cache_dir=args.cache_dir)
    timer = Timer(torch, args.iters, args.flush)
    ceiling = copy_ceiling_gbs(torch)
    floor = ReadFloor(torch)
    read_ceiling = READ_CEILING_BYTES / floor.us(Timer(torch, 10), READ_CEILING_BYTES, flush=False) / 1e3
    print(f"# {torch.cuda.get_device_name()}  copy ceiling {ceiling:.0f} GB/s  read ceiling {read_ceiling:.0f} GB/s  "
          f"torch {torch.__version__}  L2 flush {args.flush}")
    rows = []
    notes = set()
    for case in [c for c in CASES if (c.quick or not args.quick) and re.search(args.only, c.name)]:
        batch = build_inputs(torch, case)
        mask, params = mask_of(case, batch)
        fp8 = quantize(batch, case)
        k_ref, v_ref = fp8.dequantized if fp8 else (batch.k_cache, batch.v_cache)
        ref, _ = decode_reference(batch.q, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len,
                                  mask=mask, mask_params=params, kv_layout=case.kv_layout)
        impls = {}
        run, out, decoder = flashjit_impl(torch, batch, case, engine, fp8)
        impls["flashjit"] = (run, out)
        if args.cuda_cores:
            impls["flashjit-cc"] = flashjit_impl(torch, batch, case, engine, fp8, tensor_cores=False)[:2]
        sdpa = sdpa_impl(torch, batch, case)
        if sdpa:
            impls["sdpa-cudnn"] = sdpa
        fi, note = flashinfer_impls(torch, batch, case, fp8)
        impls.update(fi)
        if note:
            notes.add(note)
        row = {"case": case.name, "bytes": attended_bytes(batch, case), "splits": decoder.work.max_splits,
               "work_items": decoder.work.num_work}
        row["floor_us"] = floor.us(timer, row["bytes"])
        for name, (fn, out) in impls.items():
            try:
                fn()
                torch.cuda.synchronize()
                err = rel_error(out, ref)
            except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                continue
            if not err <= 1e-2:
                row[name] = {"error": f"rel error {err:.2e}"}
                continue
            entry = {"us": timer.median_us(fn), "rel_error": err}
            if name == "flashjit" and (row["bytes"] < 64 * 2**20):
                entry["graph_us"] = timer.graph_us(fn)
            row[name] = entry
        peers = [row[n]["us"] for n in PEERS if isinstance(row.get(n), dict) and "us" in row[n]]
        row["best_peer_us"] = min(peers) if peers else None
        base = next((r for r in rows if r["case"] == case.base), None)
        if base and "us" in base.get("flashjit", {}) and "us" in row.get("flashjit", {}):
            row["speedup_vs_bf16"] = base["flashjit"]["us"] / row["flashjit"]["us"]
        rows.append(row)
        print_row(row, ceiling)
        del batch, impls, ref, fp8
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "copy_ceiling_gbs": ceiling, "read_ceiling_gbs": read_ceiling,
            "rows": rows, "notes": sorted(notes)}


def print_row(row, ceiling):
    fj = row.get("flashjit", {})
    us = fj.get("us")
    gbs = row["bytes"] / us / 1e3 if us else float("nan")
    peer = row["best_peer_us"]
    ratio = f"{peer / us:5.2f}x" if us and peer else "  n/a"
    others = "  ".join(f"{n} {row[n]['us']:.1f}" if "us" in row[n] else f"{n} ERR({row[n]['error'][:40]})"
                       for n in row if n in PEERS + ("flashjit-cc",))
    graph = f" graph {fj['graph_us']:.1f}" if "graph_us" in fj else ""
    graph += f" ({row['speedup_vs_bf16']:.2f}x bf16)" if "speedup_vs_bf16" in row else ""
    fj_text = f"{us:8.1f} us{graph}" if us else f"ERR {fj.get('error', '')}"
    floor = row["floor_us"]
    at_floor = f"{100 * floor / us:3.0f}%" if us else "n/a"
    print(f"{row['case']:32s} flashjit {fj_text} {gbs:6.0f} GB/s {100 * gbs / ceiling:5.1f}%  "
          f"speedup vs best peer {ratio}  floor {floor:6.1f} us ({at_floor})  splits {row['splits']:3d} | {others}",
          flush=True)


def bench_compile(args) -> dict:
    """Cold compile, warm-disk first call in a fresh process, in-memory get_kernel, and (GPU) plan/run host time."""
    import flashjit
    from flashjit.jit.compile import compile_source
    from flashjit.jit.render import render

    arch = args.arch
    spec = flashjit.DecodeSpec(128, "bf16", group_size=4, page_size=16, arch=arch)
    result = {"arch": arch, "spec": spec.name}

    def cold_compile_s(spec) -> float:
        """Median of 3 NVRTC compiles, each of a source NVRTC has not seen (a comment makes it new)."""
        source, colds = render(spec), []
        for i in range(3):
            start = time.perf_counter()
            compile_source(source + f"\n// cold {time.time_ns()} {i}\n", arch, spec.name, extra_options=("--no-cache",))
            colds.append(time.perf_counter() - start)
        return statistics.median(colds)

    result["cold_compile_s"] = cold_compile_s(spec)
    # Compile time is per specialization: the other head_dims and the fp8 kernel differ in size
    # (head_dim 256 unrolls twice the MMA steps of 128).
    others = [spec.replace(head_dim=64), spec.replace(head_dim=256), spec.replace(kv_dtype="float8_e4m3fn")]
    for other in others:
        result[f"cold_compile_s {other.name}"] = cold_compile_s(other)
    with tempfile.TemporaryDirectory() as folder:
        flashjit.Engine(cache_dir=folder).get_kernel(spec)
        code = ("import time,flashjit; e=flashjit.Engine(cache_dir=%r); s=flashjit.DecodeSpec.from_name(%r); "
                "t=time.perf_counter(); e.get_kernel(s); print(time.perf_counter()-t)") % (folder, spec.name)
        warm = [float(subprocess.check_output([sys.executable, "-c", code], text=True)) for _ in range(3)]
        result["warm_disk_first_call_ms"] = 1e3 * statistics.median(warm)
        engine = flashjit.Engine(cache_dir=folder)
        engine.get_kernel(spec)
        n = 100000
        start = time.perf_counter()
        for _ in range(n):
            engine.get_kernel(spec)
        result["memory_get_kernel_us"] = 1e6 * (time.perf_counter() - start) / n
    result.update(host_costs())
    for key, value in result.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    return result


def host_costs() -> dict:
    """Host microseconds of plan() (64 short requests) and run() (a tiny batch, so the GPU never
    backs the launch queue up), next to one torch elementwise op measured the same way."""
    import torch

    if not torch.cuda.is_available():
        return {}
    import flashjit
    from flashjit.deploy.random_batches import make_batch

    engine = flashjit.Engine(cache_dir=tempfile.mkdtemp())

    def per_call_us(fn, n, rounds=9):
        """The median over rounds of the mean host time of n calls: a round that another process
        interrupts says nothing of the call."""
        fn()
        torch.cuda.synchronize()
        means = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            means.append((time.perf_counter() - start) / n)
            torch.cuda.synchronize()
        return 1e6 * statistics.median(means)

    planned = make_batch([128 + 6 * i for i in range(64)], num_qo_heads=HEADS_QO, num_kv_heads=HEADS_KV,
                         head_dim=128, page_size=PAGE)
    decoder = flashjit.BatchDecode(engine)
    plan_args = (planned.indptr, planned.indices, planned.last_page_len, HEADS_QO, HEADS_KV, 128, PAGE)
    plan_us = per_call_us(lambda: decoder.plan(*plan_args), 200)
    unchecked_us = per_call_us(lambda: decoder.plan(*plan_args, check_page_ids=False), 200)

    tiny = make_batch([64], num_qo_heads=HEADS_QO, num_kv_heads=HEADS_KV, head_dim=128, page_size=PAGE)
    decoder.plan(tiny.indptr, tiny.indices, tiny.last_page_len, HEADS_QO, HEADS_KV, 128, PAGE)
    out, cache = torch.empty_like(tiny.q), (tiny.k_cache, tiny.v_cache)
    run_us = per_call_us(lambda: decoder.run(tiny.q, cache, out=out), 2000)
    x = torch.empty(16, device="cuda")
    add_us = per_call_us(lambda: x.add_(1), 2000)
    return {"plan_64_requests_us": plan_us, "plan_64_requests_unchecked_ids_us": unchecked_us, "run_host_us": run_us,
            "torch_add_host_us": add_us}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="kernels", choices=["kernels", "compile"])
    parser.add_argument("--quick", action="store_true", help="a subset of the shapes")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--flush", choices=["dirty", "clean"], default="dirty",
                        help="L2 flush before each timed call: a 256 MB write (dirty: the timed call writes "
                             "those lines back) or that write read back (clean: a cold L2 with nothing to write back)")
    parser.add_argument("--only", default="", help="rows whose name matches this regular expression")
    parser.add_argument("--cuda-cores", action="store_true", help="also time flashjit's CUDA-core kernel")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--arch", default=None, help="compile mode: target arch (default: the GPU's, else sm_90)")
    args = parser.parse_args(argv)
    if args.mode == "compile":
        if args.arch is None:
            from flashjit.jit.spec import current_arch
            args.arch = current_arch() or "sm_90"
        result = bench_compile(args)
    else:
        result = bench_kernels(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
