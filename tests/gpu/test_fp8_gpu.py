"""fp8 KV caches (e4m3, e5m2) against the float32 reference on the dequantized cache, row by row.

Every mask, both kernels (the CUDA-core kernel at every head_dim it serves), every split policy,
GQA and several query tokens, with the three forms of scale: a float, a one-element tensor and a
per-KV-head tensor.
"""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch

import flashjit
from flashjit.deploy import mask_check as cm
from flashjit.kernels.decode.spec import CUDA_CORE_HEAD_DIMS
from flashjit.serving.quantize import dequantize_kv, quantize_kv
from flashjit.serving.reference import decode_reference
from flashjit.masks.registry import masks

from built_ins import BUILT_IN_MASKS

from .batches import assert_exact, make_batch, tolerance

KV_AND_Q = [("float8_e4m3fn", torch.bfloat16), ("float8_e5m2", torch.float16)]
MASKS = BUILT_IN_MASKS
HEAD_DIMS = [64, 96, 128, 256]
GROUPS = [1, 4, 8]
Q_LENS = [1, 4]
PAGE = 16
SCALE_FORMS = ["float", "tensor", "per_head"]
NUM_KV_HEADS = cm.NUM_KV_HEADS
# Beyond the grid: f16 queries on e4m3, other page sizes, and the CUDA-core kernel at every head_dim
# it serves, both fp8 types, one and several rows a KV head.
EXTRA = [dict(kv="float8_e4m3fn", q=torch.float16, head_dim=128, group=4, q_len=1, page=PAGE, tc=None),
         dict(kv="float8_e4m3fn", q=torch.bfloat16, head_dim=128, group=8, q_len=1, page=1, tc=None),
         dict(kv="float8_e4m3fn", q=torch.bfloat16, head_dim=64, group=4, q_len=1, page=64, tc=None)]
EXTRA += [dict(kv=kv, q=q, head_dim=d, group=group, q_len=q_len, page=PAGE, tc=False)
          for d in CUDA_CORE_HEAD_DIMS
          for kv, q, group, q_len in (("float8_e4m3fn", torch.bfloat16, 4, 4), ("float8_e5m2", torch.bfloat16, 1, 1))]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def spec_of(arch, mask, kv, q, head_dim, group, q_len, page, tc=None):
    return flashjit.DecodeSpec(head_dim, dtype=q, kv_dtype=kv, mask=mask, page_size=page, group_size=group,
                               max_q_len=q_len, arch=arch, tensor_cores=tc)


@pytest.fixture(scope="session")
def engine():
    engine = flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    specs = [spec_of(arch, m, kv, str(q).removeprefix("torch."), d, g, n, PAGE)
             for m, (kv, q), d, g, n in itertools.product(MASKS, KV_AND_Q, HEAD_DIMS, GROUPS, Q_LENS)]
    specs += [spec_of(arch, m, e["kv"], str(e["q"]).removeprefix("torch."), e["head_dim"], e["group"], e["q_len"],
                      e["page"], e["tc"]) for m in MASKS for e in EXTRA]
    engine.prewarm(specs, jobs=16)
    return engine


def quantized_cache(batch, kv_dtype: str, scale_form: str):
    """((k8, v8), (k_scale, v_scale), (k, v) dequantized in float32)."""
    per_head = scale_form == "per_head"
    k8, k_scale = quantize_kv(batch.k_cache, kv_dtype, per_head=per_head, kv_layout=batch.kv_layout)
    v8, v_scale = quantize_kv(batch.v_cache, kv_dtype, per_head=per_head, kv_layout=batch.kv_layout)
    dequantized = (dequantize_kv(k8, k_scale, kv_layout=batch.kv_layout),
                   dequantize_kv(v8, v_scale, kv_layout=batch.kv_layout))
    if scale_form == "float":
        k_scale, v_scale = k_scale.item(), v_scale.item()
    return (k8, v8), (k_scale, v_scale), dequantized


def run_fp8(engine, batch, cache, scales, kv_dtype, mask, params, split, tensor_cores=None):
    decoder = flashjit.BatchDecode(engine)
    num_qo_heads = batch.q.shape[1]
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, num_qo_heads, NUM_KV_HEADS, batch.q.shape[2],
                 batch.page_size, qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, q_dtype=batch.q.dtype,
                 kv_dtype=kv_dtype, kv_layout=batch.kv_layout, tensor_cores=tensor_cores,
                 **cm.split_options(split, batch.kv_lens))
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device="cuda")
    decoder.run(batch.q, cache, out=out, lse=lse, k_scale=scales[0], v_scale=scales[1])
    return out, lse, decoder


def check_case(engine, mask, kv_dtype, q_dtype, head_dim, group, q_len, page_size, tensor_cores, rng):
    kv_lens = cm.random_lengths(rng, page_size)
    q_lens = [min(q_len, n) for n in kv_lens]
    batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                       page_size=page_size, dtype=q_dtype, q_lens=q_lens, seed=rng.randint(0, 1 << 30))
    scale_form = rng.choice(SCALE_FORMS)
    cache, scales, (k_ref, v_ref) = quantized_cache(batch, kv_dtype, scale_form)
    params = cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, page_size, "cuda")
    ref, ref_lse = decode_reference(batch.q, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len,
                                    qo_indptr=batch.qo_indptr, mask=mask, mask_params=params)
    for split in cm.SPLITS:
        out, lse, decoder = run_fp8(engine, batch, cache, scales, kv_dtype, mask, params, split, tensor_cores)
        where = (f"{decoder.spec.name} split={split} scales={scale_form} kv_lens={kv_lens} q_lens={q_lens} "
                 f"params: {cm.describe_params(params)}")
        assert tensor_cores is None or decoder.spec.tensor_cores == tensor_cores, where
        assert_exact(out, lse, ref, ref_lse, tolerance(q_dtype, kv_dtype), where)


@pytest.mark.parametrize("q_len", Q_LENS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype,q_dtype", KV_AND_Q, ids=["e4m3-bf16", "e5m2-f16"])
@pytest.mark.parametrize("mask", MASKS)
def test_matches_dequantized_reference(engine, mask, kv_dtype, q_dtype, head_dim, group, q_len):
    rng = random.Random(seed_of(mask, kv_dtype, head_dim, group, q_len))
    check_case(engine, mask, kv_dtype, q_dtype, head_dim, group, q_len, PAGE, None, rng)


@pytest.mark.parametrize("case", range(len(EXTRA)))
@pytest.mark.parametrize("mask", MASKS)
def test_other_queries_kernels_and_pages(engine, mask, case):
    e = EXTRA[case]
    rng = random.Random(seed_of(mask, case))
    check_case(engine, mask, e["kv"], e["q"], e["head_dim"], e["group"], e["q_len"], e["page"], e["tc"], rng)


def plan_fp8(engine, batch, kv_dtype="float8_e4m3fn"):
    decoder = flashjit.BatchDecode(engine)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, batch.q.shape[1], NUM_KV_HEADS, batch.q.shape[2],
                 batch.page_size, kv_dtype=kv_dtype)
    return decoder


def test_bad_fp8_input_is_refused(engine):
    batch = make_batch([40, 300], num_qo_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=128, page_size=PAGE, seed=2)
    (k8, v8), (k_scale, v_scale), _ = quantized_cache(batch, "float8_e4m3fn", "tensor")
    decoder = plan_fp8(engine, batch)
    with pytest.raises(ValueError, match="k_cache: expected dtype torch.float8_e4m3fn"):
        decoder.run(batch.q, (batch.k_cache, batch.v_cache), k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="k_cache: expected dtype torch.float8_e4m3fn"):
        decoder.run(batch.q, (k8.view(torch.float8_e5m2), v8.view(torch.float8_e5m2)), k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale: expected a scale for the fp8 cache"):
        decoder.run(batch.q, (k8, v8), k_scale=k_scale)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "1.0", True):
        with pytest.raises(ValueError, match="k_scale: expected a positive float"):
            decoder.run(batch.q, (k8, v8), k_scale=bad, v_scale=v_scale)
    with pytest.raises(ValueError, match="v_scale: expected positive finite values"):
        decoder.run(batch.q, (k8, v8), k_scale=k_scale, v_scale=-v_scale)
    with pytest.raises(ValueError, match="k_scale: expected 1 or num_kv_heads=2"):
        decoder.run(batch.q, (k8, v8), k_scale=torch.ones(3, device="cuda"), v_scale=v_scale)
    with pytest.raises(ValueError, match="k_scale: expected dtype torch.float32"):
        decoder.run(batch.q, (k8, v8), k_scale=k_scale.half(), v_scale=v_scale)
    with pytest.raises(ValueError, match="out_dtype: expected float16 or bfloat16 with e4m3 queries"):
        decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 8, NUM_KV_HEADS, 128, PAGE,
                     q_dtype=torch.float8_e4m3fn, kv_dtype="e4m3")
    with pytest.raises(ValueError, match="q: expected dtype torch.bfloat16"):  # a bf16 plan given e4m3 queries
        decoder.run(batch.q.to(torch.float8_e4m3fn), (k8, v8), k_scale=k_scale, v_scale=v_scale)
    out = decoder.run(batch.q, (k8, v8), k_scale=k_scale, v_scale=v_scale)  # nothing was corrupted
    assert not out.isnan().any()


def test_scale_tensors_change_between_graph_replays(engine):
    """Scales are read at launch: new values reach a captured run() without a re-plan."""
    batch = make_batch([100, 2000, 17], num_qo_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=128, page_size=PAGE,
                       seed=4)
    (k8, v8), (k_scale, v_scale), (k_ref, v_ref) = quantized_cache(batch, "float8_e4m3fn", "per_head")
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=4, max_num_pages=len(batch.indices))
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 8, NUM_KV_HEADS, 128, PAGE, kv_dtype="e4m3")
    out = torch.full_like(batch.q, float("nan"))
    decoder.run(batch.q, (k8, v8), out=out, k_scale=k_scale, v_scale=v_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(batch.q, (k8, v8), out=out, k_scale=k_scale, v_scale=v_scale)
    for factor in (1.0, 3.0, 0.25):
        k_scale.mul_(factor)
        v_scale.mul_(1 / factor)
        k_ref.mul_(factor)
        v_ref.mul_(1 / factor)
        out.fill_(float("nan"))
        graph.replay()
        ref, _ = decode_reference(batch.q, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len)
        assert_exact(out, None, ref, None, tolerance(torch.bfloat16, "float8_e4m3fn"), f"factor {factor}")


FP8_QUERY_CASES = [(d, group, q_len) for d in HEAD_DIMS for group, q_len in ((1, 1), (4, 1), (8, 4))]


@pytest.mark.parametrize("head_dim,group,q_len", FP8_QUERY_CASES)
def test_e4m3_queries_match_the_reference_on_their_values(engine, head_dim, group, q_len):
    """e4m3 queries (q_dtype e4m3, a bf16 output) over an e4m3 cache: the kernel reads the queries'
    values exactly, so the reference on the dequantized queries bounds it as for bf16 queries; the
    query scale folds into k_scale. Every split policy, masks with and without per-request state."""
    rng = random.Random(seed_of("e4m3 queries", head_dim, group, q_len))
    kv_lens = cm.random_lengths(rng, PAGE)
    q_lens = [min(q_len, n) for n in kv_lens]
    batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                       page_size=PAGE, dtype=torch.bfloat16, q_lens=q_lens, seed=rng.randint(0, 1 << 30))
    q_scale = 0.25
    q8 = (batch.q.float() / q_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    q_values = (q8.float() * q_scale).bfloat16()
    cache, (k_scale, v_scale), (k_ref, v_ref) = quantized_cache(batch, "float8_e4m3fn", rng.choice(SCALE_FORMS))
    for mask in ("none", "sliding_window"):
        params = cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, PAGE, "cuda")
        ref, ref_lse = decode_reference(q_values, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len,
                                        qo_indptr=batch.qo_indptr, mask=mask, mask_params=params)
        for split in cm.SPLITS:
            decoder = flashjit.BatchDecode(engine)
            decoder.plan(batch.indptr, batch.indices, batch.last_page_len, batch.q.shape[1], NUM_KV_HEADS, head_dim,
                         PAGE, qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, q_dtype=torch.float8_e4m3fn,
                         out_dtype=torch.bfloat16, kv_dtype="e4m3", **cm.split_options(split, batch.kv_lens))
            assert decoder.spec.query_fp8, decoder.spec
            out = torch.full_like(batch.q, float("nan"))
            lse = torch.full(batch.q.shape[:2], float("nan"), device="cuda")
            folded = k_scale * q_scale
            decoder.run(q8, cache, out=out, lse=lse, k_scale=folded, v_scale=v_scale)
            where = f"{decoder.spec.name} split={split} kv_lens={kv_lens} q_lens={q_lens}"
            assert_exact(out, lse, ref, ref_lse, tolerance(torch.bfloat16, "float8_e4m3fn"), where)


def test_e4m3_queries_in_a_cuda_graph(engine):
    """A captured run() of e4m3 queries replays after re-plans, as one of bf16 queries does."""
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=8, max_num_pages=2048)
    q8 = torch.zeros(8, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    out = torch.zeros(8, 8, 128, dtype=torch.bfloat16, device="cuda")
    graph = None
    for seed, kv_lens in enumerate(([100, 2000, 17], [5000, 3, 900, 64, 4000, 1, 2, 3000], [9000])):
        batch = make_batch(kv_lens, num_qo_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=128, page_size=PAGE,
                           seed=30 + seed)
        cache, (k_scale, v_scale), (k_ref, v_ref) = quantized_cache(batch, "float8_e4m3fn", "tensor")
        n = len(kv_lens)
        q8[:n].copy_(batch.q.clamp(-448, 448).to(torch.float8_e4m3fn))
        decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 8, NUM_KV_HEADS, 128, PAGE,
                     q_dtype="e4m3", out_dtype="bf16", kv_dtype="e4m3")
        if graph is None:
            k_buf, v_buf = (torch.empty(4096, *cache[0].shape[1:], dtype=cache[0].dtype, device="cuda")
                            for _ in range(2))
            k_scale_buf, v_scale_buf = k_scale.clone(), v_scale.clone()
            decoder.run(q8, (k_buf, v_buf), out=out, k_scale=k_scale_buf, v_scale=v_scale_buf)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decoder.run(q8, (k_buf, v_buf), out=out, k_scale=k_scale_buf, v_scale=v_scale_buf)
        pages = cache[0].shape[0]
        k_buf[:pages].copy_(cache[0])
        v_buf[:pages].copy_(cache[1])
        k_scale_buf.copy_(k_scale)
        v_scale_buf.copy_(v_scale)
        out.fill_(float("nan"))
        graph.replay()
        ref, _ = decode_reference(q8[:n].float().bfloat16(), k_ref, v_ref, batch.indptr, batch.indices,
                                  batch.last_page_len)
        assert_exact(out[:n], None, ref, None, tolerance(torch.bfloat16, "float8_e4m3fn"), f"composition {seed}")
