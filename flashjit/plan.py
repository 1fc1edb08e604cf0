"""Split-KV planning: cut each request's KV span into equal chunks, sized by an estimate of the makespan.

Pure numpy, no GPU: unit-tested on the CPU. The decode kernel walks work items
(request, [begin, end)) over the span a mask makes worth reading (kv_span); a request with one
item writes its output directly, the others write partial states the merge kernel combines.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIN_CHUNK_TOKENS = 128  # below this a split costs more in merging than it gains in parallelism
ITEM_OVERHEAD_TOKENS = 64  # a CTA's fixed cost (prologue, pipeline fill, epilogue) in key-equivalents
MERGE_COST_TOKENS = 128    # the merge launch, in the same units


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


SPLIT_CANDIDATES = np.concatenate([np.arange(1, 25), [28, 32, 40, 48, 56, 64, 80, 96, 112, 128]])


def estimate_time(span_lens: np.ndarray, chunks: np.ndarray, ctas_per_item: int, max_ctas: int) -> np.ndarray:
    """Estimated makespan, in key-equivalents, of cutting every span into each candidate chunk size.

    The larger of: all work spread evenly over the resident CTA slots (the fluid bound), and the
    waves of near-full chunks one after another (the quantized bound, which catches a grid just
    over one wave). A split adds the merge's cost.
    """
    lens = np.asarray(span_lens, dtype=np.float64)
    chunks = np.asarray(chunks, dtype=np.float64)
    items = np.maximum(np.ceil(np.divide.outer(lens, chunks)), 1.0)
    total_items = items.sum(0)
    # items at least half a chunk long: all but the last, and the last if 2 * its length >= chunk
    short_last = (2.0 * np.subtract.outer(lens, chunks) + chunks < 2.0 * (items - 1.0) * chunks).sum(0)
    fluid = (lens.sum() + total_items * ITEM_OVERHEAD_TOKENS) * (ctas_per_item / max_ctas)
    quantized = np.ceil((total_items - short_last) * ctas_per_item / max_ctas) * (chunks + ITEM_OVERHEAD_TOKENS)
    merge = np.where(total_items > len(lens), MERGE_COST_TOKENS, 0.0)
    return np.maximum(fluid, quantized) + merge


def choose_chunk(span_lens: np.ndarray, ctas_per_item: int, max_ctas: int, granularity: int,
                 min_chunk: int = MIN_CHUNK_TOKENS, max_items: int | None = None) -> int:
    """The chunk (a multiple of granularity) with the smallest estimated makespan.

    Candidates cut the longest span into 1..128 equal parts (never below min_chunk, nor more parts
    than one wave holds); so a batch that already fills the GPU evenly is not split, while one long
    request among short ones is. max_items caps the work items (CUDA-graph capacity).
    """
    span_lens = np.asarray(span_lens, dtype=np.int64)
    longest = int(span_lens.max(initial=0))
    whole = -(-max(longest, 1) // granularity) * granularity
    if longest <= min_chunk:
        return whole
    floor = max(-(-min_chunk // granularity) * granularity, granularity)
    parts = SPLIT_CANDIDATES[SPLIT_CANDIDATES <= max(1, max_ctas // ctas_per_item)]
    candidates = np.maximum(-(-(-(-longest // parts)) // granularity) * granularity, floor)
    cost = estimate_time(span_lens, candidates, ctas_per_item, max_ctas)
    if max_items is not None:
        items = np.maximum(-(-span_lens[:, None] // candidates), 1).sum(0)
        cost = np.where(items <= max_items, cost, np.inf)
    return int(candidates[int(np.argmin(cost))])  # the first minimum: the fewest splits


def plan_work(span_begin: np.ndarray, span_end: np.ndarray, qo_indptr: np.ndarray, *,
              ctas_per_item: int, max_ctas: int, granularity: int, chunk_tokens: int | None = None,
              max_items: int | None = None) -> WorkPlan:
    """Work items for one batch.

    span_begin/span_end: [B] positions each request must read (from the mask's kv_span).
    ctas_per_item: CTAs one work item launches (KV heads x row tiles).
    max_ctas: CTAs resident at once (SMs x the kernel's occupancy): the grid aims at one wave.
    chunk_tokens: force a chunk size (tests, determinism); None plans it.
    max_items: at most this many work items (fixed CUDA-graph capacity); None for no limit.
    """
    span_begin = np.asarray(span_begin, dtype=np.int64)
    span_lens = np.maximum(np.asarray(span_end, dtype=np.int64) - span_begin, 0)
    if chunk_tokens is None:
        chunk = choose_chunk(span_lens, ctas_per_item, max_ctas, granularity, max_items=max_items)
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
