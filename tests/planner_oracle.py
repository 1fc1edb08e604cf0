"""plan()'s host path in its plainest numpy form: the oracles its faster forms must match exactly."""

from __future__ import annotations

import numpy as np

from flashjit import validation as checks
from flashjit.validation import host_int_array, indptr_array
from flashjit.worklist.split import ITEM_OVERHEAD_TOKENS, MERGE_COST_TOKENS, MIN_CHUNK_TOKENS, SPLIT_CANDIDATES, WorkPlan


def reference_estimate_time(span_lens, chunks, ctas_per_item, max_ctas):
    lens = np.asarray(span_lens, dtype=np.float64)
    chunks = np.asarray(chunks, dtype=np.float64)
    items = np.maximum(np.ceil(np.divide.outer(lens, chunks)), 1.0)
    total_items = items.sum(0)
    short_last = (2.0 * np.subtract.outer(lens, chunks) + chunks < 2.0 * (items - 1.0) * chunks).sum(0)
    fluid = (lens.sum() + total_items * ITEM_OVERHEAD_TOKENS) * (ctas_per_item / max_ctas)
    quantized = np.ceil((total_items - short_last) * ctas_per_item / max_ctas) * (chunks + ITEM_OVERHEAD_TOKENS)
    merge = np.where(total_items > len(lens), MERGE_COST_TOKENS, 0.0)
    return np.maximum(fluid, quantized) + merge


def reference_choose_chunk(span_lens, ctas_per_item, max_ctas, granularity, min_chunk=MIN_CHUNK_TOKENS,
                           max_items=None):
    span_lens = np.asarray(span_lens, dtype=np.int64)
    longest = int(span_lens.max(initial=0))
    whole = -(-max(longest, 1) // granularity) * granularity
    if longest <= min_chunk:
        return whole
    floor = max(-(-min_chunk // granularity) * granularity, granularity)
    parts = SPLIT_CANDIDATES[SPLIT_CANDIDATES <= max(1, max_ctas // ctas_per_item)]
    candidates = np.maximum(-(-(-(-longest // parts)) // granularity) * granularity, floor)
    cost = reference_estimate_time(span_lens, candidates, ctas_per_item, max_ctas)
    if max_items is not None:
        items = np.maximum(-(-span_lens[:, None] // candidates), 1).sum(0)
        cost = np.where(items <= max_items, cost, np.inf)
    return int(candidates[int(np.argmin(cost))])


def reference_plan_work(span_begin, span_end, qo_indptr, *, ctas_per_item, max_ctas, granularity, chunk_tokens=None,
                        max_items=None, fixed_split=False):
    span_begin = np.asarray(span_begin, dtype=np.int64)
    span_lens = np.maximum(np.asarray(span_end, dtype=np.int64) - span_begin, 0)
    if chunk_tokens is None:
        chunk = reference_choose_chunk(span_lens, ctas_per_item, max_ctas, granularity, max_items=max_items)
    else:
        chunk = int(chunk_tokens)
    items = np.maximum(1, -(-span_lens // chunk))
    req_work_indptr = np.zeros(len(span_lens) + 1, dtype=np.int64)
    np.cumsum(items, out=req_work_indptr[1:])
    work_request = np.repeat(np.arange(len(span_lens)), items)
    nth = np.arange(int(req_work_indptr[-1])) - req_work_indptr[work_request]
    work_begin = span_begin[work_request] + nth * chunk
    work_end = np.minimum(work_begin + chunk, span_begin[work_request] + span_lens[work_request])
    qo_indptr = np.asarray(qo_indptr, dtype=np.int64)
    token_request = np.repeat(np.arange(len(span_lens)), np.diff(qo_indptr))
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return WorkPlan(i32(work_request), i32(work_begin), i32(work_end), i32(req_work_indptr), i32(qo_indptr),
                    i32(token_request), chunk, fixed_split)


def reference_page_table(indptr, last_page_len, page_size):
    """page_table in its plain form (the oracle of its faster form)."""
    indptr_h = indptr_array("indptr", indptr)
    last = host_int_array("last_page_len", last_page_len, len(indptr_h) - 1)
    pages = np.diff(indptr_h)
    bad = (last > page_size) | (last < 0) | ((last < 1) & (pages > 0))
    if np.any(bad):
        at = int(np.argmax(bad))
        checks.fail("last_page_len", f"values in 1..page_size={page_size} (0 only for requests with no pages)",
                    f"last_page_len[{at}]={last[at]}")
    return indptr_h, np.where(pages > 0, (pages - 1) * page_size + last, 0)
