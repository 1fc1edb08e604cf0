"""flashjit decode kernels against the float32 torch reference on random paged batches, every row
(query token x head) judged on its own (flashjit.serving.exactness)."""

from __future__ import annotations

import itertools

import pytest
import torch

import flashjit
from flashjit.deploy import mask_check as cm
from flashjit.masks.registry import masks
from flashjit.serving.reference import decode_reference

from built_ins import DEVICE_PLANNED_MASKS

from .batches import assert_exact, make_batch, tolerance

# The masks the GPU planner plans; the others, whose spans the host computes from their tensors,
# run through the same matrix in test_masks_gpu.py. Together: every built-in mask.
MASKS = DEVICE_PLANNED_MASKS
DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
GROUPS = [1, 4, 7, 8]
PAGE_SIZES = [1, 16, 64]
Q_LENS = [1, 4]
NUM_KV_HEADS = 2
CORES = [False, True]  # CUDA-core and tensor-core kernels


@pytest.fixture(scope="session")
def engine():
    engine = flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    specs = [flashjit.DecodeSpec(d, dtype=dt, mask=m, page_size=p, group_size=g, max_q_len=q, arch=arch, tensor_cores=tc)
             for m, dt, d, g, p, q, tc in itertools.product(MASKS, DTYPES, HEAD_DIMS, GROUPS, PAGE_SIZES, Q_LENS, CORES)]
    engine.prewarm(specs, jobs=16)
    return engine


def failure_text(results, where: str) -> str:
    return "\n".join(f"{r.spec} split={r.split} probe={r.probe}: {'; '.join(r.failures)} ({where})"
                     for r in results if not r.passed)


@pytest.mark.parametrize("tensor_cores", CORES, ids=["cc", "tc"])
@pytest.mark.parametrize("q_len", Q_LENS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("mask", MASKS)
def test_matches_reference(engine, mask, dtype, head_dim, group, q_len, tensor_cores, rng):
    """Every split policy against the reference, row by row (the zero-query key counts of every
    mask and path: test_key_counts_gpu.py)."""
    for page_size in PAGE_SIZES:
        kv_lens = cm.random_lengths(rng, page_size)
        q_lens = [min(q_len, n) for n in kv_lens]
        batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                           page_size=page_size, dtype=dtype, q_lens=q_lens, seed=rng.randint(0, 1 << 30))
        params = cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, page_size, "cuda")
        results = cm.check_batch(engine, batch, mask, params, probes=("random q",), tensor_cores=tensor_cores)
        assert all(r.spec.endswith("_tc") == tensor_cores for r in results)
        where = f"kv_lens={kv_lens} q_lens={q_lens} params: {cm.describe_params(params)}"
        assert all(r.passed for r in results), failure_text(results, where)


@pytest.mark.parametrize("q_len", [1, 3])
def test_fused_merge_leaves_its_counters_at_zero(engine, q_len):
    """Split requests merged in the decode kernel: right on every launch, eager and replayed, because
    the last CTA of each group sets its arrival counter back to 0."""
    kv_lens = [3000, 1, 700, 0]
    batch = make_batch(kv_lens, num_qo_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=128, page_size=16,
                       q_lens=[min(q_len, n) for n in kv_lens], seed=11)
    ref, _ = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                              batch.last_page_len, qo_indptr=batch.qo_indptr)
    decoder = flashjit.BatchDecode(engine)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 8, NUM_KV_HEADS, 128, 16,
                 qo_indptr=batch.qo_indptr, chunk_tokens=64, tensor_cores=True)
    assert decoder.kernel.tiling.fused_merge and decoder.work.max_splits > 10
    out = torch.empty_like(batch.q)
    run = lambda: decoder.run(batch.q, (batch.k_cache, batch.v_cache), out=out)  # noqa: E731
    assert_right_eager_and_replayed(decoder, run, out, ref, tolerance(torch.bfloat16))


def assert_right_eager_and_replayed(decoder, run, out, ref, tol):
    """run() and a CUDA graph of it, interleaved: each launch matches ref and leaves the fused
    merge's counters (arrivals, shared-tile claims) at 0 for the next."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for launch in (run, run, graph.replay, graph.replay, run):
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        assert_exact(out, None, ref, None, tol, decoder.spec.name)
        buffers = decoder.current_plan.buffers
        assert not buffers.merge_counters.any() and not buffers.tile_counters.any()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim, q_len, mask", [(128, 1, "none"), (64, 3, "causal"), (256, 1, "sliding_window")])
def test_shared_tiles_are_exact_and_leave_their_counters_at_zero(tmp_path, monkeypatch, kv_dtype, head_dim, q_len,
                                                                 mask):
    """Split requests whose CTAs share their tiles (the tuning table's static_share, here 50 for every kernel):
    whatever tiles each CTA claims, the merged output matches the reference, on every launch, eager
    and replayed, as the last CTA of each group sets its claim counter back to 0."""
    from flashjit.kernels.decode import tiling
    from flashjit.serving.quantize import dequantize_kv, quantize_kv

    monkeypatch.setattr(tiling, "TUNING", tiling.TUNING.with_rows(static_share=50))
    kv_lens = [9000, 1, 700, 0, 2500]
    batch = make_batch(kv_lens, num_qo_heads=4 * NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                       page_size=16, q_lens=[min(q_len, n) for n in kv_lens], seed=12)
    cache, scales, k_ref, v_ref = (batch.k_cache, batch.v_cache), (None, None), batch.k_cache, batch.v_cache
    if kv_dtype != "bfloat16":
        (k8, k_scale), (v8, v_scale) = (quantize_kv(c, kv_dtype) for c in (batch.k_cache, batch.v_cache))
        cache, scales = (k8, v8), (k_scale.item(), v_scale.item())
        k_ref, v_ref = dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale)
    params = {"window_left": 5000} if mask == "sliding_window" else {}  # still spans of 5 chunks
    ref, _ = decode_reference(batch.q, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len,
                              qo_indptr=batch.qo_indptr, mask=mask, mask_params=params)
    decoder = flashjit.BatchDecode(flashjit.Engine(cache_dir=tmp_path))
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 4 * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, 16,
                 qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, kv_dtype=kv_dtype, chunk_tokens=1024,
                 tensor_cores=True)
    tiling_ = decoder.kernel.tiling
    assert tiling_.static_share == 50 and decoder.work.max_splits >= 3
    assert 1024 // tiling_.tile_tokens > tiling_.stages + 1  # fair shares long enough to share
    out = torch.empty_like(batch.q)
    run = lambda: decoder.run(batch.q, cache, out=out, k_scale=scales[0], v_scale=scales[1])  # noqa: E731
    run()
    assert_right_eager_and_replayed(decoder, run, out, ref, tolerance(torch.bfloat16, kv_dtype))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combined", [False, True], ids=["k_v", "kv"])
def test_layouts_and_combined_cache(engine, layout, combined):
    kv_lens = [17, 500, 3000]
    batch = make_batch(kv_lens, num_qo_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=128, page_size=16,
                       kv_layout=layout, seed=3)
    ref, ref_lse = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                    batch.last_page_len, kv_layout=layout)
    cache = torch.stack([batch.k_cache, batch.v_cache], dim=1) if combined else (batch.k_cache, batch.v_cache)
    decoder = flashjit.BatchDecode(engine)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 8, NUM_KV_HEADS, 128, 16, kv_layout=layout)
    out, lse = decoder.run(batch.q, cache, return_lse=True)
    assert_exact(out, lse, ref, ref_lse, tolerance(torch.bfloat16), decoder.spec.name)


@pytest.mark.parametrize("head_dim", [96])
@pytest.mark.parametrize("group", [3, 5, 6, 16])
def test_other_groups_and_head_dims(engine, head_dim, group):
    kv_lens = [0, 5, 700, 4100]
    batch = make_batch(kv_lens, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=128, seed=group)
    ref, _ = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices, batch.last_page_len)
    out = flashjit.decode(batch.q, (batch.k_cache, batch.v_cache), batch.indptr, batch.indices,
                          batch.last_page_len, engine=engine)
    assert_exact(out, None, ref, None, tolerance(torch.bfloat16), f"group {group}")


def test_run_rejects_bad_tensors(engine):
    batch = make_batch([40, 90], num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, seed=1)
    decoder = flashjit.BatchDecode(engine)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 8, 2, 128, 16)
    with pytest.raises(ValueError, match="q: expected dtype torch.bfloat16"):
        decoder.run(batch.q.half(), (batch.k_cache, batch.v_cache))
    with pytest.raises(ValueError, match="q: expected shape"):
        decoder.run(batch.q[:1], (batch.k_cache, batch.v_cache))
    with pytest.raises(ValueError, match="k_cache: expected more than"):
        decoder.run(batch.q, (batch.k_cache[:2], batch.v_cache[:2]))
    with pytest.raises(ValueError, match="q: expected a tensor on cuda"):
        decoder.run(batch.q.cpu(), (batch.k_cache, batch.v_cache))


def test_plan_rejects_bad_page_table(engine):
    batch = make_batch([40, 90], num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, seed=1)
    decoder = flashjit.BatchDecode(engine)
    with pytest.raises(ValueError, match="indptr: expected non-decreasing"):
        decoder.plan(torch.tensor([0, 5, 3]), batch.indices, batch.last_page_len, 8, 2, 128, 16)
    with pytest.raises(ValueError, match="last_page_len"):
        decoder.plan(batch.indptr, batch.indices, torch.tensor([17, 3]), 8, 2, 128, 16)
    with pytest.raises(ValueError, match="indices: expected page ids >= 0"):
        decoder.plan(batch.indptr, batch.indices - 100, batch.last_page_len, 8, 2, 128, 16)
    with pytest.raises(ValueError, match="indices: expected at least"):
        decoder.plan(batch.indptr, batch.indices[:2], batch.last_page_len, 8, 2, 128, 16)


def test_plan_without_the_page_id_check_decodes_the_same(engine):
    """check_page_ids=False skips the ids' round trip to the host, nothing else."""
    batch = make_batch([40, 900, 3000], num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, seed=3)
    args = (batch.indptr, batch.indices, batch.last_page_len, 8, 2, 128, 16)
    outs = []
    for check in (True, False):
        decoder = flashjit.BatchDecode(engine).plan(*args, check_page_ids=check)
        outs.append(decoder.run(batch.q, (batch.k_cache, batch.v_cache)))
    ref, _ = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices, batch.last_page_len)
    assert torch.equal(outs[0], outs[1])
    assert_exact(outs[1], None, ref, None, tolerance(torch.bfloat16))


def _tables(kv_lens, page_size, pool, gen):
    """Page table of a batch over an existing pool of pages (shuffled, disjoint)."""
    pages = [-(-n // page_size) for n in kv_lens]
    ids = torch.randperm(pool, generator=gen)[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return indptr, ids.cuda(), last


@pytest.mark.parametrize("mask", ["none", "sliding_window"])
def test_cuda_graph_replays_after_new_plan(engine, mask):
    heads, kv_heads, dim, page, pool = 32, 8, 128, 16, 2000
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(pool, page, kv_heads, dim, generator=gen).bfloat16().cuda()
    v = torch.randn(pool, page, kv_heads, dim, generator=gen).bfloat16().cuda()
    q_static = torch.randn(8, heads, dim, generator=gen).bfloat16().cuda()
    out_static = torch.full_like(q_static, float("nan"))
    params = {"window_left": 700} if mask == "sliding_window" else {}
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=8, max_num_pages=pool)

    def plan(kv_lens):
        indptr, ids, last = _tables(kv_lens, page, pool, gen)
        decoder.plan(indptr, ids, last, heads, kv_heads, dim, page, mask=mask, mask_params=params)
        return indptr, ids, last

    tables = plan([100, 3000, 17])
    decoder.run(q_static, (k, v), out=out_static)  # load and warm up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q_static, (k, v), out=out_static)

    for kv_lens in ([100, 3000, 17], [5000, 1, 40, 900, 0, 20000, 16, 33], [1]):
        tables = plan(kv_lens)
        q_static.copy_(torch.randn(q_static.shape, generator=gen).bfloat16())
        out_static.fill_(float("nan"))
        graph.replay()
        n = len(kv_lens)
        ref, _ = decode_reference(q_static[:n], k, v, *tables, mask=mask, mask_params=params)
        assert_exact(out_static[:n], None, ref, None, tolerance(torch.bfloat16), f"kv_lens={kv_lens}")


def test_get_kernel_during_capture_says_prewarm_first(tmp_path):
    engine = flashjit.Engine(cache_dir=tmp_path)
    spec = flashjit.DecodeSpec(128, "bf16", group_size=4, page_size=16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(flashjit.KernelNotPrewarmed, match="prewarm"):
        with torch.cuda.graph(graph):
            engine.get_kernel(spec)
