"""Shared-prefix detection: neighbouring requests whose page lists start with the same page ids.

Prefix caching (parallel sampling, beams, RL rollouts, system prompts) gives many requests the same
leading physical pages. Requests i..j (consecutive in the batch) whose page lists agree on their
first S pages, every one of them full in every member, form a group with the shared span
[0, S * page_size). Inside a group, a run of members agreeing on more pages forms a nested group
over the next pages (prompt -> beams -> children), up to MAX_LEVELS levels. Every page is compared,
so a page table that only looks shared (a later page equal, an earlier one not) shares nothing it
should not.

Pure numpy over the host copy of the page ids; a batch whose neighbours' first pages differ leaves
after one gather and one comparison.
"""

from __future__ import annotations

import typing

import numpy as np

MAX_LEVELS = 4  # nesting depth detected: prompt -> beams -> children -> their children


class SharedSpans(typing.NamedTuple):
    """The groups found, outermost level first, then by first member. Spans are in pages."""

    first: np.ndarray       # [G] first member (a request index); members are first .. first + count - 1
    count: np.ndarray       # [G] members (>= 2)
    begin_page: np.ndarray  # [G] first shared page (0 at level 0; the parent's end below it)
    end_page: np.ndarray    # [G] one past the last shared page
    level: np.ndarray       # [G] nesting depth, 0 outermost
    shared_pages: np.ndarray  # [B] pages of each request read by its groups (its own span starts there)

    @property
    def num_groups(self) -> int:
        return len(self.first)

    @classmethod
    def none(cls, batch: int) -> "SharedSpans":
        """No groups: every request alone."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, empty, empty, empty, np.zeros(batch, dtype=np.int64))


def neighbour_prefixes(indptr, page_ids, kv_lens, q_lens, page_size: int, *, causal: bool) -> np.ndarray | None:
    """[B-1] pages requests b and b+1 share from their first page on, None when no neighbours share
    a page. A shared page is full in both and every query of both sees it (causal: it ends at or
    before the request's first query position kv_len - q_len + 1); neighbours with different query
    counts share nothing (a shared work item's rows are members x the same query tokens).
    The reference of host_plan.c's fj_neighbour_prefixes."""
    indptr = np.asarray(indptr, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    q_lens = np.asarray(q_lens, dtype=np.int64)
    page_ids = np.asarray(page_ids)
    batch = len(indptr) - 1
    if batch < 2:
        return None
    visible = (kv_lens - q_lens + 1 if causal else kv_lens) // page_size
    visible = np.minimum(np.maximum(visible, 0), indptr[1:] - indptr[:-1])
    starts = indptr[:-1]
    limit = np.minimum(visible[:-1], visible[1:])
    limit[q_lens[:-1] != q_lens[1:]] = 0
    candidate = limit > 0
    if not candidate.any():
        return None
    first_ids = page_ids[np.minimum(starts, len(page_ids) - 1)]
    candidate &= first_ids[:-1] == first_ids[1:]
    pairs = np.flatnonzero(candidate)
    if len(pairs) == 0:
        return None  # the common case without sharing: one gather, one comparison
    lengths = limit[pairs]
    ends = np.cumsum(lengths)
    offsets = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - lengths, lengths)
    left = page_ids[np.repeat(starts[pairs], lengths) + offsets]
    right = page_ids[np.repeat(starts[pairs + 1], lengths) + offsets]
    # The first differing page of each pair (its length where none differs).
    differs = np.where(left != right, offsets, np.repeat(lengths, lengths))
    prefix = np.zeros(batch - 1, dtype=np.int64)
    prefix[pairs] = np.minimum.reduceat(differs, ends - lengths)
    return prefix


def _runs(values: np.ndarray):
    """(start, stop, smallest) of each maximal run of positive values: pairs start..stop-1."""
    positive = np.concatenate([[False], values > 0, [False]])
    edges = np.flatnonzero(positive[1:] != positive[:-1])
    starts, stops = edges[0::2], edges[1::2]
    bounds = np.empty(2 * len(starts), dtype=np.int64)
    bounds[0::2], bounds[1::2] = starts, stops
    padded = np.append(values, 0)  # reduceat's indices stay inside the array
    smallest = np.minimum.reduceat(padded, bounds)[0::2] if len(starts) else np.zeros(0, dtype=values.dtype)
    return starts, stops, smallest


def find_shared_spans(indptr, page_ids, kv_lens, q_lens, page_size: int, *, causal: bool,
                      max_levels: int = MAX_LEVELS) -> SharedSpans | None:
    """The shared spans of a batch (neighbour_prefixes' arguments), or None when nothing is shared."""
    prefix = neighbour_prefixes(indptr, page_ids, kv_lens, q_lens, page_size, causal=causal)
    return None if prefix is None else spans_from_prefixes(prefix, max_levels)


def spans_from_prefixes(prefix: np.ndarray, max_levels: int = MAX_LEVELS) -> SharedSpans | None:
    """The nested groups of neighbours' shared prefixes ([B-1] pages, neighbour_prefixes): a maximal
    run of sharing neighbours is a group over the pages all of them share; inside it, a run sharing
    more pages is a group over the next ones, and so on."""
    prefix = np.asarray(prefix, dtype=np.int64)
    done = np.zeros_like(prefix)  # pages already shared by each pair's enclosing groups
    firsts, counts, begins, ends, levels = [], [], [], [], []
    for level in range(max_levels):
        starts, stops, smallest = _runs(prefix - done)
        if len(starts) == 0:
            break
        base = done[starts]
        firsts.append(starts)
        counts.append(stops - starts + 1)
        begins.append(base)
        ends.append(base + smallest)
        levels.append(np.full(len(starts), level, dtype=np.int64))
        lengths = stops - starts
        inside = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        done[inside] += np.repeat(smallest, lengths)
    if not firsts:
        return None
    shared = np.zeros(len(prefix) + 1, dtype=np.int64)
    shared[:-1] = done
    shared[1:] = np.maximum(shared[1:], done)
    cat = np.concatenate
    return SharedSpans(cat(firsts), cat(counts), cat(begins), cat(ends), cat(levels), shared)
