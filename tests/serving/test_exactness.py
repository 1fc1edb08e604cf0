"""The per-row exactness check (flashjit.serving.exactness) on the CPU, on the GPU tests' own batch
shapes: a kernel that rounds as a correct tensor-core kernel does passes it with room to spare; one
that skips a single 16-key chunk of the long request fails it, where one relative error over the
batch and an LSE within 2e-2 (the check the GPU tests had) let that kernel pass; zero queries count
every key, one key more or fewer, at 70k keys too."""

from __future__ import annotations

import random

import pytest
import torch

from flashjit.deploy.mask_check import random_lengths
from flashjit.deploy.random_batches import make_batch, rel_error
from flashjit.serving import exactness
from flashjit.serving.reference import decode_reference, gather_request_kv

OLD_OUT_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative over the whole batch
OLD_LSE_ATOL, OLD_LSE_RTOL = 2e-2, 1e-3


def emulated_decode(batch, *, q=None, drop=None, extra=None, p_dtype=None, out_dtype=None):
    """Softmax attention over each request's keys as a tensor-core kernel rounds it: weights rounded
    to p_dtype before P V, the output to out_dtype (both the query's type by default), the LSE from
    the unrounded fp32 weights. drop=(request, begin, end): those keys are not read (a skipped work
    item); extra=(request, key): that key is read twice."""
    q = batch.q if q is None else q
    p_dtype, out_dtype = p_dtype or q.dtype, out_dtype or q.dtype
    tokens, heads, dim = q.shape
    out = torch.zeros(tokens, heads, dim)
    lse = torch.full((tokens, heads), float("-inf"))
    qo = batch.qo_indptr.tolist()
    for r, kv_len in enumerate(batch.kv_lens):
        q0, q1 = qo[r], qo[r + 1]
        if kv_len == 0 or q1 == q0:
            continue
        pages = batch.indices[int(batch.indptr[r]):int(batch.indptr[r + 1])]
        k = gather_request_kv(batch.k_cache, pages, kv_len).float()
        v = gather_request_kv(batch.v_cache, pages, kv_len).float()
        keep = torch.ones(kv_len)
        if drop and drop[0] == r:
            keep[drop[1]:drop[2]] = 0
        if extra and extra[0] == r:
            keep[extra[1]] += 1
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,khd->htk", q[q0:q1].float(), k) / dim ** 0.5
        top = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - top) * keep
        total = weights.sum(-1)
        rounded = weights.to(p_dtype).float()
        out[q0:q1] = (torch.einsum("htk,khd->thd", rounded, v) / total.T[..., None]).to(out_dtype).float()
        lse[q0:q1] = (top[..., 0] + total.log()).T
    return out.to(out_dtype), lse


def gpu_test_batch(seed: int, dtype, head_dim: int, group: int, q_len: int, page_size: int = 16):
    """A batch as tests/gpu build them: lengths 0, 1, page multiples and not, and a long request."""
    rng = random.Random(seed)
    kv_lens = random_lengths(rng, page_size)
    batch = make_batch(kv_lens, num_qo_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
                       dtype=dtype, q_lens=[min(q_len, n) for n in kv_lens], seed=seed, device="cpu")
    ref, ref_lse = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                    batch.last_page_len, qo_indptr=batch.qo_indptr)
    return batch, ref, ref_lse


def old_check_passes(out, lse, ref, ref_lse, dtype) -> bool:
    finite = ref_lse.isfinite()
    return (rel_error(out, ref) <= OLD_OUT_TOLERANCE[dtype]
            and torch.allclose(lse[finite], ref_lse[finite], atol=OLD_LSE_ATOL, rtol=OLD_LSE_RTOL))


SHAPES = [(torch.bfloat16, 128, 4, 1), (torch.bfloat16, 64, 1, 4), (torch.float16, 256, 7, 1), (torch.float16, 128, 8, 4)]


@pytest.mark.parametrize("dtype, head_dim, group, q_len", SHAPES)
def test_a_kernel_rounding_as_tensor_cores_do_passes_with_room(dtype, head_dim, group, q_len):
    for seed in range(3):
        batch, ref, ref_lse = gpu_test_batch(seed, dtype, head_dim, group, q_len)
        out, lse = emulated_decode(batch)
        tol = exactness.tolerance(dtype)
        result = exactness.check_rows(out, lse, ref, ref_lse, tol)
        assert result.passed, result.failures
        assert result.worst_out < 0.6 * tol.out and result.worst_lse < 1e-4, result.summary()


@pytest.mark.parametrize("dtype, head_dim, group, q_len", SHAPES)
def test_one_skipped_chunk_of_the_long_request_fails_per_row_and_passed_the_batch_check(dtype, head_dim, group, q_len):
    batch, ref, ref_lse = gpu_test_batch(5, dtype, head_dim, group, q_len)
    long = max(range(len(batch.kv_lens)), key=batch.kv_lens.__getitem__)
    assert batch.kv_lens[long] >= 1500
    middle = batch.kv_lens[long] // 2 // 16 * 16
    out, lse = emulated_decode(batch, drop=(long, middle, middle + 16))
    if dtype == torch.bfloat16:  # the case: bf16 at 1e-2 over the batch
        assert old_check_passes(out, lse, ref, ref_lse, dtype), "the batch-wide check saw the chunk: nothing to reproduce"
    result = exactness.check_rows(out, lse, ref, ref_lse, exactness.tolerance(dtype))
    assert not result.passed and "off the reference" in result.failures[0]
    first, end = batch.qo_indptr[long], batch.qo_indptr[long + 1]
    assert first <= result.worst_out_row[0] < end  # the worst row is the long request's
    assert result.worst_out > 2 * result.tolerance.out


def test_a_tenth_of_the_long_request_skipped_passed_the_batch_checks_output_bound():
    dtype = torch.bfloat16
    batch, ref, ref_lse = gpu_test_batch(5, dtype, 128, 4, 1)
    long = max(range(len(batch.kv_lens)), key=batch.kv_lens.__getitem__)
    out, lse = emulated_decode(batch, drop=(long, 0, batch.kv_lens[long] // 10))
    assert rel_error(out, ref) <= OLD_OUT_TOLERANCE[dtype]
    assert not exactness.check_rows(out, lse, ref, ref_lse, exactness.tolerance(dtype)).passed


def test_zero_queries_count_every_key_even_at_70k_keys():
    batch = make_batch([70_001, 3, 0, 4096], num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       seed=1, device="cpu")
    q = torch.zeros_like(batch.q)
    _, ref_lse = decode_reference(q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                  batch.last_page_len)
    counts = exactness.key_counts(ref_lse)
    assert counts[:, 0].tolist() == [70_001, 3, 0, 4096]
    _, lse = emulated_decode(batch, q=q)
    assert exactness.check_key_counts(lse, counts) == ()
    for fault in (dict(drop=(0, 7, 8)), dict(extra=(0, 69_999)), dict(drop=(3, 4095, 4096))):
        _, lse = emulated_decode(batch, q=q, **fault)
        failures = exactness.check_key_counts(lse, counts)
        assert failures and "another number of keys" in failures[0], fault


def test_zero_queries_count_keys_beside_a_sink():
    counts = torch.tensor([[5, 0], [1000, 1]])
    sink = torch.tensor([0.5, -2.0])
    lse = (counts.double() + sink.double().exp()).log().float()
    assert exactness.check_key_counts(lse, counts, sink=sink) == ()
    assert exactness.check_key_counts(lse, counts + torch.tensor([[0, 0], [1, 0]]), sink=sink)


def test_rows_that_see_no_key_must_be_zero_and_nan_fails():
    ref = torch.zeros(2, 3, 8)
    ref[0] = 1.0
    ref_lse = torch.tensor([[0.0] * 3, [float("-inf")] * 3])
    tol = exactness.tolerance("bfloat16")
    out, lse = ref.clone(), ref_lse.clone()
    assert exactness.check_rows(out, lse, ref, ref_lse, tol).passed
    out[1, 2, 0] = 1e-30
    assert "see no key are not 0" in exactness.check_rows(out, lse, ref, ref_lse, tol).failures[0]
    out[1, 2, 0], out[0, 1, 3] = 0.0, float("nan")
    assert "NaN in 1 output rows" in exactness.check_rows(out, lse, ref, ref_lse, tol).failures[0]
    out[0, 1, 3], lse[1, 0] = 1.0, 0.0
    assert "disagree with the reference" in exactness.check_rows(out, lse, ref, ref_lse, tol).failures[0]
    with pytest.raises(AssertionError, match="disagree"):
        exactness.assert_exact(out, lse, ref, ref_lse, tol, where="here")


def test_tolerances_follow_the_dtypes():
    bf16, f16 = exactness.tolerance(torch.bfloat16), exactness.tolerance("float16")
    fp8 = exactness.tolerance("bfloat16", "float8_e4m3fn")
    assert f16.out < fp8.out < bf16.out < 2e-2  # fp8 caches multiply P V in f16, output in the query's type
    assert exactness.tolerance("bf16", approx_logits=True).lse > bf16.lse == exactness.LSE_ATOL
    assert exactness.tolerance("float32").out < 2e-5
    with pytest.raises(ValueError, match=r"dtype: expected one of \['bfloat16', 'float16', 'float32'\]"):
        exactness.unit_roundoff("int8")
