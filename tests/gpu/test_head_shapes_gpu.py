"""Group 1 (MHA) and head_dim 96 on the tensor-core kernels, against the float32 reference.

16-bit (bf16, f16) and fp8 (e4m3, e5m2) K/V; every split policy of check-mask (none, the planner's,
two chunks, 16-token chunks, fixed 48-token items); every built-in mask (those whose key positions
jump among them); one and several query tokens; page sizes that divide head_dim 96's copy runs (of 6
keys, 3 for fp8: page 12) and ones they straddle (5, 16, 64: runs over two pages; 1: key by key).
Every output row (query token x head) is written (no NaN) and matches the reference within a bound
from the dtypes, and fully masked rows are 0 with lse -inf.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashjit
from flashjit.deploy import mask_check as cm
from flashjit.masks.registry import masks
from flashjit.serving.quantize import dequantize_kv, quantize_kv
from flashjit.serving.reference import decode_reference

from built_ins import BUILT_IN_MASKS

from .batches import assert_exact, make_batch, tolerance

NUM_KV_HEADS = 2
MASKS = BUILT_IN_MASKS
# (query dtype, K/V dtype): 16-bit K/V take the query's dtype
DTYPES = [("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float8_e4m3fn"), ("float16", "float8_e5m2")]
# (head_dim, group): head_dim 96 at MHA and GQA groups, MHA at the other head_dims
SHAPES = [(96, 1), (96, 4), (96, 8), (64, 1), (128, 1), (256, 1)]
PAGES = {96: [1, 5, 12, 16, 64], 64: [1, 16], 128: [1, 16], 256: [16]}
Q_LENS = [1, 3]
@pytest.fixture(scope="session")
def engine():
    engine = flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    specs = [flashjit.DecodeSpec(d, dtype=q, kv_dtype=kv, mask=m, page_size=p, group_size=g, max_q_len=n, arch=arch)
             for m, (q, kv), (d, g), n in itertools.product(MASKS, DTYPES, SHAPES, Q_LENS) for p in PAGES[d]]
    assert all(spec.tensor_cores for spec in specs)
    engine.prewarm(specs, jobs=16)
    return engine


def cache_and_reference(batch, kv_dtype: str):
    """The cache the kernel reads, its scales, and the K/V the reference reads (dequantized for fp8)."""
    if not kv_dtype.startswith("float8"):
        return (batch.k_cache, batch.v_cache), (None, None), (batch.k_cache, batch.v_cache)
    (k8, k_scale), (v8, v_scale) = (quantize_kv(c, kv_dtype) for c in (batch.k_cache, batch.v_cache))
    return (k8, v8), (k_scale.item(), v_scale.item()), (dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale))


def run(engine, batch, cache, scales, kv_dtype, mask, params, split):
    decoder = flashjit.BatchDecode(engine)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, batch.q.shape[1], NUM_KV_HEADS, batch.q.shape[2],
                 batch.page_size, qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, q_dtype=batch.q.dtype,
                 kv_dtype=kv_dtype, **cm.split_options(split, batch.kv_lens))
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device="cuda")
    decoder.run(batch.q, cache, out=out, lse=lse, k_scale=scales[0], v_scale=scales[1])
    return out, lse, decoder


@pytest.mark.parametrize("q_len", Q_LENS)
@pytest.mark.parametrize("head_dim,group", SHAPES, ids=[f"d{d}-g{g}" for d, g in SHAPES])
@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPES, ids=["bf16", "f16", "e4m3", "e5m2"])
@pytest.mark.parametrize("mask", MASKS)
def test_tensor_cores_match_reference(engine, mask, q_dtype, kv_dtype, head_dim, group, q_len, rng):
    for page_size in PAGES[head_dim]:
        kv_lens = cm.random_lengths(rng, page_size)
        q_lens = [min(q_len, n) for n in kv_lens]
        batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                           page_size=page_size, dtype=getattr(torch, q_dtype), q_lens=q_lens,
                           seed=rng.randint(0, 1 << 30))
        cache, scales, (k_ref, v_ref) = cache_and_reference(batch, kv_dtype)
        params = cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, page_size, "cuda")
        ref, ref_lse = decode_reference(batch.q, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len,
                                        qo_indptr=batch.qo_indptr, mask=mask, mask_params=params)
        for split in cm.SPLITS:
            out, lse, decoder = run(engine, batch, cache, scales, kv_dtype, mask, params, split)
            where = (f"{decoder.spec.name} split={split} kv_lens={kv_lens} q_lens={q_lens} "
                     f"params: {cm.describe_params(params)}")
            assert decoder.kernel.tiling.tensor_cores, where
            assert_exact(out, lse, ref, ref_lse, tolerance(q_dtype, kv_dtype), where)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_mha_and_head_dim_96_long_rows_in_a_cuda_graph(engine, kv_dtype):
    """Long requests split many ways (the fused merge), eager and replayed from a CUDA graph: the same
    output each launch, so the merge's counters are back at 0 after each."""
    for head_dim, group in ((96, 1), (128, 1), (96, 4)):
        kv_lens = [9000, 1, 700, 0, 2500]
        batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                           page_size=16, dtype=torch.bfloat16, seed=head_dim + group)
        cache, scales, (k_ref, v_ref) = cache_and_reference(batch, kv_dtype)
        ref, _ = decode_reference(batch.q, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len)
        decoder = flashjit.BatchDecode(engine)
        decoder.plan(batch.indptr, batch.indices, batch.last_page_len, NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim,
                     16, kv_dtype=kv_dtype, chunk_tokens=512)
        assert decoder.kernel.tiling.tensor_cores and decoder.work.max_splits > 10
        out = torch.empty_like(batch.q)
        launch = lambda: decoder.run(batch.q, cache, out=out, k_scale=scales[0], v_scale=scales[1])  # noqa: E731
        launch()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        for call in (launch, graph.replay, graph.replay, launch):
            out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            assert_exact(out, None, ref, None, tolerance("bfloat16", kv_dtype), decoder.spec.name)
            buffers = decoder.current_plan.buffers
            assert not buffers.merge_counters.any() and not buffers.tile_counters.any()
