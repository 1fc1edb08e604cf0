"""`python -m benchmarks.decode compile`: compile, cache and host costs (CPU ok; plan/run host time on a GPU)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.cases import HEADS_KV, HEADS_QO, PAGE


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
