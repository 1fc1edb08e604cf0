"""Shared-prefix decode on the GPU: random sharing patterns against per-request decode
(share_prefixes=False) and the float32 reference, row by row (flashjit.serving.exactness), eager and
in a CUDA graph, fp8 and multi-token."""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch

import flashjit
from flashjit.worklist.record import RECORD_HEADS
from flashjit.serving import shared_decode
from flashjit.worklist.host import HostPlanner, item_records
from flashjit.serving.reference import decode_reference

from .batches import assert_exact, tolerance

PAGE, HEADS, KV_HEADS, DIM = 16, 32, 8, 128
POOL = 4000
BF16 = tolerance(torch.bfloat16)


@pytest.fixture(scope="module")
def engine():
    return flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)


@pytest.fixture(scope="module")
def cache():
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(POOL, PAGE, KV_HEADS, DIM, generator=gen).bfloat16().cuda()
    v = torch.randn(POOL, PAGE, KV_HEADS, DIM, generator=gen).bfloat16().cuda()
    return k, v


def sharing_batch(pattern: str, rng: random.Random):
    """(page lists, last page lengths) of one sharing pattern over distinct pool pages."""
    pool = iter(rng.sample(range(POOL), POOL))
    fresh = lambda n: [next(pool) for _ in range(n)]  # noqa: E731
    if pattern == "none":
        lists = [fresh(rng.randint(1, 30)) for _ in range(7)]
    elif pattern == "full":  # every request the same pages
        prompt = fresh(40)
        lists = [list(prompt) for _ in range(6)]
    elif pattern == "samples":  # one prompt, own pages after it
        prompt = fresh(rng.randint(20, 200))
        lists = [prompt + fresh(rng.randint(0, 20)) for _ in range(16)]
    elif pattern == "two_levels":  # prompt -> beams -> children, sharing ending at different depths
        prompt = fresh(64)
        lists = []
        for _ in range(3):
            beam = prompt + fresh(rng.randint(1, 12))
            lists += [beam + fresh(rng.randint(0, 6)) for _ in range(rng.randint(1, 5))]
        lists.append(fresh(10))  # a group of one
    elif pattern == "prefix_of_another":
        prompt = fresh(50)
        lists = [prompt + fresh(5), prompt[:30], prompt + fresh(2), fresh(3)]
    elif pattern == "many_prompts":  # 4 prompts x 8 samples
        lists = []
        for _ in range(4):
            prompt = fresh(rng.randint(10, 60))
            lists += [prompt + fresh(rng.randint(1, 8)) for _ in range(8)]
    else:
        raise ValueError(pattern)
    last = [rng.randint(1, PAGE) for _ in lists]
    return lists, last


def plan_merge_launches(monkeypatch):
    """Sharing plans from here on launch flashjit_merge where the kernel would merge them."""
    native, numpy_plan = HostPlanner.shared_tables, shared_decode.plan_shared_work
    monkeypatch.setattr(HostPlanner, "shared_tables", lambda self, *a, **k: native(self, *a, **{**k, "merge_waits": False}))
    monkeypatch.setattr(shared_decode, "plan_shared_work", lambda *a, **k: numpy_plan(*a, **{**k, "merge_waits": False}))


def tables(lists, last):
    indptr = torch.tensor([0] + list(itertools.accumulate(len(p) for p in lists)), dtype=torch.int32)
    ids = torch.tensor([i for p in lists for i in p], dtype=torch.int32).cuda()
    return indptr, ids, torch.tensor(last, dtype=torch.int32)


PATTERNS = ["none", "full", "samples", "two_levels", "prefix_of_another", "many_prompts"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mask", shared_decode.SHARING_MASKS)
@pytest.mark.parametrize("q_len", [1, 3])
def test_shared_prefix_equals_per_request_decode(engine, cache, pattern, mask, q_len, monkeypatch):
    rng = random.Random(zlib.crc32(f"{pattern} {mask} {q_len}".encode()))
    k, v = cache
    lists, last = sharing_batch(pattern, rng)
    indptr, ids, last_t = tables(lists, last)
    batch = len(lists)
    qo = torch.arange(batch + 1, dtype=torch.int32) * q_len
    q = torch.randn(batch * q_len, HEADS, DIM, generator=torch.Generator().manual_seed(5)).bfloat16().cuda()
    outs = {}
    for way in ("kernel merges", "merge launch", "per request"):
        share = way != "per request"
        if way == "merge launch":
            plan_merge_launches(monkeypatch)
        decoder = flashjit.BatchDecode(engine)
        decoder.plan(indptr, ids, last_t, HEADS, KV_HEADS, DIM, PAGE, mask=mask, qo_indptr=qo, share_prefixes=share)
        assert decoder.spec.shared_prefix == (share and pattern != "none")
        plan = decoder.current_plan
        if share and pattern in ("samples", "many_prompts"):  # own items of a few pages: 4 heads a CTA
            records = item_records(plan.buffers.host, plan.buffers.starts)[:decoder.work.num_work]
            assert (records[:, 11] & RECORD_HEADS == 4).any()
        if decoder.spec.shared_prefix:  # one query token: these batches are one wave, which the kernel merges
            in_kernel = decoder.work.merges_in_kernel
            assert (plan.merge_launch is None) == in_kernel
            assert in_kernel == (way == "kernel merges") if q_len == 1 else not in_kernel or way == "kernel merges"
        outs[way] = decoder.run(q, (k, v), return_lse=True)
        again = decoder.run(q, (k, v), return_lse=True)  # the kernel's counters are back at rest
        assert torch.equal(again[0], outs[way][0]) and torch.equal(again[1], outs[way][1])
    ref, ref_lse = decode_reference(q, k, v, indptr, ids, last_t, qo_indptr=qo, mask=mask)
    plain, plain_lse = outs["per request"]
    for way in ("kernel merges", "merge launch", "per request"):
        assert_exact(*outs[way], ref, ref_lse, BF16, way)
    for way in ("kernel merges", "merge launch"):
        assert_exact(*outs[way], plain.float(), plain_lse, BF16, f"{way} against per-request decode")


@pytest.mark.parametrize("mask", shared_decode.SHARING_MASKS)
def test_multi_token_queries_merge_in_the_kernel(engine, cache, mask):
    """6 samples of a prompt, 3 query tokens each (12 rows a request and KV head, one row tile):
    one wave, which the kernel merges, each request's last own item combining the others' partials."""
    k, v = cache
    rng = random.Random(11)
    pool = iter(rng.sample(range(POOL), POOL))
    prompt = [next(pool) for _ in range(30)]
    lists = [prompt + [next(pool) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    indptr, ids, last_t = tables(lists, [rng.randint(1, PAGE) for _ in lists])
    qo = torch.arange(len(lists) + 1, dtype=torch.int32) * 3
    q = torch.randn(3 * len(lists), HEADS, DIM, generator=torch.Generator().manual_seed(7)).bfloat16().cuda()
    decoder = flashjit.BatchDecode(engine).plan(indptr, ids, last_t, HEADS, KV_HEADS, DIM, PAGE, mask=mask,
                                                qo_indptr=qo, share_prefixes=True)
    assert decoder.spec.shared_prefix and decoder.work.merges_in_kernel and decoder.work.num_work > len(lists)
    out, lse = decoder.run(q, (k, v), return_lse=True)
    ref, ref_lse = decode_reference(q, k, v, indptr, ids, last_t, qo_indptr=qo, mask=mask)
    assert_exact(out, lse, ref, ref_lse, BF16, decoder.spec.name)


@pytest.mark.parametrize("pattern", ["samples", "two_levels"])
def test_random_seeds_of_deep_sharing(engine, cache, pattern):
    k, v = cache
    for seed in range(6):
        rng = random.Random(100 + seed)
        lists, last = sharing_batch(pattern, rng)
        indptr, ids, last_t = tables(lists, last)
        q = torch.randn(len(lists), HEADS, DIM, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
        decoder = flashjit.BatchDecode(engine).plan(indptr, ids, last_t, HEADS, KV_HEADS, DIM, PAGE, mask="causal",
                                                    share_prefixes=True)
        assert decoder.spec.shared_prefix
        out, lse = decoder.run(q, (k, v), return_lse=True)
        ref, ref_lse = decode_reference(q, k, v, indptr, ids, last_t, mask="causal")
        assert_exact(out, lse, ref, ref_lse, BF16, f"seed {seed}")


def test_fp8_cache_falls_back_and_stays_exact(engine, cache):
    k, v = cache
    lists, last = sharing_batch("samples", random.Random(1))
    indptr, ids, last_t = tables(lists, last)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    q = torch.randn(len(lists), HEADS, DIM, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    decoder = flashjit.BatchDecode(engine).plan(indptr, ids, last_t, HEADS, KV_HEADS, DIM, PAGE, kv_dtype="float8_e4m3fn",
                                                share_prefixes=True)
    assert not decoder.spec.shared_prefix
    out = decoder.run(q, (k8, v8), k_scale=1.0, v_scale=1.0)
    plain = flashjit.BatchDecode(engine).plan(indptr, ids, last_t, HEADS, KV_HEADS, DIM, PAGE, kv_dtype="float8_e4m3fn",
                                              share_prefixes=False).run(q, (k8, v8), k_scale=1.0, v_scale=1.0)
    assert torch.equal(out, plain)
    ref, _ = decode_reference(q, k8.float(), v8.float(), indptr, ids, last_t)
    assert_exact(out, None, ref, None, tolerance(torch.bfloat16, torch.float8_e4m3fn), decoder.spec.name)


@pytest.mark.parametrize("share, graphs_pack", [(None, False), (True, False), (True, True)])
def test_cuda_graph_replay_with_shared_page_tables(engine, cache, share, graphs_pack, monkeypatch):
    """CUDA-graph mode plans per request by default (the GPU planner's kernel), and with
    share_prefixes=True on the host with the shared kernel, which batches without sharing take too:
    replays after each re-plan stay exact. Where graphs pack (shared_decode.GRAPHS_PACK), the shared
    kernel's graph launches its packed entry point, and short own items replay packed 4 KV heads a CTA."""
    monkeypatch.setattr(shared_decode, "GRAPHS_PACK", graphs_pack)
    k, v = cache
    rng = random.Random(9)
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=32, max_num_pages=POOL)
    q_static = torch.zeros(32, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    out_static = torch.zeros_like(q_static)
    lists, last = sharing_batch("samples", rng)
    decoder.plan(*tables(lists, last), HEADS, KV_HEADS, DIM, PAGE, mask="causal", share_prefixes=share)
    assert decoder.spec.shared_prefix == (share is True)
    decoder.run(q_static, (k, v), out=out_static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q_static, (k, v), out=out_static)
    packed_records = 0
    for pattern in ("samples", "two_levels", "none", "many_prompts", "full"):
        lists, last = sharing_batch(pattern, rng)
        t = tables(lists, last)
        decoder.plan(*t, HEADS, KV_HEADS, DIM, PAGE, mask="causal", share_prefixes=share)
        plan = decoder.current_plan
        assert (plan.decode_args.packed_from == -1) == graphs_pack
        if share:
            records = item_records(plan.buffers.host, plan.buffers.starts)[:decoder.work.num_work]
            packed_records += int(((records[:, 11] & RECORD_HEADS) > 1).sum())
        n = len(lists)
        q_static.copy_(torch.randn(q_static.shape, generator=torch.Generator().manual_seed(n)).bfloat16())
        out_static.fill_(float("nan"))
        graph.replay()
        ref, _ = decode_reference(q_static[:n], k, v, *t, mask="causal")
        assert_exact(out_static[:n], None, ref, None, BF16, pattern)
    assert (packed_records > 0) == graphs_pack


def test_replanning_between_sharing_and_not_reuses_the_decoder(engine, cache):
    k, v = cache
    rng = random.Random(4)
    decoder = flashjit.BatchDecode(engine)
    for pattern in ("samples", "none", "two_levels", "none", "many_prompts"):
        lists, last = sharing_batch(pattern, rng)
        t = tables(lists, last)
        q = torch.randn(len(lists), HEADS, DIM, generator=torch.Generator().manual_seed(len(lists))).bfloat16().cuda()
        decoder.plan(*t, HEADS, KV_HEADS, DIM, PAGE, share_prefixes=True)
        out, lse = decoder.run(q, (k, v), return_lse=True)
        ref, ref_lse = decode_reference(q, k, v, *t)
        assert_exact(out, lse, ref, ref_lse, BF16, pattern)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (16, 2), (32, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shapes_and_dtypes(engine, heads, kv_heads, head_dim, dtype):
    """GQA groups of 1, 8 and 4 (16, 2 and 4 members per 16-row tile, a tile per warp where a
    warp holds all of O: head_dims 64, 96, 128), four head_dims, both 16-bit types."""
    rng = random.Random(head_dim + heads)
    gen = torch.Generator().manual_seed(head_dim)
    pages = 600
    k = torch.randn(pages, PAGE, kv_heads, head_dim, generator=gen).to(dtype).cuda()
    v = torch.randn(pages, PAGE, kv_heads, head_dim, generator=gen).to(dtype).cuda()
    pool = iter(rng.sample(range(pages), pages))
    prompt = [next(pool) for _ in range(40)]
    lists = []
    for _ in range(3):
        beam = prompt + [next(pool) for _ in range(rng.randint(1, 8))]
        lists += [beam + [next(pool) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(2, 6))]
    indptr, ids, last_t = tables(lists, [rng.randint(1, PAGE) for _ in lists])
    q = torch.randn(len(lists), heads, head_dim, generator=gen).to(dtype).cuda()
    decoder = flashjit.BatchDecode(engine).plan(indptr, ids, last_t, heads, kv_heads, head_dim, PAGE, mask="causal",
                                                q_dtype=dtype, share_prefixes=True)
    assert decoder.spec.shared_prefix
    out, lse = decoder.run(q, (k, v), return_lse=True)
    ref, ref_lse = decode_reference(q, k, v, indptr, ids, last_t, mask="causal")
    assert_exact(out, lse, ref, ref_lse, tolerance(dtype), decoder.spec.name)


def test_many_page_ids_come_with_the_range_read(engine, cache):
    """Past the page-id range's copy limit (8192 ids) a sharing plan's ids come in a pinned copy of
    their own, queued behind the range's: the plan shares, the range is right, the output exact;
    a larger batch grows the pinned buffer."""
    k, v = cache
    rng = random.Random(11)
    decoder = flashjit.BatchDecode(engine)
    for samples in (24, 48):
        prompt = rng.sample(range(POOL), 300)
        lists = [prompt + rng.choices(range(POOL), k=60) for _ in range(samples)]
        indptr, ids, last_t = tables(lists, [rng.randint(1, PAGE) for _ in lists])
        assert len(ids) > decoder._page_id_range.COPY_LIMIT
        q = torch.randn(samples, HEADS, DIM, generator=torch.Generator().manual_seed(samples)).bfloat16().cuda()
        decoder.plan(indptr, ids, last_t, HEADS, KV_HEADS, DIM, PAGE, mask="causal", share_prefixes=True)
        assert decoder.spec.shared_prefix and decoder._page_id_range.ids_pending == len(ids)
        assert decoder.current_plan.max_page == int(ids.max())
        out, lse = decoder.run(q, (k, v), return_lse=True)
        ref, ref_lse = decode_reference(q, k, v, indptr, ids, last_t, mask="causal")
        assert_exact(out, lse, ref, ref_lse, BF16, f"{samples} samples")
