"""The work list of a batch with shared prefixes (spans.SharedSpans): shared records, member slots, own items.

In numpy: the reference of native/host_plan.c's fj_shared_plan and fj_shared_fill, which plan()
uses with the native host tables (tests/worklist/test_shared_plan_native.py holds them to the same bytes).

The grid runs the records; the merge reads partial slots, which here are not grid positions:
  * The records: first the shared ones, each one chunk of a group's span for a run of consecutive
    members (as many as the CTA's row tiles hold: rows = GQA group x members x query tokens), the
    runs of one chunk next to each other so their CTAs read the chunk from HBM once and from L2
    after (first in the grid: they are the longest work); then every request's own items over
    [shared end, kv_len), each naming its slot in its share field, and in its last field the KV
    heads one CTA of it attends: head_pack (the kernel's tiling.own_head_pack) for an item of at
    most HEAD_PACK_MAX_TILES tiles, else 1. The packed items come last (from the kernel's
    Args::packed_from), where the packed entry point's grid gives them a CTA for each head_pack
    heads. In a plan the kernel merges (merges_in_kernel), the last field of each request's last
    own item also carries record.MERGE_WAITS, every other record's record.MERGE_COUNTS.
  * Request b's slots [req_work_indptr[b], req_work_indptr[b+1]), which the merge reads: one per
    chunk of every group b belongs to (outermost level first), then one per own item. The shared
    record of a chunk writes each member's partial into that member's slot of the chunk.

A shared record reuses the 12 fields of record.WORK_ITEM_FIELDS: request = its first member, the
chunk's [v_begin, v_end), kv_len = the span's end, page_begin = the first member's page offset (the
members' first pages are the same ids), q_begin = the slot offset k (member m's partial goes to
position req_work_indptr[m] + k), q_len = the members' query tokens, splits = -(members); the
sharing group is the item alone. Only a kernel built with shared_prefix reads them (and the own
items' slots).
"""

from __future__ import annotations

import numpy as np

from .record import ITEM_INTS, MERGE_COUNTS, MERGE_WAITS
from .spans import SharedSpans
from .split import WorkPlan, choose_chunk, plan_work


class SharedWork:
    """One batch's shared-prefix work list: the WorkPlan the merge and tests read, and the records."""

    def __init__(self, work: WorkPlan, records: np.ndarray, spans: SharedSpans, num_shared: int, num_slots: int):
        self.work, self.records, self.spans, self.num_shared = work, records, spans, num_shared
        self.num_slots = num_slots  # partial slots: the merge's ranges cover [0, num_slots)


# A shared record's CTA is priced per key at (5 + tiles) / 6 of an ordinary one's, tiles being the
# 16-row MMA tiles it holds (1 to its warps): its warps' MMAs and exponentials grow with the rows, its
# K/V bytes do not. On an H200 at head_dim 128 (4 tiles, warpgroup MMAs) the two read at 35-37 against
# 32 ns per key, both kinds resident at once; yet a base of 5 plans the benchmark's rows as fast as
# 11 and 29 or faster (up to 11 us on 16 samples x 32768), its shorter shared chunks balancing the
# shared records' slower start.
TILE_COST_BASE = 5

# A request's own item this short takes head_pack KV heads per CTA: its CTA's chain of loads before
# the first tile (record, page ids, K and V) is most of such an item's time, and one chain then
# serves head_pack heads. On an H200, 64 samples x (2048 + 128) ran in 30.9 us against 34.0 (its 512
# items of 2 tiles become 128 CTAs of 8, the plan one wave); the 4-tile items of 4 x 16 samples x
# (4096 + 256) ran no faster packed (55-61 us against 55).
HEAD_PACK_MAX_TILES = 2


def item_heads(lengths, head_pack: int, granularity: int) -> np.ndarray:
    """KV heads one CTA of an own item of each length attends: head_pack up to HEAD_PACK_MAX_TILES
    tiles, else 1."""
    return np.where(np.asarray(lengths) <= HEAD_PACK_MAX_TILES * granularity, head_pack, 1)


def merges_in_kernel(records: int, packed: int, ctas_per_item: int, head_pack: int, max_ctas: int) -> bool:
    """Whether a plan's attending CTAs (a packed item's one per head_pack heads, the others' each)
    fit one wave (max_ctas): its kernel then merges the partials, each request's last own item
    waiting for the others (worklist/kernel_core.cuh's merge_when_written). The CTAs it waits for come
    before it in the grid, so it always finishes; in one wave its wait holds no slot another CTA
    needs."""
    return (records - packed) * ctas_per_item + packed * (ctas_per_item // head_pack) <= max_ctas


def members_per_record(group_size: int, q_len: int, row_tiles: int, row_warps: int = 1) -> int:
    """Members one shared record's CTAs hold: their rows (group x q_len each) fill the row tiles
    (row_warps 16-row tiles per CTA)."""
    return max(1, (row_tiles * row_warps * 16) // (group_size * q_len))


def record_tiles(members, rows_per_member, row_tiles: int, row_warps: int):
    """16-row tiles one CTA of a record of `members` holds (1 to row_warps)."""
    tiles = -(-(np.asarray(members, dtype=np.int64) * rows_per_member) // 16)  # of the whole record
    return np.clip(-(-tiles // row_tiles), 1, row_warps)


def weighted_spans(span_tokens, tiles):
    """Shared spans' lengths priced at their records' cost per key (TILE_COST_BASE)."""
    return -(-np.asarray(span_tokens, dtype=np.int64) * (TILE_COST_BASE + tiles) // (TILE_COST_BASE + 1))


def shared_chunks(chunk: int, span_tokens, tiles, granularity: int):
    """The chunk of shared spans whose records hold `tiles` tiles per CTA: each span cut evenly into
    as many pieces as its weighted length makes of chunk (so a record costs about what an own item
    of chunk keys does), rounded up to the granularity: never more pieces than the makespan priced."""
    pieces = -(-weighted_spans(span_tokens, tiles) // chunk)
    piece = -(-np.asarray(span_tokens, dtype=np.int64) // pieces)
    return -(-piece // granularity) * granularity


def plan_shared_work(spans: SharedSpans, indptr: np.ndarray, kv_lens: np.ndarray, qo_indptr: np.ndarray,
                     page_size: int, *, group_size: int, row_tiles: int, ctas_per_item: int, max_ctas: int,
                     granularity: int, row_warps: int = 1, head_pack: int = 1, merge_waits: bool = False,
                     chunk_tokens: int | None = None) -> SharedWork:
    """The work list (module docstring); spans with no groups plan every request alone in this
    format. chunk_tokens forces the chunk (else the makespan estimate picks it); head_pack: KV
    heads a CTA of a short own item attends (1, or the kernel's tiling.own_head_pack); merge_waits:
    the kernel merges a plan whose attending CTAs fit one wave (its tiling.waiting_merge)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    qo = np.asarray(qo_indptr, dtype=np.int64)
    q_lens = qo[1:] - qo[:-1]
    batch = len(kv_lens)
    own_begin = np.minimum(spans.shared_pages * page_size, kv_lens)
    span_tokens = (spans.end_page - spans.begin_page) * page_size
    rows_per_member = group_size * q_lens[spans.first]
    with np.errstate(divide="ignore"):  # members without queries: one a record
        per_record = np.maximum(1, (row_tiles * row_warps * 16) // rows_per_member)  # members_per_record
    subsets = -(-spans.count // per_record)
    tiles = record_tiles(np.minimum(per_record, spans.count), rows_per_member, row_tiles, row_warps)
    # One chunk, priced with each shared span once per member run at its records' cost per key;
    # a shared span is cut evenly into as many pieces as its weighted length makes of the chunk.
    # Own spans short enough to pack launch head_pack times fewer CTAs, each head_pack times longer:
    # priced as one span of head_pack times the length for every head_pack of them.
    own_lens = kv_lens - own_begin
    packs = item_heads(own_lens, head_pack, granularity) > 1
    lens = np.concatenate([own_lens[~packs], head_pack * own_lens[packs][::head_pack],
                           np.repeat(weighted_spans(span_tokens, tiles), subsets)])
    chunk = chunk_tokens or choose_chunk(lens, ctas_per_item, max_ctas, granularity)
    span_chunk = shared_chunks(chunk, span_tokens, tiles, granularity)
    chunks = -(-span_tokens // span_chunk)
    # Slots per request, and each group's slot offset: the chunks of its enclosing groups.
    slots = np.zeros(batch + 1, dtype=np.int64)
    offsets = np.zeros(spans.num_groups, dtype=np.int64)
    for level in range(int(spans.level.max()) + 1 if spans.num_groups else 0):
        at = spans.level == level
        offsets[at] = np.cumsum(slots)[:-1][spans.first[at]] if level else 0
        delta = np.zeros(batch + 1, dtype=np.int64)
        np.add.at(delta, spans.first[at], chunks[at])
        np.add.at(delta, spans.first[at] + spans.count[at], -chunks[at])
        slots += delta  # a difference array: cumsum gives each request's slots of this level and above
    slots = np.cumsum(slots)[:-1]
    own = plan_work(own_begin, kv_lens, qo, ctas_per_item=ctas_per_item, max_ctas=max_ctas,
                    granularity=granularity, chunk_tokens=chunk)
    # The shared records: group by group, chunk by chunk, member run by member run.
    per_chunk = subsets
    records_of = chunks * per_chunk
    group = np.repeat(np.arange(spans.num_groups), records_of)
    within = np.arange(int(records_of.sum())) - np.repeat(np.cumsum(records_of) - records_of, records_of)
    chunk_index, run = within // per_chunk[group], within % per_chunk[group]
    first = spans.first[group] + run * per_record[group]
    begin = spans.begin_page[group] * page_size + chunk_index * span_chunk[group]
    end = spans.end_page[group] * page_size
    v_end = np.minimum(begin + span_chunk[group], end)
    members = np.minimum(per_record[group], spans.first[group] + spans.count[group] - first)
    shared = np.stack([first, begin, v_end, end, indptr[first], offsets[group] + chunk_index,
                       q_lens[first], -members, np.zeros_like(first), begin, v_end, np.ones_like(first)], axis=1)
    num_shared = len(shared)
    own_items = np.diff(own.req_work_indptr).astype(np.int64)
    req_work_indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(slots + own_items, out=req_work_indptr[1:])
    # Own items after the shared records in the grid; each writes its partial to its slot (the
    # record's share field, which a shared_prefix kernel reads: its tiling shares no tiles).
    r = own.work_request.astype(np.int64)
    own_slot = req_work_indptr[r] + slots[r] + (np.arange(own.num_work) - own.req_work_indptr[r])
    splits = np.diff(req_work_indptr)
    heads = item_heads(own.work_end - own.work_begin, head_pack, granularity)
    own_records = np.stack([r, own.work_begin, own.work_end, kv_lens[r], indptr[r], qo[r], q_lens[r], splits[r],
                            own_slot, own.work_begin, own.work_end, heads], axis=1)
    packed = int(np.count_nonzero(heads > 1))
    in_kernel = merge_waits and merges_in_kernel(num_shared + own.num_work, packed, ctas_per_item, head_pack, max_ctas)
    if in_kernel:  # each request's last own item waits, every other record counts in
        shared[:, 11] |= MERGE_COUNTS
        last = np.zeros(own.num_work, dtype=bool)
        last[own.req_work_indptr[1:] - 1] = True
        own_records[:, 11] |= np.where(last, MERGE_WAITS, MERGE_COUNTS)
    # The packed items last in the grid, in their order (a request's last item packs if any of its do).
    own_records = own_records[np.argsort(heads > 1, kind="stable")]
    records = np.concatenate([shared, own_records]).astype(np.int32)
    work = WorkPlan(records[:, 0].copy(), records[:, 1].copy(), records[:, 2].copy(), req_work_indptr.astype(np.int32),
                    qo.astype(np.int32), own.token_request, chunk, False, packed, in_kernel)
    return SharedWork(work, records, spans, num_shared, int(req_work_indptr[-1]))


class SharedTables:
    """A plan's tables (worklist/host.py's) with a shared-prefix work list: what plan() writes instead."""

    def __init__(self, tables, shared: SharedWork):
        self.base, self.shared = tables, shared
        self.num_shared = shared.num_shared  # shared records, first in the grid (as NativeSharedTables')
        self.batch, self.num_tokens, self.max_q_len = tables.batch, tables.num_tokens, tables.max_q_len
        self.num_page_ids = tables.num_page_ids
        self.kv_lens = np.array(tables.kv_lens)  # a copy: the native planner's scratch is reused
        self.kv_scratch = getattr(tables, "kv_scratch", None)  # which scratch a later read must not reuse
        self.q_lens = tables.q_lens

    def write(self, host: np.ndarray, starts: tuple, staging_pointer: int):
        work = self.shared.work
        first, num_tokens, qo, work_indptr, token_request = starts
        records = host[first:num_tokens].reshape(-1, ITEM_INTS)
        records[:work.num_work] = self.shared.records
        records[work.num_work:, 0] = -1  # padding, past the grid
        host[num_tokens] = work.num_tokens
        for start, values in ((qo, work.req_qo_indptr), (work_indptr, work.req_work_indptr),
                              (token_request, work.token_request)):
            host[start:start + len(values)] = values

    def work_plan(self, host: np.ndarray, starts: tuple) -> WorkPlan:
        return self.shared.work
