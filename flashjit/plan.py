"""Split-KV planning: cut each request's KV span into equal chunks so the grid is about one wave.

Pure numpy, no GPU: unit-tested on the CPU. The decode kernel walks work items
(request, [begin, end)) over the span a mask makes worth reading (kv_span); a request with one
item writes its output directly, the others write partial states the merge kernel combines.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIN_CHUNK_TOKENS = 128  # below this a split costs more in merging than it gains in parallelism


@dataclasses.dataclass(frozen=True, eq=False)
class WorkPlan:
    work_request: np.ndarray     # [W] request of each work item
    work_begin: np.ndarray       # [W] first span position (inclusive)
    work_end: np.ndarray         # [W] last span position (exclusive)
    req_work_indptr: np.ndarray  # [B+1] work items of request b: req_work_indptr[b]..[b+1]
    req_qo_indptr: np.ndarray    # [B+1] query tokens of request b
    token_request: np.ndarray    # [T] request of each query token
    chunk_tokens: int            # span positions per work item (the last of a request may be shorter)

    @property
    def num_work(self) -> int:
        return len(self.work_request)

    @property
    def num_tokens(self) -> int:
        return len(self.token_request)

    @property
    def needs_merge(self) -> bool:
        return bool(np.any(np.diff(self.req_work_indptr) > 1))

    @property
    def max_splits(self) -> int:
        return int(np.diff(self.req_work_indptr).max(initial=0))


def choose_chunk(span_lens: np.ndarray, ctas_per_item: int, max_ctas: int, granularity: int,
                 min_chunk: int = MIN_CHUNK_TOKENS) -> int:
    """Smallest chunk (a multiple of granularity, >= min_chunk) whose grid fits in max_ctas.

    No split when the batch alone fills the GPU or no span is longer than min_chunk.
    """
    longest = int(span_lens.max(initial=0))
    whole = max(granularity, -(-longest // granularity) * granularity)
    if len(span_lens) * ctas_per_item >= max_ctas or longest <= min_chunk:
        return whole
    lo = max(granularity, -(-min_chunk // granularity) * granularity)
    hi = whole
    while lo < hi:  # items(chunk) is non-increasing in chunk
        mid = (lo + hi) // 2 // granularity * granularity
        mid = max(mid, lo)
        items = np.maximum(1, -(-span_lens // mid)).sum()
        if items * ctas_per_item <= max_ctas:
            hi = mid
        else:
            lo = mid + granularity
    return lo


def plan_work(span_begin: np.ndarray, span_end: np.ndarray, qo_indptr: np.ndarray, *,
              ctas_per_item: int, max_ctas: int, granularity: int, chunk_tokens: int | None = None) -> WorkPlan:
    """Work items for one batch.

    span_begin/span_end: [B] positions each request must read (from the mask's kv_span).
    ctas_per_item: CTAs one work item launches (KV heads x row tiles).
    max_ctas: CTAs resident at once (SMs x the kernel's occupancy): the grid aims at one wave.
    chunk_tokens: force a chunk size (tests, determinism); None plans it.
    """
    span_begin = np.asarray(span_begin, dtype=np.int64)
    span_lens = np.maximum(np.asarray(span_end, dtype=np.int64) - span_begin, 0)
    if chunk_tokens is None:
        chunk = choose_chunk(span_lens, ctas_per_item, max_ctas, granularity)
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
                    i32(token_request), chunk)
