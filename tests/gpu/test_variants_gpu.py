"""Attention variants (soft_cap, sinks, soft_cap_sinks) against the float32 reference on the GPU.

A sparse cover of variant x mask x K/V dtype (bf16, e4m3) x head_dim (64, 128, 256, 512) x split:
each row runs one random batch under every split policy of check-mask (the planner's, none, two
chunks, 16-token chunks, fixed items: the sink enters once per row however the request is cut),
with random and zero queries (check_batch: every output row judged on its own against
decode_reference, and with zero queries the keys each row read counted beside its sink). Rows are chosen so that every variant meets every mask, every head_dim and
both dtypes, without the full product (the GPU minutes are few).
"""

from __future__ import annotations

import random

import pytest
import torch

import flashjit
from flashjit.deploy import mask_check as cm
from flashjit.kernels.decode.spec import CUDA_CORE_HEAD_DIMS
from flashjit.masks.registry import masks
from flashjit.masks.variants import variants
from flashjit.serving.reference import decode_reference

from built_ins import BUILT_IN_MASKS, PARAMETRIZED_VARIANTS

from .batches import assert_exact, make_batch

VARIANTS = PARAMETRIZED_VARIANTS
MASKS = BUILT_IN_MASKS
HEAD_DIMS = (64, 128, 256, 512)
NUM_KV_HEADS = 2

# (variant, mask, kv dtype, head_dim, group, q_len, page size): each variant x each mask once per
# dtype, the head_dims cycling, groups 1, 4 and 8.
ROWS = [
    (variant, mask, kv, HEAD_DIMS[(i + j + (kv == "e4m3")) % len(HEAD_DIMS)], (1, 4, 8)[(i + j) % 3],
     (1, 4)[(i * len(MASKS) + j) % 2], (16, 1, 64)[j % 3])
    for i, variant in enumerate(VARIANTS) for j, mask in enumerate(MASKS) for kv in ("bf16", "e4m3")
]


def on_cuda_cores(head_dim: int, group: int, q_len: int) -> bool:
    """Rows of one query row per KV head run the CUDA-core kernel where head_dim has one (the
    automatic choice takes tensor cores, which the other rows cover), so both kernels meet every variant."""
    return group * q_len == 1 and head_dim in CUDA_CORE_HEAD_DIMS


@pytest.fixture(scope="module")
def engine():
    """Every row's kernel compiled up front, in parallel, into the run's cache (tests/gpu/conftest.py)."""
    engine = flashjit.Engine()
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    specs = [flashjit.DecodeSpec(d, dtype="bf16", kv_dtype=kv, mask=m, page_size=p, group_size=g, max_q_len=q,
                                 arch=arch, variant=v, tensor_cores=False if on_cuda_cores(d, g, q) else None)
             for v, m, kv, d, g, q, p in ROWS]
    specs += [flashjit.DecodeSpec(64, mask="sliding_window", group_size=8, arch=arch, variant=v) for v in VARIANTS]
    engine.prewarm(specs, jobs=16)
    return engine


def failure_text(results, where: str) -> str:
    return "\n".join(f"{r.spec} split={r.split} probe={r.probe}: {'; '.join(r.failures)} ({where})"
                     for r in results if not r.passed)


@pytest.mark.parametrize("variant, mask, kv, head_dim, group, q_len, page_size", ROWS,
                         ids=["-".join(map(str, row)) for row in ROWS])
def test_variant_matches_reference(engine, variant, mask, kv, head_dim, group, q_len, page_size, rng):
    kv_lens = cm.random_lengths(rng, page_size)
    q_lens = [min(q_len, n) for n in kv_lens]
    batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                       page_size=page_size, dtype=torch.bfloat16, q_lens=q_lens, seed=rng.randrange(1 << 30))
    params = cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, page_size, "cuda")
    variant_params = variants.get(variant).sample_params(rng, NUM_KV_HEADS * group, "cuda")
    cuda_cores = on_cuda_cores(head_dim, group, q_len)
    results = cm.check_batch(engine, batch, mask, params, tensor_cores=False if cuda_cores else None, variant=variant,
                             variant_params=variant_params, kv_dtype="float8_e4m3fn" if kv == "e4m3" else None)
    assert all(r.spec.endswith("_tc") != cuda_cores and f"-{variant}_" in r.spec for r in results)
    where = f"kv_lens={kv_lens} q_lens={q_lens} {cm.describe_params({**params, **variant_params})}"
    assert all(r.passed for r in results), failure_text(results, where)


@pytest.mark.parametrize("cap", [2.0**-126, 1e-20, 2.0**64])
@pytest.mark.parametrize("split", ["one", "many"])
def test_soft_caps_at_the_edges_of_the_accepted_range(engine, cap, split):
    """plan() accepts caps from the smallest normal float32 (every logit ~0: uniform weights) to
    2**64 (tanh the identity): the kernel's cap * tanh(score * (1 / cap)) gives no NaN and no
    zeroed logits at either end, as the float32 reference."""
    group, head_dim = 8, 64
    kv_lens = [1, 37, 700, 5000]
    batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                       page_size=16, seed=11)
    params, variant_params = {"window_left": 1 << 20}, {"logits_soft_cap": cap}
    cache = (batch.k_cache, batch.v_cache)
    ref, ref_lse = decode_reference(batch.q, *cache, batch.indptr, batch.indices, batch.last_page_len,
                                    qo_indptr=batch.qo_indptr, mask="sliding_window", mask_params=params,
                                    variant="soft_cap", variant_params=variant_params)
    out, lse, _ = cm.plan_and_run(engine, batch, "sliding_window", params, split, variant="soft_cap",
                                  variant_params=variant_params)
    assert out.isfinite().all() and lse.isfinite().all()
    _, _, failures = cm.compare(out, lse, ref, ref_lse, cm.run_tolerance(batch.q.dtype, None, "soft_cap"))
    assert not failures, f"cap {cap}, split={split}: {'; '.join(failures)}"


def shorter(batch, lens):
    """(indptr, indices, last_page_len) of the batch's requests cut to lens, over the same pages."""
    ps, indptr, ids, last = batch.page_size, batch.indptr.tolist(), [], []
    new_indptr = [0]
    for r, n in enumerate(lens):
        pages = -(-n // ps)
        ids += batch.indices[indptr[r]:indptr[r] + pages].tolist()
        new_indptr.append(len(ids))
        last.append(n - (pages - 1) * ps if pages else 0)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    return as_tensor(new_indptr), as_tensor(ids), as_tensor(last)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_in_cuda_graph_replays_new_sinks_and_lengths(engine, variant):
    """A captured run() under a variant replays correctly after a plan() with other lengths, with
    the sinks rewritten in place in between (the launch reads them at replay)."""
    group, head_dim, page_size = 8, 64, 16
    heads = NUM_KV_HEADS * group
    batch = make_batch([3000, 17, 900, 64], num_qo_heads=heads, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                       page_size=page_size, seed=1)
    decoder = flashjit.BatchDecode(engine, device="cuda", use_cuda_graph=True, max_batch_size=4,
                                   max_num_pages=batch.indices.numel())
    variant_params = variants.get(variant).sample_params(random.Random(0), heads, "cuda")

    def plan(tables):
        decoder.plan(*tables, heads, NUM_KV_HEADS, head_dim, page_size, mask="sliding_window", window_left=127,
                     variant=variant, variant_params=variant_params)

    cache = (batch.k_cache, batch.v_cache)
    plan(shorter(batch, [100, 5, 2, 64]))
    out = torch.empty_like(batch.q)
    decoder.run(batch.q, cache, out=out)  # loads the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(batch.q, cache, out=out)
    if "sinks" in variant:
        variant_params["sinks"].mul_(-1.5)
    tables = shorter(batch, [3000, 17, 900, 64])
    plan(tables)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = decode_reference(batch.q, *cache, *tables, mask="sliding_window", mask_params={"window_left": 127},
                              variant=variant, variant_params=variant_params)
    assert_exact(out, None, ref, None, cm.run_tolerance(torch.bfloat16, variant=variant), decoder.spec.name)
