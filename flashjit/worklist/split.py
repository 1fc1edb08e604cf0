"""Split-KV planning: cut each request's KV span into equal chunks, sized by an estimate of the makespan.

Pure numpy, no GPU: unit-tested on the CPU. The decode kernel walks work items
(request, [begin, end)) over the span a mask makes worth reading (kv_span); a request with one
item writes its output directly, the others write partial states the merge kernel combines.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import record
from ..small_arrays import largest

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
    # Each item reads exactly its own span (a tile-sharing group of one, record.WORK_ITEM_FIELDS): the
    # items, so the output's rounding, depend on the request alone. Else a request's items may share
    # its tiles at run time (where the tiling's static_share is below 100).
    fixed_split: bool = False
    # Shared-prefix plans: own items whose CTA attends several KV heads (shared.HEAD_PACK_MAX_TILES),
    # which only the kernel's packed entry point reads.
    packed_items: int = 0
    # Shared-prefix plans of one wave: the decode kernel merges the partials (no merge launch).
    merges_in_kernel: bool = False

    @property
    def num_work(self) -> int:
        return len(self.work_request)

    @property
    def num_tokens(self) -> int:
        return len(self.token_request)

    @property
    def needs_merge(self) -> bool:
        """Whether the plan launches the merge: a request is split (every request has an item, so
        more items means one), and the decode kernel does not merge it."""
        return self.num_work > len(self.req_work_indptr) - 1 and not self.merges_in_kernel

    @property
    def max_splits(self) -> int:
        return int(np.diff(self.req_work_indptr).max(initial=0))


SPLIT_CANDIDATES = np.array(record.SPLIT_CANDIDATES)  # the GPU planner prices the same ones
_PARTS = record.SPLIT_CANDIDATES


def item_counts(span_lens: np.ndarray, chunks: list[int]) -> tuple[list[float], list[float], float]:
    """(work items, items at least half a chunk long, total length) of cutting every span into each chunk size.

    A span of len = k * chunk + r makes max(1, ceil(len / chunk)) items, of which k + [2r >= chunk]
    = floor(len / chunk + 1/2) are long. All come from one array of quotients, floored and summed
    once: len / -chunk (ceil(x) = -floor(-x)), len / chunk + 1/2, and len / 1 for the total. Exact
    for the non-negative spans below 2**31 that plan_work gives (every quotient is correctly
    rounded, far from the next integer unless on it, and every sum a whole number below 2**53).
    Whole numbers, as floats.
    """
    span_lens = np.asarray(span_lens)
    n = len(chunks)
    quotients = span_lens / np.array([-c for c in chunks] + chunks + [1], dtype=np.float64)[:, None]
    quotients[n:2 * n] += 0.5
    sums = np.floor(quotients, out=quotients).sum(1).tolist()
    empty = len(span_lens) - int(np.count_nonzero(span_lens))  # an empty span is one (empty) item
    return [empty - x for x in sums[:n]], sums[n:2 * n], sums[-1]


def makespans(span_lens: np.ndarray, chunks: list[int], ctas_per_item: int, max_ctas: int,
              max_items: int | None = None) -> list[float]:
    """Estimated makespan, in key-equivalents, of each chunk size (see estimate_time); inf for a
    chunk that makes more than max_items work items."""
    items, long_items, total_len = item_counts(span_lens, chunks)
    batch, share = len(span_lens), ctas_per_item / max_ctas
    limit = math.inf if max_items is None else max_items
    return [max((total_len + n * ITEM_OVERHEAD_TOKENS) * share,  # fluid
                math.ceil(n_long * ctas_per_item / max_ctas) * (chunk + ITEM_OVERHEAD_TOKENS))  # quantized
            + (MERGE_COST_TOKENS if n > batch else 0.0) if n <= limit else math.inf
            for chunk, n, n_long in zip(chunks, items, long_items)]


def estimate_time(span_lens: np.ndarray, chunks: np.ndarray, ctas_per_item: int, max_ctas: int) -> np.ndarray:
    """Estimated makespan, in key-equivalents, of cutting every span into each candidate chunk size.

    The larger of: all work spread evenly over the resident CTA slots (the fluid bound), and the
    waves of near-full chunks one after another (the quantized bound, which catches a grid just
    over one wave). A split adds the merge's cost.
    """
    span_lens = np.asarray(span_lens, dtype=np.int64)
    return np.array(makespans(span_lens, np.asarray(chunks).tolist(), ctas_per_item, max_ctas), dtype=np.float64)


def chunk_candidates(longest: int, max_parts: int, granularity: int, floor: int) -> list[int]:
    """The longest span cut into each of SPLIT_CANDIDATES parts (up to max_parts), rounded up to the
    granularity and at least floor: a non-increasing sequence, so duplicates are neighbours and
    dropped, and once floor is reached nothing smaller follows."""
    chunks = []
    for parts in _PARTS:
        if parts > max_parts:
            break
        chunk = max(-(-(-(-longest // parts)) // granularity) * granularity, floor)
        if not chunks or chunk != chunks[-1]:
            chunks.append(chunk)
        if chunk == floor:
            break
    return chunks


def choose_chunk(span_lens: np.ndarray, ctas_per_item: int, max_ctas: int, granularity: int,
                 min_chunk: int = MIN_CHUNK_TOKENS, max_items: int | None = None) -> int:
    """The chunk (a multiple of granularity) with the smallest estimated makespan.

    Candidates cut the longest span into 1..128 equal parts (never below min_chunk, nor more parts
    than one wave holds); so a batch that already fills the GPU evenly is not split, while one long
    request among short ones is. max_items caps the work items (CUDA-graph capacity). Ties go to
    the larger chunk (fewer splits); when no candidate fits max_items, the largest is returned.
    """
    span_lens = np.asarray(span_lens, dtype=np.int64)
    longest = largest(span_lens)
    whole = -(-max(longest, 1) // granularity) * granularity
    if longest <= min_chunk:
        return whole
    floor = max(-(-min_chunk // granularity) * granularity, granularity)
    candidates = chunk_candidates(longest, max(1, max_ctas // ctas_per_item), granularity, floor)
    costs = makespans(span_lens, candidates, ctas_per_item, max_ctas, max_items)
    return candidates[costs.index(min(costs))]  # the first minimum: the fewest splits


def plan_work(span_begin: np.ndarray | None, span_end: np.ndarray, qo_indptr: np.ndarray, *,
              ctas_per_item: int, max_ctas: int, granularity: int, chunk_tokens: int | None = None,
              max_items: int | None = None, fixed_split: bool = False) -> WorkPlan:
    """Work items for one batch.

    span_begin/span_end: [B] positions each request must read (from the mask's kv_span); span_begin
        None: every span starts at 0.
    ctas_per_item: CTAs one work item launches (KV heads x row tiles).
    max_ctas: CTAs resident at once (SMs x the kernel's occupancy): the grid aims at one wave.
    chunk_tokens: force a chunk size; None plans it.
    max_items: at most this many work items (fixed CUDA-graph capacity); None for no limit.
    fixed_split: every item reads exactly its own span (WorkPlan.fixed_split); needs chunk_tokens.
    """
    span_end = np.asarray(span_end, dtype=np.int64)
    if span_begin is None:
        span_end = span_lens = np.maximum(span_end, 0)
    else:
        span_begin = np.asarray(span_begin, dtype=np.int64)
        span_end = np.maximum(span_end, span_begin)  # an inverted span is empty
        span_lens = span_end - span_begin
    if chunk_tokens is None:
        chunk = choose_chunk(span_lens, ctas_per_item, max_ctas, granularity, max_items=max_items)
    else:
        chunk = int(chunk_tokens)
    items = np.maximum(span_lens + (chunk - 1), chunk) // chunk  # ceil(len / chunk), and one item for an empty span
    req_work_indptr = np.zeros(len(span_lens) + 1, dtype=np.int32)
    np.add.accumulate(items, out=req_work_indptr[1:])  # np.cumsum's wrapper costs three times this
    num_work = int(req_work_indptr[-1])
    requests = np.arange(len(span_lens), dtype=np.int32)
    if num_work == len(span_lens):  # nothing split: item b is request b
        work_request, work_begin, work_end = requests, span_end - span_lens, span_end
    else:
        work_request = np.repeat(requests, items)
        work_begin = (np.arange(num_work) - req_work_indptr[work_request]) * chunk
        if span_begin is not None:
            work_begin += span_begin[work_request]
        work_end = np.minimum(work_begin + chunk, span_end[work_request])
    qo_indptr = np.asarray(qo_indptr, dtype=np.int64)
    token_request = np.repeat(requests, qo_indptr[1:] - qo_indptr[:-1])
    i32 = lambda a: a.astype(np.int32)  # noqa: E731  (a new contiguous array)
    return WorkPlan(work_request, i32(work_begin), i32(work_end), req_work_indptr, i32(qo_indptr), token_request,
                    chunk, fixed_split)
