"""The shared-prefix work list in C (host_plan.c: fj_shared_plan, fj_shared_fill) against its numpy
reference (shared_plan.plan_shared_work, SharedTables.write): the same sizes and, in the staging
buffer, the same bytes, on random sharing trees."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flashjit.worklist.record import ITEM_INTS, MERGE_COUNTS, MERGE_WAITS, RECORD_HEADS
from flashjit.worklist.host import HostPlanner, NativeSharedTables
from flashjit.worklist.shared import SharedTables, plan_shared_work
from flashjit.worklist.spans import find_shared_spans

from cpu_decoders import native_library
from prefix_trees import PAGE, page_table, random_tree


def library_or_skip():
    library = native_library()
    if library is None:
        pytest.skip("no C compiler: the numpy work list is the only one")
    return library


def sharing_batch(rng: random.Random, kind: str):
    """(page lists, last page lengths) of one sharing pattern."""
    batch = rng.randint(2, 24)
    if kind == "tree":
        return random_tree(rng, batch)
    if kind == "none":
        lists = [[1000 * b + i for i in range(rng.randint(0, 5))] for b in range(batch)]
    elif kind == "full":  # every request the same pages
        lists = [list(range(rng.randint(1, 9)))] * batch
    else:  # "prefixes": each request a prefix of the next, or the next of it
        pages = list(range(rng.randint(2, 12)))
        lists = [pages[:rng.randint(1, len(pages))] for _ in range(batch)]
    return lists, [rng.randint(1, PAGE) if p else 0 for p in lists]


def staging(capacity: int, batch: int, tokens: int, fill: int):
    """A staging buffer of PlanBuffers' layout, filled with one garbage value (padding records keep
    all but their first word): (tensor, starts)."""
    sizes = (ITEM_INTS * capacity, 1, batch + 1, batch + 1, tokens)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return torch.full((int(offsets[-1]),), fill, dtype=torch.int32), tuple(int(x) for x in offsets[:5])


def kernel_sizes(rng: random.Random) -> dict:
    group = rng.choice([1, 2, 4, 8])
    row_tiles = rng.choice([1, 2, 4])
    return dict(group_size=group, row_tiles=row_tiles, row_warps=rng.choice([1, 4, 6]), head_pack=rng.choice([1, 4]),
                merge_waits=rng.random() < 0.5, ctas_per_item=rng.choice([1, 2, 8]) * row_tiles,
                max_ctas=rng.choice([8, 64, 264]), granularity=rng.choice([PAGE, 2 * PAGE, 16]))


def compare(planner: HostPlanner, lists, last, q_lens, causal: bool, sizes: dict, per_request_q: bool):
    """Plans one batch both ways; returns whether it shared, and whether the kernel merges it."""
    indptr, ids, kv, _ = page_table(lists, last)
    batch = len(lists)
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = dict(qo_indptr=torch.from_numpy(qo)) if per_request_q else dict(q_len=int(q_lens[0]))
    tables = planner.read(torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), PAGE,
                          **query)
    expected_spans = find_shared_spans(indptr, ids, kv, q_lens, PAGE, causal=causal)
    spans = planner.shared_spans(tables, torch.from_numpy(ids), PAGE, causal, 4)
    assert (spans is None) == (expected_spans is None)
    if spans is None:
        return False, False
    for name in spans._fields:
        assert getattr(spans, name).tolist() == getattr(expected_spans, name).tolist(), name
    with np.errstate(divide="ignore"):  # members without queries: numpy's x // 0 is 0, one member a record
        reference = plan_shared_work(expected_spans, indptr, kv, qo, PAGE, **sizes)
    native = planner.shared_tables(tables, spans, **sizes)
    assert isinstance(native, NativeSharedTables)
    assert (native.chunk_tokens, native.num_work, native.num_shared, native.num_slots, native.packed_items,
            native.merges_in_kernel, native.needs_merge) == \
        (reference.work.chunk_tokens, reference.work.num_work, reference.num_shared, reference.num_slots,
         reference.work.packed_items, reference.work.merges_in_kernel, reference.work.needs_merge)
    # A merge in the kernel: each request's last own item waits, every other record counts in.
    records = reference.records
    own = records[:, 7] >= 0
    last = own & np.append(records[1:, 0] != records[:-1, 0], True)
    roles = np.where(last, MERGE_WAITS, MERGE_COUNTS) if reference.work.merges_in_kernel else 0
    assert (records[:, 11] & ~RECORD_HEADS == roles).all()
    capacity = max(native.num_slots, native.num_work) + 3  # room for padding records past the list
    tokens = int(qo[-1])
    buffers = []
    for tables_of in (native, SharedTables(tables, reference)):
        host, starts = staging(capacity, batch, tokens, fill=0x5A5A5A5A)
        tables_of.write(host.numpy(), starts, host.data_ptr())
        buffers.append((host.numpy(), starts))
    (got, starts), (want, _) = buffers
    assert got.tobytes() == want.tobytes()
    work, expected = native.work_plan(got, starts), reference.work
    for name in ("work_request", "work_begin", "work_end", "req_work_indptr", "req_qo_indptr", "token_request"):
        assert getattr(work, name).tolist() == getattr(expected, name).tolist(), name
    return True, native.merges_in_kernel


@pytest.mark.parametrize("seed", range(8))
def test_native_shared_work_list_equals_numpy(seed):
    planner = HostPlanner(library_or_skip())
    rng = random.Random(seed)
    shared = in_kernel = 0
    for case in range(60):
        kind = rng.choice(["tree", "tree", "tree", "none", "full", "prefixes"])
        lists, last = sharing_batch(rng, kind)
        per_request_q = rng.random() < 0.5
        if per_request_q:  # runs of one query count (0 too), so that some neighbours differ and some share
            q_lens, q = [], rng.randint(1, 3)
            for _ in lists:
                q = rng.randint(0, 3) if rng.random() < 0.2 else q
                q_lens.append(q)
        else:
            q_lens = [rng.randint(1, 3)] * len(lists)
        for causal in (False, True):
            shares, merges = compare(planner, lists, last, np.array(q_lens), causal, kernel_sizes(rng), per_request_q)
            shared, in_kernel = shared + shares, in_kernel + merges
    assert shared >= 40 and in_kernel >= 5  # most patterns share, some merge in the kernel: not vacuous


def test_long_shared_spans_split_into_chunks():
    """Spans of hundreds of pages, cut into several chunks and member runs (the rows of 64 members
    overflow one record), with nested levels under them."""
    planner = HostPlanner(library_or_skip())
    rng = random.Random(7)
    prompt = list(range(600))
    lists = []
    for beam in range(8):
        middle = [10 ** 4 + 100 * beam + i for i in range(rng.randint(0, 40))]
        lists += [prompt + middle + [10 ** 6 + len(lists) * 10 + i for i in range(rng.randint(0, 3))]
                  for _ in range(8)]
    last = [rng.randint(1, PAGE) for _ in lists]
    sizes = dict(group_size=4, row_tiles=2, ctas_per_item=16, max_ctas=264, granularity=16)
    assert compare(planner, lists, last, np.ones(len(lists), int), True, sizes, False)[0]


def test_spans_of_an_earlier_detection_are_refused():
    """Their arrays are views of a scratch array that a later detection rewrote: numpy plans them."""
    planner = HostPlanner(library_or_skip())
    found = []
    for lists in ([[0, 1, 2], [0, 1, 3]], [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 1, 2]]):
        indptr, ids, _, last = page_table(lists)
        tables = planner.read(torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), PAGE)
        found.append(planner.shared_spans(tables, torch.from_numpy(ids), PAGE, False, 4))
    sizes = dict(group_size=4, row_tiles=1, ctas_per_item=8, max_ctas=264, granularity=16)
    assert planner.shared_tables(tables, found[0], **sizes) is NotImplemented
    assert isinstance(planner.shared_tables(tables, found[1], **sizes), NativeSharedTables)


def test_numpy_tables_and_foreign_spans_take_the_numpy_path():
    planner = HostPlanner(library_or_skip())
    lists, last = [[0, 1, 2, 3], [0, 1, 2, 4]], [PAGE, 2]
    indptr, ids, kv, _ = page_table(lists, last)
    tables = planner.read(torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), PAGE)
    spans = find_shared_spans(indptr, ids, kv, np.ones(2, int), PAGE, causal=False)
    sizes = dict(group_size=4, row_tiles=1, ctas_per_item=8, max_ctas=264, granularity=16)
    assert planner.shared_tables(tables, spans, **sizes) is NotImplemented
    numpy_tables = planner.read(indptr, last, PAGE)  # numpy arrays: the numpy tables
    assert planner.shared_tables(numpy_tables, spans, **sizes) is NotImplemented
