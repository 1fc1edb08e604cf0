"""CUDA-graph mode's GPU planner: the work list it writes equals the host planner's, record for
record, and graph replays re-planned between them (by plan(), or by a captured replan() over a page
table written in place) decode as eager runs do."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import flashjit
from flashjit.serving.reference import decode_reference

from built_ins import DEVICE_PLANNED_MASKS

from .batches import assert_exact, make_batch, tolerance

PAGE_POOL = 6000
BF16 = tolerance(torch.bfloat16)


@pytest.fixture(scope="module")
def engine():
    return flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)


def host_planned(kernel, device_index):
    """The kernel as loaded, without its planner entry: a CUDA-graph decoder then plans on the host."""
    return dataclasses.replace(kernel.loaded(device_index), plan=None)


def skewed_lengths(rng: random.Random, batch: int, page_size: int) -> list[int]:
    """Mostly short requests, a few 16-64x longer, an empty one, and page-boundary lengths."""
    lengths = [rng.randint(1, 2048) for _ in range(batch)]
    for i in rng.sample(range(batch), k=min(batch, max(1, batch // 12))):
        lengths[i] = rng.randint(16, 64) * rng.randint(400, 1000)
    lengths[rng.randrange(batch)] = 0
    lengths[rng.randrange(batch)] = page_size * rng.randint(1, 8)
    return lengths


def page_table(kv_lens, page_size, gen, q_lens):
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    ids = torch.randint(0, PAGE_POOL, (max(1, sum(pages)),), generator=gen, dtype=torch.int32)[: sum(pages)]
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    return indptr, ids.cuda(), last, qo


def work_list(decoder):
    """The fields of the work list a plan wrote to the device: (records [W, ITEM_INTS], padding
    requests, num_tokens, req_qo_indptr, req_work_indptr, token_request)."""
    plan = decoder.current_plan
    buffers, batch, tokens = plan.buffers, plan.batch_size, plan.num_tokens
    values = buffers.device_buffer.cpu()
    at = buffers.offsets
    records = values[at["work_items"]:at["num_tokens"]].view(-1, 12)
    num_work = int(values[at["req_work_indptr"] + batch])
    return (records[:num_work], records[num_work:, 0], int(values[at["num_tokens"]]),
            values[at["req_qo_indptr"]:at["req_qo_indptr"] + batch + 1],
            values[at["req_work_indptr"]:at["req_work_indptr"] + batch + 1],
            values[at["token_request"]:at["token_request"] + tokens])


CONFIGS = [  # (qo heads, kv heads, head_dim, tensor cores)
    (32, 8, 128, None), (32, 32, 128, None), (64, 8, 64, True), (32, 4, 96, None), (16, 2, 256, True)]


def assert_planners_agree(engine, heads, kv_heads, head_dim, tensor_cores, mask, batches, seed, page_sizes=(1, 16, 64)):
    """Both planners over skewed batches of each size, the chunk planned, forced and one per request."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    page_size, max_q = rng.choice(page_sizes), 1 if mask == "none" else 4
    options = dict(use_cuda_graph=True, max_batch_size=max(batches), max_num_pages=8_000_000, max_q_len=max_q)
    pairs = {}  # window_left -> (GPU-planned, host-planned) decoders: a graph decoder keeps its first window

    def decoders(window):
        if window not in pairs:
            pairs[window] = (flashjit.BatchDecode(engine, **options),
                             flashjit.BatchDecode(engine, load_kernel=host_planned, **options))
        return pairs[window]

    for batch, split in itertools.product(batches, ["auto", "forced", "none"]):
        # a forced chunk that fits the capacity: a few items per request at 37, one from 700 on
        split = {"auto": {}, "forced": {"chunk_tokens": 4096 if batch < 100 else 65536},
                 "none": {"disable_split_kv": True}}[split]
        kv_lens = skewed_lengths(rng, batch, page_size)
        q_lens = [rng.randint(1, max_q) for _ in kv_lens]
        kv_lens = [max(n, q) for n, q in zip(kv_lens, q_lens)]
        indptr, ids, last, qo = page_table(kv_lens, page_size, gen, q_lens)
        args = (indptr, ids, last, heads, kv_heads, head_dim, page_size)
        window = rng.choice([0, 37, 3000]) if mask == "sliding_window" else None
        kw = dict(qo_indptr=qo, mask=mask, window_left=window, tensor_cores=tensor_cores, check_page_ids=False, **split)
        on_gpu, on_host = decoders(window)
        on_gpu.plan(*args, **kw)
        on_host.plan(*args, **kw)
        assert on_gpu.graph_page_table is not None and on_host.graph_page_table is None
        gpu, host = work_list(on_gpu), work_list(on_host)
        assert torch.equal(gpu[0], host[0]), f"records differ: batch {batch}, {split}"
        assert (gpu[1] == -1).all() and len(gpu[1]) == len(host[1])
        assert gpu[2] == host[2] == sum(q_lens)
        for got, want in zip(gpu[3:], host[3:]):
            assert torch.equal(got, want)
        assert on_gpu.work.chunk_tokens == on_host.work.chunk_tokens


@pytest.mark.parametrize("heads, kv_heads, head_dim, tensor_cores", CONFIGS)
@pytest.mark.parametrize("mask", DEVICE_PLANNED_MASKS)
def test_gpu_planner_writes_the_host_planners_work_list(engine, heads, kv_heads, head_dim, tensor_cores, mask):
    assert_planners_agree(engine, heads, kv_heads, head_dim, tensor_cores, mask, [1, 37, 700], heads * 7 + head_dim)


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (8, 1)])  # one KV head: a wave of items prices all 34 candidates
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_gpu_planner_agrees_on_batches_of_several_requests_per_thread(engine, heads, kv_heads, mask):
    assert_planners_agree(engine, heads, kv_heads, 128, None, mask, [1500, 4096], kv_heads * 13, page_sizes=(16, 64))


def decode_checked(decoder_out, batch_tables, q, k, v, mask, params, n):
    indptr, ids, last, qo = batch_tables
    ref, _ = decode_reference(q[: int(qo[-1])], k, v, indptr, ids, last, qo_indptr=qo, mask=mask, mask_params=params)
    assert_exact(decoder_out[: int(qo[-1])], None, ref, None, BF16, f"{n} requests")


@pytest.mark.parametrize("tensor_cores", [None, False], ids=["auto", "cuda cores"])  # the fused merge; flashjit_merge
@pytest.mark.parametrize("mask, max_q", [("none", 1), ("causal", 3), ("sliding_window", 1)])
def test_graph_replays_after_new_plans_match_eager_runs(engine, mask, max_q, tensor_cores):
    heads, kv_heads, dim, page = 32, 8, 128, 16
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    k = torch.randn(PAGE_POOL, page, kv_heads, dim, generator=gen).bfloat16().cuda()
    v = torch.randn(PAGE_POOL, page, kv_heads, dim, generator=gen).bfloat16().cuda()
    max_batch = 48
    q_static = torch.randn(max_batch * max_q, heads, dim, generator=gen).bfloat16().cuda()
    out_static = torch.zeros_like(q_static)
    params = {"window_left": 1000} if mask == "sliding_window" else {}
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=max_batch,
                                   max_num_pages=max_batch * 4000, max_q_len=max_q)
    eager = flashjit.BatchDecode(engine)

    def tables(batch):
        q_lens = [rng.randint(1, max_q) for _ in range(batch)]
        kv_lens = [max(n, q) for n, q in zip(skewed_lengths(rng, batch, page), q_lens)]
        return page_table(kv_lens, page, gen, q_lens)

    def plan(d, t):
        d.plan(t[0], t[1], t[2], heads, kv_heads, dim, page, qo_indptr=t[3], mask=mask, mask_params=params,
               tensor_cores=tensor_cores)

    t = tables(max_batch)
    plan(decoder, t)
    assert decoder.kernel.tiling.fused_merge == (tensor_cores is None)  # each merge path replayed
    decoder.run(q_static, (k, v), out=out_static)  # loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q_static, (k, v), out=out_static)
    for batch in (max_batch, 5, 1, 31, max_batch):
        t = tables(batch)
        plan(decoder, t)
        q_static.copy_(torch.randn(q_static.shape, generator=gen).bfloat16())
        out_static.fill_(float("nan"))
        graph.replay()
        plan(eager, t)
        tokens = int(t[3][-1])
        expected = eager.run(q_static[:tokens], (k, v))
        if mask != "sliding_window" and batch >= 8:  # a window bounds every span: nothing to split
            assert decoder.work.num_work > batch  # the long requests split inside the graph
        assert_exact(out_static[:tokens], None, expected.float(), None, BF16, f"replay against eager, {batch} requests")
        decode_checked(out_static, t, q_static, k, v, mask, params, batch)


def test_a_captured_replan_plans_the_page_table_written_in_place(engine):
    heads, kv_heads, dim, page, max_batch = 32, 8, 128, 16, 32
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    k = torch.randn(PAGE_POOL, page, kv_heads, dim, generator=gen).bfloat16().cuda()
    v = torch.randn(PAGE_POOL, page, kv_heads, dim, generator=gen).bfloat16().cuda()
    q_static = torch.randn(max_batch, heads, dim, generator=gen).bfloat16().cuda()
    out_static = torch.zeros_like(q_static)
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=max_batch, max_num_pages=200_000)

    def tables(batch):
        return page_table(skewed_lengths(rng, batch, page), page, gen, [1] * batch)

    t = tables(max_batch)
    decoder.plan(t[0], t[1], t[2], heads, kv_heads, dim, page, mask="causal")
    decoder.run(q_static, (k, v), out=out_static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.replan()
        decoder.run(q_static, (k, v), out=out_static)
    table, ids = decoder.graph_page_table, decoder.graph_page_ids
    for batch in (max_batch, 7, 1, 20):  # the step's page table written in place, no plan()
        t = tables(batch)
        table.batch.fill_(batch)
        table.indptr[: batch + 1].copy_(t[0])
        table.last_page_len[:batch].copy_(t[2])
        table.qo_indptr[: batch + 1].copy_(t[3])
        ids[: len(t[1])].copy_(t[1])
        out_static.fill_(float("nan"))
        graph.replay()
        decode_checked(out_static, (t[0], ids[: len(t[1])], t[2], t[3]), q_static, k, v, "causal", {}, batch)


def test_replan_without_a_gpu_plan_says_why(engine):
    decoder = flashjit.BatchDecode(engine)
    with pytest.raises(RuntimeError, match="replan"):
        decoder.replan()
    batch = make_batch([100, 7], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 8, 2, 64, 16)
    with pytest.raises(RuntimeError, match="no CUDA graph mode"):
        decoder.replan()
