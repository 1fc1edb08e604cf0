"""plan()'s host work: read the page table, plan the split-KV work, write the work list for the GPU.

Two implementations of the same steps, giving the same values:
  * NumpyTables, the reference: validation.page_table, validation.query_indptr and
    split.plan_work over numpy arrays. It takes any input form (tensors, numpy arrays,
    lists; any integer dtype) and says what is wrong with a bad one.
  * NativeTables: the same in one C file (native/host_plan.c, built by jit/host_library.py: serving/host_plan.py) over the
    tensors' memory, written straight into the staging buffer. For 64 requests the numpy steps
    cost ~90 us (about 60 numpy calls on short arrays), the C ones ~2 us.
HostPlanner.read() picks the native one for the common form (int32 CPU tensors, FlashInfer's
convention) and the numpy one for anything else, including any input the C checks refuse: the
numpy checks then raise the error that names the bad value.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .. import validation
from .record import ITEM_INTS  # int32 per work-item record
from .spans import SharedSpans
from .split import ITEM_OVERHEAD_TOKENS, MERGE_COST_TOKENS, MIN_CHUNK_TOKENS, SPLIT_CANDIDATES, WorkPlan, plan_work
from ..small_arrays import largest, smallest


class NumpyTables:
    """One plan's host tables and work, in numpy (the reference)."""

    def __init__(self, indptr, last_page_len, page_size: int, qo_indptr, q_len):
        self.indptr_h, self.kv_lens = validation.page_table(indptr, last_page_len, page_size)
        self.batch = len(self.kv_lens)
        self.qo_h = validation.query_indptr(qo_indptr, q_len, self.batch)
        self.q_lens = self.qo_h[1:] - self.qo_h[:-1]
        self.num_tokens = int(self.qo_h[-1])
        self.max_q_len = max(1, largest(self.q_lens, 1))
        self.num_page_ids = int(self.indptr_h[-1])
        self.work: WorkPlan | None = None

    @property
    def page_indptr(self) -> np.ndarray:
        return self.indptr_h

    @property
    def query_indptr(self) -> np.ndarray:
        return self.qo_h

    def plan(self, span_begin, span_end, **options) -> WorkPlan:
        """split.plan_work over the spans (span_end None: the kv_lens); options as plan_work's."""
        self.work = plan_work(span_begin, self.kv_lens if span_end is None else span_end, self.qo_h, **options)
        return self.work

    def write(self, host: np.ndarray, starts: tuple, staging_pointer: int):
        """The work list into the staging buffer (host, a numpy view of it; starts, the offsets of
        buffers.PlanBuffers.FIELDS): per item its record, then the merges' arrays."""
        work = self.work
        _, num_tokens, qo, work_indptr, token_request = starts
        r, q_begin, first_item = work.work_request, work.req_qo_indptr, work.req_work_indptr
        splits = first_item[1:] - first_item[:-1]
        records = item_records(host, starts)
        if work.fixed_split:  # each item a sharing group of its own
            index, share_begin, share_end, sharers = np.zeros_like(r), work.work_begin, work.work_end, np.ones_like(r)
        else:  # the request's items share its span: from its first item's begin to its last item's end
            share_begin, share_end = work.work_begin[first_item[:-1]][r], work.work_end[first_item[1:] - 1][r]
            index, sharers = np.arange(work.num_work) - first_item[r], splits[r]  # among the request's items
        records[:work.num_work] = np.stack([r, work.work_begin, work.work_end, self.kv_lens[r], self.indptr_h[r],
                                            q_begin[r], self.q_lens[r], splits[r], index, share_begin, share_end,
                                            sharers], axis=1)
        records[work.num_work:, 0] = -1  # padding: positions of a CUDA-graph grid past this plan's items
        host[num_tokens] = work.num_tokens
        for start, values in ((qo, q_begin), (work_indptr, work.req_work_indptr), (token_request, work.token_request)):
            host[start:start + len(values)] = values

    def work_plan(self, host: np.ndarray, starts: tuple) -> WorkPlan:
        return self.work


def item_records(host: np.ndarray, starts: tuple) -> np.ndarray:
    """The staging buffer's work-item records, [capacity, ITEM_INTS]: the fields of
    record.WORK_ITEM_FIELDS, as worklist/kernel_core.cuh's WorkItem reads them."""
    first, end = starts[0], starts[1]
    return host[first:end].reshape(-1, ITEM_INTS)


class PlanParams(ctypes.Structure):
    """Mirror of fj_plan_t in native/host_plan.c (tests/worklist/test_worklist_abi.py checks the layout)."""

    _c_name_ = "fj_plan_t"
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "indptr", "last_page_len", "qo_indptr", "span_begin", "span_end", "parts", "kv_lens")] + [
        (name, ctypes.c_int64) for name in (
            "batch", "page_size", "q_len", "num_parts", "ctas_per_item", "max_ctas", "granularity", "min_chunk",
            "chunk_tokens", "fixed_split", "max_items", "item_overhead", "merge_cost", "num_page_ids", "num_tokens", "max_q_len", "chunk",
            "num_work")]


class SharedParams(ctypes.Structure):
    """Mirror of fj_shared_t: a batch's shared spans, and what fj_shared_plan derives for fj_shared_fill."""

    _c_name_ = "fj_shared_t"
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "first", "count", "begin_page", "end_page", "shared_pages", "slots", "offsets")] + [
        (name, ctypes.c_int64) for name in ("groups", "group_size", "row_tiles", "row_warps", "head_pack",
                                            "merge_waits", "num_shared", "num_slots", "num_packed",
                                            "merges_in_kernel")]


class StagingLayout(ctypes.Structure):
    """Mirror of fj_layout_t: the staging buffer's field offsets (in buffers.PlanBuffers.FIELDS'
    order) and how many item records it holds."""

    _c_name_ = "fj_layout_t"
    _fields_ = [(name, ctypes.c_int64) for name in (
        "work_items", "num_tokens", "req_qo_indptr", "req_work_indptr", "token_request", "work_capacity")]


def _int32_cpu_vector(t, length: int | None = None) -> bool:
    """A contiguous 1-D int32 CPU tensor (of that length): memory the C code can read as it is."""
    try:
        return (t.dtype is _torch_int32() and t.is_cpu and t.dim() == 1 and t.is_contiguous()
                and (length is None or t.shape[0] == length))
    except AttributeError:  # not a tensor
        return False


@functools.cache
def _torch_int32():
    import torch

    return torch.int32


class NativeTables:
    """One plan's host tables and work, computed by native/host_plan.c. Built by HostPlanner.read()."""

    packed_items = 0  # (a per-request plan packs no heads: WorkPlan.packed_items)
    merges_in_kernel = False  # (nor merges in the decode kernel: WorkPlan.merges_in_kernel)

    def __init__(self, planner: "HostPlanner", indptr, qo_indptr, q_len, batch: int, kv_scratch: np.ndarray):
        self._planner, self._qo_indptr, self._q_len = planner, qo_indptr, q_len
        self._indptr = indptr  # read again by write(): kept alive
        self.kv_scratch = kv_scratch
        p = planner.params
        self.kv_pointer = p.kv_lens  # kv_scratch's address, which the read has just set
        self.batch, self.num_tokens, self.max_q_len = batch, p.num_tokens, p.max_q_len
        self.num_page_ids = p.num_page_ids
        self._spans = None  # keeps the span arrays alive while the C code points at them
        self._work: WorkPlan | None = None

    @property
    def kv_lens(self) -> np.ndarray:
        """A view of the planner's scratch: valid until a later read() that does not keep these tables."""
        return self.kv_scratch[:self.batch]

    @property
    def page_indptr(self) -> np.ndarray:
        """indptr as numpy (a view of the caller's tensor)."""
        return self._indptr.numpy()

    @property
    def query_indptr(self) -> np.ndarray:
        """The query-token offsets [B+1] as numpy."""
        if self._qo_indptr is None:
            return np.arange(self.batch + 1, dtype=np.int64) * (1 if self._q_len is None else self._q_len)
        return self._qo_indptr.numpy()

    @property
    def q_lens(self) -> np.ndarray:
        if self._qo_indptr is None:
            return np.full(self.batch, 1 if self._q_len is None else self._q_len, dtype=np.int64)
        qo = self._qo_indptr.numpy().astype(np.int64)
        return qo[1:] - qo[:-1]

    def plan(self, span_begin, span_end, *, ctas_per_item: int, max_ctas: int, granularity: int,
             chunk_tokens: int | None = None, max_items: int | None = None,
             fixed_split: bool = False) -> "NativeTables":
        """split.plan_work's sizes (chunk_tokens, num_work); the arrays come with write()."""
        p = self._planner.params
        if span_end is None:
            p.span_begin = p.span_end = None
        else:
            self._spans = [None if a is None else np.ascontiguousarray(a, dtype=np.int64) for a in (span_begin, span_end)]
            p.span_begin, p.span_end = (None if a is None else a.ctypes.data for a in self._spans)
        p.ctas_per_item, p.max_ctas, p.granularity = ctas_per_item, max_ctas, granularity
        p.chunk_tokens = 0 if chunk_tokens is None else chunk_tokens
        p.fixed_split = self.fixed_split = fixed_split
        p.max_items = -1 if max_items is None else max_items
        self._planner.library.fj_plan(ctypes.byref(p))
        self.chunk_tokens, self.num_work = p.chunk, p.num_work
        return self

    @property
    def needs_merge(self) -> bool:
        return self.num_work > self.batch

    def write(self, host: np.ndarray, starts: tuple, staging_pointer: int):
        self._planner.library.fj_fill(ctypes.byref(self._planner.params), ctypes.c_void_p(staging_pointer),
                                      ctypes.byref(self._planner.layout(starts)))

    def work_plan(self, host: np.ndarray, starts: tuple) -> WorkPlan:
        """The work list as numpy views of the staging buffer (valid until the next plan())."""
        if self._work is None:
            _, _, qo, work_indptr, token_request = starts
            w, b = self.num_work, self.batch
            records = item_records(host, starts)[:w]
            self._work = WorkPlan(records[:, 0], records[:, 1], records[:, 2], host[work_indptr:work_indptr + b + 1],
                                  host[qo:qo + b + 1], host[token_request:token_request + self.num_tokens],
                                  self.chunk_tokens, self.fixed_split, self.packed_items, self.merges_in_kernel)
        return self._work


class NativeSharedTables:
    """NativeTables of a batch that shares prefixes, with shared.py's work list (SharedTables' in
    numpy, its reference) computed by native/host_plan.c: fj_shared_plan sizes it, write() puts it
    straight into the staging buffer. Built by HostPlanner.shared_tables()."""

    def __init__(self, planner: "HostPlanner", tables: NativeTables, shared: SharedParams):
        self._planner, self._shared, self.base = planner, shared, tables
        self.batch, self.num_tokens, self.max_q_len = tables.batch, tables.num_tokens, tables.max_q_len
        self.num_page_ids, self.kv_scratch = tables.num_page_ids, tables.kv_scratch
        p = planner.params
        self.chunk_tokens, self.num_work = p.chunk, p.num_work
        self.num_shared, self.num_slots, self.packed_items = shared.num_shared, shared.num_slots, shared.num_packed
        self.merges_in_kernel = bool(shared.merges_in_kernel)
        self.fixed_split = False
        self._work: WorkPlan | None = None

    @property
    def kv_lens(self) -> np.ndarray:
        return self.base.kv_lens

    @property
    def q_lens(self) -> np.ndarray:
        return self.base.q_lens

    @property
    def needs_merge(self) -> bool:
        return self.num_work > self.batch and not self.merges_in_kernel

    def write(self, host: np.ndarray, starts: tuple, staging_pointer: int):
        planner = self._planner
        planner.library.fj_shared_fill(ctypes.byref(planner.params), ctypes.byref(self._shared),
                                       ctypes.c_void_p(staging_pointer), ctypes.byref(planner.layout(starts)))

    work_plan = NativeTables.work_plan  # views of the staging buffer, as NativeTables' (req_work_indptr: the slots)


class HostPlanner:
    """Makes each plan's tables: native when the library loaded and the inputs allow, else numpy."""

    def __init__(self, library: ctypes.CDLL | None):
        self.library = library
        if library is None:
            return
        for name in ("fj_read", "fj_plan", "fj_fill"):
            getattr(library, name).restype = ctypes.c_int
        library.fj_shared_spans.restype = ctypes.c_int64
        library.fj_shared_spans.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_void_p]
        library.fj_shared_plan.restype = library.fj_shared_fill.restype = ctypes.c_int
        self._last_read = None  # the NativeTables params describes: what the shared-prefix calls read
        self._shared_scratch, self._shared_pointer = np.empty(0, dtype=np.int64), 0
        self._spans = None  # the SharedSpans of the last shared_spans(), whose arrays _shared points at
        self._searched = None  # the tables that search read
        self._shared = SharedParams()
        library.fj_id_range.restype = None
        self.params = p = PlanParams()
        self._parts = SPLIT_CANDIDATES.astype(np.int64)
        p.parts, p.num_parts = self._parts.ctypes.data, len(self._parts)
        p.min_chunk, p.item_overhead, p.merge_cost = MIN_CHUNK_TOKENS, ITEM_OVERHEAD_TOKENS, MERGE_COST_TOKENS
        # Two scratch arrays for the C code's kv_lens: a read writes the one the tables it keeps do not use.
        self._kv_scratch = [np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)]
        self._kv_pointers = [0, 0]
        self._layouts: dict[tuple, StagingLayout] = {}
        self._range = (ctypes.c_int64 * 2)()

    def read(self, indptr, last_page_len, page_size: int, qo_indptr=None, q_len=None, keep=None):
        """The tables of a page table (and query offsets): NativeTables or NumpyTables. A bad input
        raises ValueError naming it. keep: tables of an earlier read (the current plan's) whose
        kv_lens stay valid, however this read ends."""
        if qo_indptr is not None and q_len is not None:
            validation.fail("qo_indptr and q_len", "one of them (qo_indptr gives each request's query tokens, q_len "
                            "one count for all)", f"both (q_len={q_len!r})")
        if self.library is not None and _int32_cpu_vector(indptr) and indptr.shape[0] >= 1:
            batch = indptr.shape[0] - 1
            queries_ok = (_int32_cpu_vector(qo_indptr, batch + 1) if qo_indptr is not None
                          else q_len is None or (type(q_len) is int and 1 <= q_len <= validation.INT32_MAX))
            if queries_ok and _int32_cpu_vector(last_page_len, batch):
                p = self.params
                slot = 1 if getattr(keep, "kv_scratch", None) is self._kv_scratch[0] else 0
                scratch = self._kv_scratch[slot]
                if len(scratch) < batch:
                    scratch = self._kv_scratch[slot] = np.empty(max(batch, 2 * len(scratch)), dtype=np.int64)
                    self._kv_pointers[slot] = scratch.ctypes.data
                p.kv_lens = self._kv_pointers[slot]
                p.indptr, p.last_page_len, p.batch, p.page_size = indptr.data_ptr(), last_page_len.data_ptr(), batch, page_size
                p.qo_indptr = None if qo_indptr is None else qo_indptr.data_ptr()
                p.q_len = 1 if q_len is None else q_len
                if not self.library.fj_read(ctypes.byref(p)):
                    self._last_read = NativeTables(self, indptr, qo_indptr, q_len, batch, scratch)
                    return self._last_read
        return NumpyTables(indptr, last_page_len, page_size, qo_indptr, q_len)

    def shared_spans(self, tables, ids, page_size: int, causal: bool, max_levels: int):
        """spans.find_shared_spans over the NativeTables of the last read() and ids (a
        contiguous int32 CPU tensor), in C (views of a scratch array, valid until the next call);
        NotImplemented for other tables or without the library."""
        if self.library is None or tables is not self._last_read:
            return NotImplemented
        self._searched = tables
        batch = tables.batch
        if len(self._shared_scratch) < 16 * batch:  # fj_shared_spans' layout
            self._shared_scratch = np.empty(16 * max(batch, 64), dtype=np.int64)
            self._shared_pointer = self._shared_scratch.ctypes.data
        shared = self._shared
        groups = self.library.fj_shared_spans(ctypes.byref(self.params), ids.data_ptr(), int(causal), max_levels,
                                              self._shared_pointer, ctypes.byref(shared))
        if groups <= 0:  # 0: nothing shared (-1, more groups than the scratch holds, cannot happen)
            self._spans = None
            return None
        scratch, b = self._shared_scratch, batch
        spans = SharedSpans(scratch[b:b + groups], scratch[3 * b:3 * b + groups], scratch[5 * b:5 * b + groups],
                            scratch[7 * b:7 * b + groups], scratch[9 * b:9 * b + groups], scratch[11 * b:12 * b])
        self._spans = spans
        return spans

    def shared_tables(self, tables, spans: SharedSpans | None, *, group_size: int, row_tiles: int,
                      ctas_per_item: int, max_ctas: int, granularity: int, row_warps: int = 1,
                      head_pack: int = 1, merge_waits: bool = False, chunk_tokens: int | None = None):
        """NativeSharedTables of the last read()'s NativeTables and the spans the last shared_spans()
        found over them (None: it found none, and every request is planned alone in the shared
        kernel's format): the work list of shared.plan_shared_work (its arguments);
        NotImplemented for other tables or spans."""
        if (self.library is None or tables is not self._last_read or tables is not self._searched
                or spans is not self._spans):
            return NotImplemented
        p, shared = self.params, self._shared
        p.ctas_per_item, p.max_ctas, p.granularity = ctas_per_item, max_ctas, granularity
        p.chunk_tokens = 0 if chunk_tokens is None else chunk_tokens
        p.span_begin = p.span_end = None  # a sharing mask reads every request's whole span
        shared.group_size, shared.row_tiles, shared.row_warps = group_size, row_tiles, row_warps
        shared.head_pack, shared.merge_waits = head_pack, int(merge_waits)
        self.library.fj_shared_plan(ctypes.byref(p), ctypes.byref(shared))
        return NativeSharedTables(self, tables, shared)

    def id_range(self, ids, count: int) -> tuple[int, int]:
        """(smallest, largest) of the first count (>= 1) values of ids, an int32 CPU tensor."""
        if self.library is None:
            values = ids.numpy()[:count]
            return smallest(values), largest(values)
        self.library.fj_id_range(ctypes.c_void_p(ids.data_ptr()), ctypes.c_int64(count), self._range)
        return self._range[0], self._range[1]

    def layout(self, starts: tuple) -> StagingLayout:
        found = self._layouts.get(starts)
        if found is None:
            found = self._layouts[starts] = StagingLayout(*starts, (starts[1] - starts[0]) // ITEM_INTS)
        return found
