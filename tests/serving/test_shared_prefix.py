"""Shared-prefix decode on the CPU: detection (C against numpy), the work list (emulated against
attention over each request's whole cache), and plan()'s choice of when to share."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flashjit.worklist.record import MERGE_COUNTS, MERGE_WAITS, RECORD_HEADS
from flashjit.serving import graph_mode, shared_decode
from flashjit.worklist.host import HostPlanner, item_records
from flashjit.worklist.shared import (HEAD_PACK_MAX_TILES, members_per_record, plan_shared_work, record_tiles,
                                          shared_chunks)
from flashjit.worklist.spans import find_shared_spans

from cpu_decoders import DECODE_FN, PACKED_FN, cpu_decoder, native_library
from prefix_trees import PAGE, page_table, random_tree


def test_nested_groups_of_a_tree():
    lists = [[0, 1, 2, 3, 4, 10, 11, 20], [0, 1, 2, 3, 4, 10, 11, 21], [0, 1, 2, 3, 4, 30], [0, 1, 2, 3, 4, 40],
             [50, 51], [50, 52], [60]]
    indptr, ids, kv, _ = page_table(lists)
    spans = find_shared_spans(indptr, ids, kv, np.ones(7, int), PAGE, causal=False)
    assert spans.first.tolist() == [0, 4, 0] and spans.count.tolist() == [4, 2, 2]
    assert spans.begin_page.tolist() == [0, 0, 5] and spans.end_page.tolist() == [5, 1, 7]
    assert spans.level.tolist() == [0, 0, 1]
    assert spans.shared_pages.tolist() == [7, 7, 5, 5, 1, 1, 0]


def test_only_full_visible_pages_from_the_first_on_are_shared():
    # An equal later page with different first pages shares nothing; a partial last page is not shared.
    indptr, ids, kv, _ = page_table([[1, 2, 3], [9, 2, 3]])
    assert find_shared_spans(indptr, ids, kv, np.ones(2, int), PAGE, causal=False) is None
    indptr, ids, kv, _ = page_table([[1, 2, 3], [1, 2, 3]], last_page_len=[PAGE, 1])
    assert find_shared_spans(indptr, ids, kv, np.ones(2, int), PAGE, causal=False).end_page.tolist() == [2]
    # Causal: the span ends at or before every member's first query (q_len 2: kv_len - 1).
    indptr, ids, kv, _ = page_table([[1, 2, 3], [1, 2, 3]])
    assert find_shared_spans(indptr, ids, kv, np.full(2, 2), PAGE, causal=True).end_page.tolist() == [2]
    assert find_shared_spans(indptr, ids, kv, np.full(2, 1), PAGE, causal=True).end_page.tolist() == [3]
    # Different query counts: no shared record can hold both.
    assert find_shared_spans(indptr, ids, kv, np.array([1, 2]), PAGE, causal=False) is None


@pytest.mark.parametrize("seed", range(20))
def test_native_detection_equals_numpy(seed):
    library = native_library()
    if library is None:
        pytest.skip("no C compiler: the numpy detection is the only one")
    rng = random.Random(seed)
    lists, last = random_tree(rng, rng.randint(2, 40))
    indptr, ids, kv, _ = page_table(lists, last)
    q_len = rng.choice([1, 2])
    planner = HostPlanner(library)
    tables = planner.read(torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), PAGE,
                          q_len=q_len)
    for causal in (False, True):
        expected = find_shared_spans(indptr, ids, kv, np.full(len(kv), q_len), PAGE, causal=causal)
        got = planner.shared_spans(tables, torch.from_numpy(ids), PAGE, causal, 4)
        assert (got is None) == (expected is None)
        if got is not None:
            for name in expected._fields:
                assert getattr(got, name).tolist() == getattr(expected, name).tolist(), name


def test_sixteen_prompts_of_sixteen_samples_are_found_and_unshared_pages_are_not():
    """256 requests of 100 pages: none shared, and 16 prompts x 16 samples of 64 shared pages each
    (the detection's host time: python -m benchmarks.shared_prefix_host)."""
    library = native_library()
    if library is None:
        pytest.skip("no C compiler")
    batch, pages = 256, 100
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    last = torch.full((batch,), PAGE, dtype=torch.int32)
    planner = HostPlanner(library)
    tables = planner.read(indptr, last, PAGE)
    alone = np.random.default_rng(0).permutation(batch * pages).astype(np.int32)
    assert planner.shared_spans(tables, torch.from_numpy(alone), PAGE, True, 4) is None
    from benchmarks.shared_prefix_host import patterns

    shared = patterns(np)["16 prompts x 16 samples"]
    spans = planner.shared_spans(tables, torch.from_numpy(shared), PAGE, True, 4)
    assert spans.first.tolist() == list(range(0, batch, 16)) and spans.count.tolist() == [16] * 16
    assert spans.end_page.tolist() == [64] * 16 and spans.shared_pages.tolist() == [64] * batch


def attend(q, keys, values):
    """Softmax attention of q [rows, D] over keys/values [n, D] in float64: (o, natural lse)."""
    if len(keys) == 0:
        return np.zeros_like(q), np.full(len(q), -np.inf)
    s = q @ keys.T
    top = s.max(axis=1, keepdims=True)
    p = np.exp(s - top)
    return (p @ values) / p.sum(axis=1, keepdims=True), (top[:, 0] + np.log(p.sum(axis=1)))


def emulate(records, req_work_indptr, qo, q, k, v, ids, group, causal):
    """What the shared-prefix kernel and the merge compute from a work list, in float64."""
    heads = q.shape[1]
    partial = {}
    for w, (r, v0, v1, kv_len, page_begin, q_begin, q_len, splits, *_rest) in enumerate(records):
        if r < 0:
            continue
        members = -splits if splits < 0 else 1
        for m in range(r, r + members):
            slot = req_work_indptr[m] + q_begin if splits < 0 else _rest[0]
            tokens = range(qo[m], qo[m] + q_len)
            pos = np.arange(v0, v1)
            phys = ids[page_begin + pos // PAGE] * PAGE + pos % PAGE
            for t_i, t in enumerate(tokens):
                seen = pos if splits < 0 or not causal else pos[pos <= kv_len - q_len + t_i]
                ph = phys[: len(seen)] if splits >= 0 else phys
                for h in range(heads):
                    partial[(slot, t, h)] = attend(q[t, h][None], k[ph, h // group], v[ph, h // group])
    out = np.zeros_like(q)
    for b in range(len(qo) - 1):
        for t in range(qo[b], qo[b + 1]):
            for h in range(heads):
                parts = [partial[(w, t, h)] for w in range(req_work_indptr[b], req_work_indptr[b + 1])]
                lse = np.array([p[1][0] for p in parts])
                top = lse.max()
                if top == -np.inf:
                    continue
                weights = np.exp(lse - top)
                out[t, h] = sum(wt * p[0][0] for wt, p in zip(weights, parts)) / weights.sum()
    return out


@pytest.mark.parametrize("seed", range(12))
def test_shared_work_list_equals_whole_attention(seed):
    rng = random.Random(seed)
    lists, last = random_tree(rng, rng.randint(2, 12))
    indptr, ids, kv, _ = page_table(lists, last)
    batch, group, kv_heads, dim = len(lists), rng.choice([1, 2, 4]), 2, 8
    q_len = rng.choice([1, 1, 2])
    causal = rng.random() < 0.5
    row_warps = rng.choice([1, 4])  # a 16-row tile per CTA, or one per warp
    qo = np.arange(batch + 1) * q_len
    spans = find_shared_spans(indptr, ids, kv, np.full(batch, q_len), PAGE, causal=causal)
    if spans is None:
        pytest.skip("this pattern shares nothing")  # seeds are fixed: most share (checked below)
    row_tiles = -(-group * q_len // 16)
    shared = plan_shared_work(spans, indptr, kv, qo, PAGE, group_size=group, row_tiles=row_tiles,
                              ctas_per_item=kv_heads * row_tiles, max_ctas=8, granularity=PAGE, row_warps=row_warps)
    work = shared.work
    assert shared.num_shared > 0 and work.num_work == len(shared.records)
    step = members_per_record(group, q_len, row_tiles, row_warps)
    assert all(-s <= step for s in shared.records[:, 7] if s < 0)
    data = np.random.default_rng(seed)
    pages = int(ids.max()) + 1 if len(ids) else 1
    q = data.standard_normal((batch * q_len, kv_heads * group, dim))
    k = data.standard_normal((pages * PAGE, kv_heads, dim))
    v = data.standard_normal((pages * PAGE, kv_heads, dim))
    got = emulate(shared.records, work.req_work_indptr, qo, q, k, v, ids, group, causal)
    np.testing.assert_allclose(got, whole_attention(q, k, v, indptr, ids, kv, q_len, group, causal), atol=1e-9)


def whole_attention(q, k, v, indptr, ids, kv, q_len: int, group: int, causal: bool):
    """Each request's queries over its whole cache (the causal mask at its newest positions), in float64."""
    out = np.zeros_like(q)
    for b in range(len(kv)):
        pos = np.arange(kv[b])
        phys = ids[indptr[b] + pos // PAGE] * PAGE + pos % PAGE if kv[b] else np.zeros(0, int)
        for i in range(q_len):
            seen = phys[: kv[b] - q_len + i + 1] if causal else phys
            for h in range(q.shape[1]):
                out[b * q_len + i, h] = attend(q[b * q_len + i, h][None], k[seen, h // group], v[seen, h // group])[0][0]
    return out


def samples_of_one_prompt(members: int, prompt_pages: int, own_pages: int):
    """The page table of `members` requests that share a prompt's pages, then pages of their own."""
    prompt = list(range(prompt_pages))
    lists = [prompt + list(range(prompt_pages + m * own_pages, prompt_pages + (m + 1) * own_pages))
             for m in range(members)]
    return page_table(lists, [PAGE] * members)


@pytest.mark.parametrize("group, row_warps, tiles", [(4, 1, 1), (4, 4, 4), (2, 4, 2), (4, 6, 4)])
def test_a_record_of_more_rows_reads_a_shorter_chunk(group, row_warps, tiles):
    """16 samples of a 512-page prompt: a record holding `tiles` 16-row tiles per CTA costs (5 + tiles)
    / 6 of an own item per key, so the prompt is cut evenly into as many pieces as that weighted
    length makes of the own items' chunk."""
    indptr, ids, kv, _ = samples_of_one_prompt(16, 512, 32)
    spans = find_shared_spans(indptr, ids, kv, np.ones(16, int), PAGE, causal=False)
    shared = plan_shared_work(spans, indptr, kv, np.arange(17), PAGE, group_size=group, row_tiles=1,
                              ctas_per_item=8, max_ctas=264, granularity=PAGE, row_warps=row_warps)
    records = shared.records
    is_shared = records[:, 7] < 0
    members = -records[is_shared, 7]
    assert members.max() == min(16, row_warps * 16 // group)
    assert record_tiles(members.max(), group, 1, row_warps) == tiles
    chunk = shared.work.chunk_tokens
    own = records[~is_shared, 2] - records[~is_shared, 1]
    reads = records[is_shared, 2] - records[is_shared, 1]
    assert own.max() == min(chunk, 32 * PAGE)
    pieces = -(-512 * PAGE * (5 + tiles) // 6 // chunk)
    assert reads.max() == shared_chunks(chunk, 512 * PAGE, tiles, PAGE) == -(-512 * PAGE // pieces // PAGE) * PAGE
    assert len(reads) * members.max() // 16 <= pieces
    assert sum(reads) == 16 // members.max() * 512 * PAGE  # every run of members reads the whole prompt


@pytest.mark.parametrize("head_pack", [1, 4])
def test_short_own_items_name_the_heads_one_cta_attends(head_pack):
    """An own item of at most HEAD_PACK_MAX_TILES tiles names head_pack in its last field (one CTA
    attends that many KV heads), a longer one and every shared record 1."""
    prompt = list(range(64))
    lists = [prompt + list(range(100 + 40 * m, 100 + 40 * m + 2 * m)) for m in range(16)]  # 0 to 30 own pages
    indptr, ids, kv, _ = page_table(lists, [PAGE] * 16)
    spans = find_shared_spans(indptr, ids, kv, np.ones(16, int), PAGE, causal=False)
    granularity = 4 * PAGE
    shared = plan_shared_work(spans, indptr, kv, np.arange(17), PAGE, group_size=4, row_tiles=1, ctas_per_item=8,
                              max_ctas=264, granularity=granularity, row_warps=4, head_pack=head_pack)
    records = shared.records
    own = records[shared.num_shared:]
    short = own[:, 2] - own[:, 1] <= HEAD_PACK_MAX_TILES * granularity
    assert short.any() and not short.all()
    assert (own[short, 11] == head_pack).all() and (own[~short, 11] == 1).all()
    assert (records[:shared.num_shared, 11] == 1).all()


def test_the_chunk_prices_packed_own_items_as_their_ctas():
    """64 samples of a 2048-token prompt, 128 tokens each of their own: packed 4 heads a CTA, the
    own items launch a quarter of the CTAs, and the chunk the estimate picks then fills one wave
    (264 CTAs) where the unpacked plan needs more than two."""
    indptr, ids, kv, _ = samples_of_one_prompt(64, 128, 8)
    spans = find_shared_spans(indptr, ids, kv, np.ones(64, int), PAGE, causal=False)
    ctas = {}
    for head_pack in (1, 4):
        shared = plan_shared_work(spans, indptr, kv, np.arange(65), PAGE, group_size=4, row_tiles=1, ctas_per_item=8,
                                  max_ctas=264, granularity=4 * PAGE, row_warps=4, head_pack=head_pack)
        own = shared.records[shared.num_shared:]
        assert (own[:, 11] == head_pack).all()
        ctas[head_pack] = 8 * shared.num_shared + int((8 // own[:, 11]).sum())
    assert ctas[4] <= 264 < 2 * 264 < ctas[1]


@pytest.mark.parametrize("seed", range(4))
def test_packed_own_items_come_last_in_the_grid(seed):
    """Samples of a prompt with own spans of 1 to 12 pages: the packed own items (of at most
    HEAD_PACK_MAX_TILES tiles) are the last records, in their order, after the shared records and
    the unpacked own items; each request's items keep their order, so its last item is last."""
    rng = random.Random(seed)
    prompt = list(range(64))
    lists = [prompt + list(range(100 + 20 * m, 100 + 20 * m + rng.randint(1, 12))) for m in range(24)]
    indptr, ids, kv, _ = page_table(lists, [PAGE] * 24)
    spans = find_shared_spans(indptr, ids, kv, np.ones(24, int), PAGE, causal=False)
    shared = plan_shared_work(spans, indptr, kv, np.arange(25), PAGE, group_size=4, row_tiles=1, ctas_per_item=8,
                              max_ctas=264, granularity=2 * PAGE, row_warps=4, head_pack=4, chunk_tokens=6 * PAGE)
    records, work = shared.records, shared.work
    heads = records[shared.num_shared:, 11] & RECORD_HEADS
    assert 0 < work.packed_items < len(heads)
    assert (heads == np.repeat([1, 4], [len(heads) - work.packed_items, work.packed_items])).all()
    own = records[shared.num_shared:]
    for b in range(24):  # a request's items in span order, its packed ones after its others
        mine = own[own[:, 0] == b]
        assert (np.diff(mine[:, 1]) > 0).all() and (np.diff(mine[:, 8]) == 1).all()


def test_one_wave_plans_merge_in_the_kernel():
    """64 samples of a 2048-token prompt, 128 tokens each of their own: packed, the plan's CTAs fit
    one wave (264), so the kernel merges it: each request's own item waits for its partials of the
    shared records, which count themselves in, and no merge is launched. Unpacked (over two
    waves), or for a kernel that cannot, the merge is launched."""
    indptr, ids, kv, _ = samples_of_one_prompt(64, 128, 8)
    spans = find_shared_spans(indptr, ids, kv, np.ones(64, int), PAGE, causal=False)
    for head_pack, merge_waits, in_kernel in ((4, True, True), (1, True, False), (4, False, False)):
        shared = plan_shared_work(spans, indptr, kv, np.arange(65), PAGE, group_size=4, row_tiles=1, ctas_per_item=8,
                                  max_ctas=264, granularity=4 * PAGE, row_warps=4, head_pack=head_pack,
                                  merge_waits=merge_waits)
        roles, own = shared.records[:, 11] & ~RECORD_HEADS, shared.records[:, 7] >= 0
        assert shared.work.merges_in_kernel == in_kernel
        assert own.sum() == 64 and (roles == np.where(own, MERGE_WAITS, MERGE_COUNTS) * in_kernel).all()
        assert shared.work.needs_merge != in_kernel
        assert (shared.records[:, 11] & RECORD_HEADS == np.where(own, head_pack, 1)).all()


@pytest.mark.parametrize("native", [True, False])
def test_a_plan_with_packed_own_items_launches_the_packed_entry_point(planner, native):
    """32 samples of a prompt: own spans of a page pack 4 KV heads a CTA, last in the grid, and the
    plan launches the kernel's packed entry point over a CTA for each 4 heads of them
    (decode_args.packed_from: where they start); own items of over HEAD_PACK_MAX_TILES tiles keep a
    CTA a head and the plain one; requests that share nothing plan per request."""
    library = native_library() if native else None
    if native and library is None:
        pytest.skip("no C compiler: the numpy planner is the only one")
    decoder = cpu_decoder(planner, host_planner=HostPlanner(library))
    prompt = list(range(64))
    for own_pages, packed in ((1, True), (200, False)):
        lists = [prompt + list(range(100 + 200 * m, 100 + 200 * m + own_pages)) for m in range(32)]
        decoder.plan(*plan_args(lists, [PAGE] * 32), 32, 8, 128, PAGE)
        plan = decoder.current_plan
        assert decoder.spec.shared_prefix and decoder.kernel.tiling.packed_entry == "flashjit_decode_packed"
        own = item_records(plan.buffers.host, plan.buffers.starts)[:decoder.work.num_work]
        own = own[own[:, 7] >= 0]
        assert (own[:, 11] & RECORD_HEADS == (4 if packed else 1)).all()
        assert packed or (own[:, 2] - own[:, 1] > HEAD_PACK_MAX_TILES * decoder.kernel.tiling.tile_tokens).all()
        assert decoder.work.packed_items == (len(own) if packed else 0)
        assert plan.decode_launch.function == (PACKED_FN if packed else DECODE_FN)
        work = decoder.work
        plain = work.num_work - work.packed_items
        assert plan.decode_args.packed_from == plain
        assert plan.decode_launch.grid == (plain * 8 + work.packed_items * 2, 1, 1)
        # one wave (packed) merges in the kernel and launches no merge; the longer own spans launch it
        assert decoder.work.merges_in_kernel == packed and (plan.merge_launch is None) == packed
    decoder.plan(*plan_args([[1], [2]], [PAGE, PAGE]), 32, 8, 128, PAGE)
    assert not decoder.spec.shared_prefix and decoder.current_plan.decode_launch.function == DECODE_FN


def attended_heads(grid_x: int, kv_heads: int, pack: int, packed_from: int, record_heads) -> list:
    """(record, KV head) of every head a CTA of the packed entry point attends, as
    worklist/kernel_core.cuh's CtaCoords(a, pack) maps blockIdx.x and decode/tc.cuh's
    attend_records picks a packed record's heads (or exits: a graph's CTAs past a pack's first)."""
    seen = []
    for x in range(grid_x):
        plain = grid_x if packed_from < 0 else packed_from * kv_heads
        if x < plain:
            work, kv_head = x // kv_heads, x % kv_heads
        else:
            per_item = kv_heads // pack
            work, kv_head = packed_from + (x - plain) // per_item, (x - plain) % per_item * pack
        packed = record_heads[work] > 1 if packed_from < 0 else work >= packed_from
        if packed and kv_head % pack:
            continue
        seen += [(work, kv_head + g) for g in range(pack if packed else 1)]
    return seen


@pytest.mark.parametrize("graph", [False, True])
def test_the_packed_entry_points_grid_attends_every_record_head_once(graph):
    """An eager plan's packed grid and a graph's grid of a CTA per record and head (packed_from -1)
    both attend each head of each record exactly once, packed records 4 heads a CTA."""
    record_heads = np.array([1, 1, 1, 4, 4, 4, 4])
    records, kv_heads, pack = len(record_heads), 8, 4
    packed = int((record_heads > 1).sum())
    grid_x = records * kv_heads if graph else (records - packed) * kv_heads + packed * kv_heads // pack
    seen = attended_heads(grid_x, kv_heads, pack, -1 if graph else records - packed, record_heads)
    assert sorted(seen) == [(w, h) for w in range(records) for h in range(kv_heads)]


def test_most_random_patterns_share():
    shared = 0
    for seed in range(12):
        rng = random.Random(seed)
        lists, last = random_tree(rng, rng.randint(2, 12))
        indptr, ids, kv, _ = page_table(lists, last)
        rng.choice([1, 2, 4]), rng.choice([1, 1, 2]), rng.random()
        shared += find_shared_spans(indptr, ids, kv, np.ones(len(kv), int), PAGE, causal=False) is not None
    assert shared >= 8


def plan_args(lists, last):
    indptr, ids, kv, last = page_table(lists, last)
    return (torch.tensor(indptr, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32))


SHARED_BATCH = ([[0, 1, 2, 3, 10], [0, 1, 2, 3, 11], [0, 1, 2, 3, 12], [20, 21]], [PAGE, 2, 1, 3])


def test_plan_shares_by_default_and_not_when_told_not_to(planner):
    decoder = cpu_decoder(planner)
    args = plan_args(*SHARED_BATCH)
    decoder.plan(*args, 32, 8, 128, PAGE, mask="causal", share_prefixes=False)
    assert not decoder.spec.shared_prefix and (decoder.work.work_request >= 0).all()
    decoder.plan(*args, 32, 8, 128, PAGE, mask="causal")
    assert decoder.spec.shared_prefix and not decoder.kernel.tiling.fused_merge
    plan = decoder.current_plan
    records = item_records(plan.buffers.host, plan.buffers.starts)[:decoder.work.num_work]
    assert (records[:, 7] < 0).any()  # shared records
    decoder.plan(*args, 32, 8, 128, PAGE, mask="causal", share_prefixes=False)
    assert not decoder.spec.shared_prefix and (decoder.work.work_request >= 0).all()
    with pytest.raises(ValueError, match="share_prefixes"):
        decoder.plan(*args, 32, 8, 128, PAGE, share_prefixes=1)


def test_plans_without_sharing_are_unchanged(planner):
    lists = [[0, 1, 2], [3, 4, 5], [6, 7]]
    works = []
    for share in (True, False):
        decoder = cpu_decoder(planner)
        decoder.plan(*plan_args(lists, [PAGE, 1, 2]), 32, 8, 128, PAGE, share_prefixes=share)
        assert not decoder.spec.shared_prefix
        works.append(decoder.current_plan.buffers.host.copy())
    assert np.array_equal(*works)


@pytest.mark.parametrize("mask", shared_decode.SHARING_MASKS)
def test_the_staging_buffer_holds_the_shared_records(planner, mask):
    """plan() with the C planner stages the numpy planner's words (its reference), and the work
    summary of the staged list."""
    if native_library() is None:
        pytest.skip("no C compiler: the numpy planner is the only one")
    staged = []
    for library in (native_library(), None):
        decoder = cpu_decoder(planner, host_planner=HostPlanner(library))
        decoder.plan(*plan_args(*SHARED_BATCH), 32, 8, 128, PAGE, mask=mask, share_prefixes=True)
        plan = decoder.current_plan
        assert decoder.spec.shared_prefix
        # The device buffer got the same words (a plain copy on the CPU device).
        assert np.array_equal(plan.buffers.device_buffer.numpy(), plan.buffers.host)
        work = decoder.work
        records = item_records(plan.buffers.host, plan.buffers.starts)
        assert work.work_request.tolist() == records[:work.num_work, 0].tolist()
        assert (records[work.num_work:, 0] == -1).all()
        staged.append((plan.buffers.host.copy(), plan.capacity, work.num_work, work.chunk_tokens,
                       work.req_work_indptr.tolist(), work.token_request.tolist()))
    native, reference = staged
    assert native[1:] == reference[1:]
    assert native[0].tobytes() == reference[0].tobytes()


@pytest.mark.parametrize("options", [dict(kv_dtype="float8_e4m3fn"), dict(mask="sliding_window", window_left=8),
                                     dict(chunk_tokens=64), dict(disable_split_kv=True), dict(tensor_cores=False),
                                     dict(logits_soft_cap=30.0),
                                     dict(check_page_ids=False)])
def test_plans_that_cannot_share_plan_per_request(planner, options):
    decoder = cpu_decoder(planner)
    decoder.plan(*plan_args(*SHARED_BATCH), 32, 8, 128, PAGE, share_prefixes=True, **options)
    assert not decoder.spec.shared_prefix


def test_benchmark_rows_share_their_prompts():
    from benchmarks.shared_prefix import PAGE as BENCH_PAGE, ROWS, build_tables, floor_bytes

    for row in ROWS:
        t = build_tables(row)
        batch = row.prompts * row.samples
        kv = (np.diff(t.indptr) - 1) * BENCH_PAGE + t.last_page_len
        assert kv.tolist() == [row.prompt_len + row.own_len] * batch
        spans = find_shared_spans(t.indptr, t.indices, kv, np.ones(batch, int), BENCH_PAGE, causal=True)
        if not row.prompt_len:  # the row of requests alone
            assert spans is None and t.unique_pages == len(t.indices)
            continue
        assert spans.count.tolist() == [row.samples] * row.prompts
        assert spans.end_page.tolist() == [row.prompt_len // BENCH_PAGE] * row.prompts
        assert floor_bytes(row, t) > t.unique_pages * BENCH_PAGE * 8 * 128 * 4


def test_a_group_of_one_head_shares_on_tensor_cores(planner):
    decoder = cpu_decoder(planner)
    decoder.plan(*plan_args(*SHARED_BATCH), 8, 8, 128, PAGE, share_prefixes=True)  # one row per request
    assert decoder.spec.shared_prefix and decoder.spec.tensor_cores
    decoder.plan(*plan_args(*SHARED_BATCH), 8, 8, 128, PAGE, share_prefixes=False)
    assert not decoder.spec.shared_prefix


def test_the_page_id_range_copies_every_id_for_a_sharing_plan():
    from flashjit.serving.buffers import PageIdRange

    reader = PageIdRange(torch.device("cpu"), copy_ids=True)
    many = torch.arange(PageIdRange.COPY_LIMIT + 5, dtype=torch.int32) * 3
    for count, ids in ((len(many), True), (len(many), False), (100, True)):
        reader.start(many, count, ids=ids)
        assert reader.wait() == (2 if count > PageIdRange.COPY_LIMIT else count)
        found = reader.ids_host(count)
        if count > PageIdRange.COPY_LIMIT and not ids:
            assert found is None  # the range alone: plan() copies the ids itself
        else:
            assert found.tolist() == many[:count].tolist()
        assert reader.ids_host(count - 1) is None  # never fewer ids than the plan has
    assert PageIdRange(torch.device("cpu")).copy_ids is False  # on the CPU the ids are host memory already


def test_a_sharing_plan_over_many_page_ids_reads_the_copied_ids(planner):
    """Past the range's copy limit the ids come in their own copy; the plan is the numpy planner's."""
    from flashjit.serving.buffers import PageIdRange

    prompt = list(range(5000))
    lists = [prompt + [10 ** 5 + 10 * r + i for i in range(3)] for r in range(3)]
    args = plan_args(lists, [PAGE, 1, 2])
    assert len(args[1]) > PageIdRange.COPY_LIMIT
    staged = []
    for library in (native_library(), None):
        reader = PageIdRange(torch.device("cpu"), copy_ids=True)
        decoder = cpu_decoder(planner, host_planner=HostPlanner(library), page_id_range=reader)
        decoder.plan(*args, 32, 8, 128, PAGE, mask="causal", share_prefixes=True)
        assert decoder.spec.shared_prefix and reader.ids_pending == len(args[1])
        assert decoder.current_plan.max_page == int(args[1].max())
        staged.append(decoder.current_plan.buffers.host.tobytes())
    assert staged[0] == staged[1]


def test_the_benchmark_refuses_a_bad_peer_pattern(capsys):
    from benchmarks.shared_prefix import main

    with pytest.raises(SystemExit):
        main(["--peers", "("])
    assert "--peers '(' is not a regular expression" in capsys.readouterr().err


def test_the_host_cost_rows_plan_with_and_without_sharing(planner):
    """The rows benchmarks/shared_prefix_host.py times: 16 prompts x 16 samples, 1024 + 64 tokens,
    plan with the shared kernel when asked and per request when not."""
    from benchmarks.shared_prefix import HEADS_KV, HEADS_QO, HEAD_DIM, PAGE as BENCH_PAGE, Row, build_tables

    t = build_tables(Row("256", 16, 16, 1024, 64))
    args = (torch.from_numpy(t.indptr), torch.from_numpy(t.indices), torch.from_numpy(t.last_page_len))
    for share in (False, True):
        decoder = cpu_decoder(planner)
        decoder.plan(*args, HEADS_QO, HEADS_KV, HEAD_DIM, BENCH_PAGE, mask="causal", share_prefixes=share)
        assert decoder.spec.shared_prefix == share
        assert decoder.work.num_work > 256 if share else decoder.work.num_work >= 256


# ---- CUDA-graph mode asked to share -------------------------------------------------------------

GRAPH_BATCH = 16


def graph_decoder(planner, library):
    return cpu_decoder(planner, use_cuda_graph=True, max_batch_size=GRAPH_BATCH, max_num_pages=8192,
                       host_planner=HostPlanner(library))


def check_graph_plan(decoder, lists, last, q_len: int, causal: bool, capacity):
    """The plan's records fill the fixed capacity (padding after them), its slots fit the
    partials, and the list computes every request's whole attention (emulated)."""
    plan = decoder.current_plan
    assert decoder.spec.shared_prefix and plan.capacity == capacity
    assert plan.decode_launch.grid[0] == capacity.work * 8  # the captured grid: the capacity's items
    work = decoder.work
    records = item_records(plan.buffers.host, plan.buffers.starts)
    assert (records[work.num_work:, 0] == -1).all() and work.req_work_indptr[-1] <= capacity.partial_slots
    indptr, ids, kv, _ = page_table(lists, last)
    data = np.random.default_rng(len(lists))
    pages = int(ids.max()) + 1
    q = data.standard_normal((len(lists) * q_len, 8, 4))  # 2 KV heads of the plan's group of 4
    k, v = (data.standard_normal((pages * PAGE, 2, 4)) for _ in range(2))
    qo = np.arange(len(lists) + 1) * q_len
    got = emulate(records[:work.num_work], work.req_work_indptr, qo, q, k, v, ids, 4, causal)
    np.testing.assert_allclose(got, whole_attention(q, k, v, indptr, ids, kv, q_len, 4, causal), atol=1e-9)
    return records[:work.num_work]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("graphs_pack", [False, True])
def test_a_cuda_graph_decoder_asked_to_share_plans_every_batch_with_the_shared_kernel(planner, native, causal,
                                                                                   graphs_pack, monkeypatch):
    """share_prefixes=True in CUDA-graph mode: the shared kernel and the capacity of the first plan
    (built for 2 query tokens) serve batches that share and batches that do not (each request alone
    in the shared format), of 1 or 2 query tokens. The graph's launch is fixed: where graphs pack
    (shared_decode.GRAPHS_PACK), the packed entry point over a CTA for each record's KV head
    (packed_from -1), which short own items share 4 heads a CTA as in eager plans; else the plain
    entry point, every record a CTA a head."""
    monkeypatch.setattr(shared_decode, "GRAPHS_PACK", graphs_pack)
    library = native_library() if native else None
    if native and library is None:
        pytest.skip("no C compiler: the numpy planner is the only one")
    decoder, capacity, shared_seen, packed_seen = graph_decoder(planner, library), None, 0, 0
    for seed in range(8):
        rng = random.Random(seed)
        lists, last = random_tree(rng, rng.randint(1, GRAPH_BATCH))
        if seed % 3 == 2:  # requests alone
            lists = [[1000 * r + i for i in range(len(pages))] for r, pages in enumerate(lists)]
        q_len = rng.choice([1, 2]) if seed else 2
        decoder.plan(*plan_args(lists, last), 32, 8, 128, PAGE, q_len=q_len, mask="causal" if causal else "none",
                     share_prefixes=True)
        capacity = capacity or decoder.current_plan.capacity
        records = check_graph_plan(decoder, lists, last, q_len, causal, capacity)
        shared_seen += bool((records[:, 7] < 0).any())
        heads, short = records[:, 11], records[:, 2] - records[:, 1] <= HEAD_PACK_MAX_TILES * decoder.kernel.tiling.tile_tokens
        assert (heads == np.where((records[:, 7] >= 0) & short & graphs_pack, 4, 1)).all()
        packed_seen += bool((heads == 4).any())
        launch, packed_from = decoder.current_plan.decode_launch, decoder.current_plan.decode_args.packed_from
        assert launch.function == (PACKED_FN if graphs_pack else DECODE_FN)
        assert packed_from == (-1 if graphs_pack else capacity.work) and launch.grid == (capacity.work * 8, 1, 1)
    assert 0 < shared_seen < 8 and (packed_seen > 0) == graphs_pack


def _samples_of_one_prompt():
    prompt = list(range(400))
    lists = [prompt + [1000 + 10 * r + i for i in range(3)] for r in range(GRAPH_BATCH)]
    return lists, [PAGE] * GRAPH_BATCH


def test_a_cuda_graph_plan_holds_the_eager_plans_slots(planner):
    """16 samples of a long prompt: the sharing graph's capacity holds the slots of the eager plan,
    so the graph plan takes the eager plan's chunk."""
    lists, last = _samples_of_one_prompt()
    eager = cpu_decoder(planner)
    eager.plan(*plan_args(lists, last), 32, 8, 128, PAGE)
    decoder = graph_decoder(planner, native_library())
    decoder.plan(*plan_args(lists, last), 32, 8, 128, PAGE, share_prefixes=True)
    capacity = decoder.current_plan.capacity
    assert capacity.slots == GRAPH_BATCH * graph_mode.SHARED_SLOTS_PER_REQUEST
    check_graph_plan(decoder, lists, last, 1, False, capacity)
    assert decoder.work.chunk_tokens == eager.work.chunk_tokens
    np.testing.assert_array_equal(decoder.work.req_work_indptr, eager.work.req_work_indptr)


def test_a_cuda_graph_plan_over_the_capacity_takes_longer_chunks(planner, monkeypatch):
    """With fewer slots a request than the eager plan takes, the graph plan lengthens its chunk
    until records and slots fit, and still shares the prompt."""
    monkeypatch.setattr(graph_mode, "SHARED_SLOTS_PER_REQUEST", 4)
    lists, last = _samples_of_one_prompt()
    eager = cpu_decoder(planner)
    eager.plan(*plan_args(lists, last), 32, 8, 128, PAGE)
    decoder = graph_decoder(planner, native_library())
    decoder.plan(*plan_args(lists, last), 32, 8, 128, PAGE, share_prefixes=True)
    capacity = decoder.current_plan.capacity
    assert eager.spec.shared_prefix and eager.work.req_work_indptr[-1] > capacity.partial_slots
    records = check_graph_plan(decoder, lists, last, 1, False, capacity)
    assert (records[:, 7] < 0).any() and decoder.work.chunk_tokens > eager.work.chunk_tokens


def test_a_cuda_graph_decoder_shares_only_when_asked_and_keeps_its_kernel(planner):
    lists, last = SHARED_BATCH
    default = graph_decoder(planner, native_library())
    default.plan(*plan_args(lists, last), 32, 8, 128, PAGE)
    assert not default.spec.shared_prefix  # the default keeps CUDA-graph mode per request
    decoder = graph_decoder(planner, native_library())
    decoder.plan(*plan_args(lists, last), 32, 8, 128, PAGE, share_prefixes=True)
    first = decoder.current_plan
    for options in (dict(share_prefixes=False), dict(), dict(share_prefixes=True, check_page_ids=False)):
        with pytest.raises(ValueError, match="the first plan's kernel"):
            decoder.plan(*plan_args(lists, last), 32, 8, 128, PAGE, **options)
        assert decoder.current_plan is first  # a refused plan leaves the previous one
