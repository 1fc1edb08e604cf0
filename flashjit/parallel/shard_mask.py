"""A global mask seen from one shard: which local keys each query token sees, computed on the host.

The query tokens are each request's newest global positions (global_len - q_len + i), on every
rank. A causal or sliding-window mask bounds the global key position from above (the query's
position) and below (the window's start); since a layout maps local keys to global positions
monotonically, each bound is a count of local keys (layout.count_below), and the visible local keys
of a token form one range [begin, end). The shard's decode then runs the `key_range` mask over
those ranges, or no mask at all where every range is the whole shard (the common decode step: one
query token, causal). Masks that are not one range per token (tree, block-sparse, sinks, user
masks) are refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..validation import fail

GLOBAL_MASKS = ("none", "causal", "sliding_window")


@dataclasses.dataclass(frozen=True)
class ShardMask:
    """The local mask of one shard: mask "none", or "key_range" with begin/end per query token."""

    mask: str
    qo_indptr: np.ndarray  # int64 [batch + 1]
    begin: np.ndarray      # int64 [tokens]: the first visible local key of each token
    end: np.ndarray        # int64 [tokens]: one past the last


def check_global_mask(mask, window_left):
    if mask not in GLOBAL_MASKS:
        fail("mask", f"one of {', '.join(GLOBAL_MASKS)} (context-parallel decode turns these into local key "
             "ranges; other masks are not one range of keys per query token)", repr(mask))
    if mask == "sliding_window":
        if not isinstance(window_left, int) or isinstance(window_left, bool) or window_left < 0:
            fail("window_left", "an int >= 0 with mask='sliding_window'", repr(window_left))
    elif window_left is not None:
        fail("window_left", f"None with mask={mask!r} (it is the sliding window's size)", repr(window_left))


def shard_mask(layout, local_lens: np.ndarray, global_lens: np.ndarray, qo_indptr: np.ndarray, page_size: int,
               mask: str, window_left: int | None, *, always_ranges: bool = False) -> ShardMask:
    """The shard's local mask for a global mask (check_global_mask first). always_ranges: use key_range
    even where every range is the whole shard (a CUDA graph keeps the mask it was captured with)."""
    q_lens = np.diff(qo_indptr)
    request = np.repeat(np.arange(len(q_lens)), q_lens)
    q_idx = np.arange(int(qo_indptr[-1])) - qo_indptr[request]
    q_pos = global_lens[request] - q_lens[request] + q_idx  # global positions of the query tokens
    whole = local_lens[request]
    if mask == "none":
        begin, end = np.zeros_like(whole), whole
    else:
        end = layout.count_below(q_pos + 1, request, local_lens, page_size)
        begin = (layout.count_below(q_pos - window_left, request, local_lens, page_size) if mask == "sliding_window"
                 else np.zeros_like(whole))
        begin = np.minimum(begin, end)
    full = bool(np.all(begin == 0) and np.all(end == whole))
    local = "none" if full and not always_ranges else "key_range"
    return ShardMask(local, qo_indptr, begin, end)
