"""Where a rank's keys sit in the sequence: the two shard layouts of context-parallel decode.

Each rank holds part of every request's keys in its own paged cache, under its own page table
(local positions 0..local_len). A layout maps local positions to global ones, monotonically:

* Contiguous(offsets): the rank holds global positions [offsets[b], offsets[b] + local_len[b]) of
  request b (a block per rank, any lengths, empty allowed).
* Interleaved(rank, world, block_pages): global pages are dealt out in runs of block_pages pages,
  round-robin from rank 0: global page g belongs to rank (g // block_pages) % world. A rank's local
  pages are its global pages in order; only the rank holding a request's last page has a partial
  last page.

Masks only need counts: count_below(x) is how many of the rank's keys have a global position
below x (a closed form for both layouts), which turns a causal or window bound on global positions
into a bound on local ones (shard_plan.py). split_page_table cuts a global page table into each
rank's shard, for tests, the single-GPU sequential path and the example.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..validation import fail


@dataclasses.dataclass(frozen=True)
class Contiguous:
    """The rank's keys of request b are global positions offsets[b] .. offsets[b] + local_len - 1."""

    offsets: tuple[int, ...]

    def __post_init__(self):
        offsets = tuple(int(x) for x in np.asarray(self.offsets, dtype=np.int64).reshape(-1))
        if any(x < 0 for x in offsets):
            fail("Contiguous.offsets", "global positions >= 0", list(offsets)[:8])
        object.__setattr__(self, "offsets", offsets)

    def check(self, local_lens: np.ndarray, global_lens: np.ndarray, page_size: int):
        offsets = np.asarray(self.offsets, dtype=np.int64)
        if len(offsets) != len(global_lens):
            fail("Contiguous.offsets", f"one offset per request ({len(global_lens)})", len(offsets))
        bad = np.flatnonzero(offsets + local_lens > global_lens)
        if len(bad):
            b = int(bad[0])
            fail("shard", f"keys inside each request's global length (request {b}: offset {offsets[b]} + "
                 f"{local_lens[b]} local keys <= {global_lens[b]})", "more")

    def count_below(self, x: np.ndarray, request: np.ndarray, local_lens: np.ndarray, page_size: int) -> np.ndarray:
        """The local keys of request[i] with a global position below x[i]."""
        offsets = np.asarray(self.offsets, dtype=np.int64)
        return np.clip(x - offsets[request], 0, local_lens[request])


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """Runs of block_pages global pages dealt round-robin over world ranks; this rank is `rank`."""

    rank: int
    world: int
    block_pages: int = 1

    def __post_init__(self):
        for name, low in (("world", 1), ("block_pages", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                fail(f"Interleaved.{name}", f"an int >= {low}", repr(value))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 0 <= self.rank < self.world:
            fail("Interleaved.rank", f"an int in 0..{self.world - 1}", repr(self.rank))

    def run_tokens(self, page_size: int) -> int:
        return self.block_pages * page_size

    def local_len(self, global_lens: np.ndarray, page_size: int) -> np.ndarray:
        return self._count(np.asarray(global_lens, dtype=np.int64), page_size)

    def _count(self, x, page_size: int):
        run = self.run_tokens(page_size)
        cycle = run * self.world
        return (x // cycle) * run + np.clip(x % cycle - self.rank * run, 0, run)

    def check(self, local_lens: np.ndarray, global_lens: np.ndarray, page_size: int):
        expected = self.local_len(global_lens, page_size)
        bad = np.flatnonzero(expected != local_lens)
        if len(bad):
            b = int(bad[0])
            fail("shard", f"the keys an interleaved layout gives rank {self.rank} of {self.world} (request {b}: "
                 f"{expected[b]} of {global_lens[b]} in runs of {self.block_pages} pages of {page_size})",
                 f"{local_lens[b]} local keys")

    def count_below(self, x: np.ndarray, request: np.ndarray, local_lens: np.ndarray, page_size: int) -> np.ndarray:
        """The local keys of request[i] with a global position below x[i] (x at most its global length)."""
        return np.minimum(self._count(np.maximum(np.asarray(x, dtype=np.int64), 0), page_size), local_lens[request])


def shard_local_lens(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    pages = np.diff(indptr)
    return np.where(pages > 0, (pages - 1) * page_size + last_page_len, 0)


def split_page_table(indptr, indices, last_page_len, page_size: int, world: int, *, layout: str = "contiguous",
                     block_pages: int = 1, cuts=None) -> list[dict]:
    """Each rank's shard of a global page table: a list of world dicts with indptr, indices,
    last_page_len (host int32 arrays; indices are the global table's page ids, so every shard
    reads the same cache) and layout (Contiguous or Interleaved).

    layout "contiguous": request b's pages are cut at cuts[b] (world + 1 page offsets from 0 to its
    page count; default: as even as pages allow), so shards may be unequal or empty.
    layout "interleaved": runs of block_pages pages round-robin.
    """
    indptr = np.asarray(indptr, dtype=np.int64).reshape(-1)
    indices = np.asarray(indices).reshape(-1)
    last = np.asarray(last_page_len, dtype=np.int64).reshape(-1)
    batch = len(indptr) - 1
    global_lens = shard_local_lens(indptr, last, page_size)
    per_rank = [([0], [], [], []) for _ in range(world)]  # indptr, ids, last page lens, offsets
    for b in range(batch):
        pages = np.arange(indptr[b], indptr[b + 1])
        n = len(pages)
        if layout == "contiguous":
            bounds = np.asarray(cuts[b] if cuts is not None else [(r * n) // world for r in range(world + 1)])
            if len(bounds) != world + 1 or bounds[0] != 0 or bounds[-1] != n or np.any(np.diff(bounds) < 0):
                fail(f"cuts[{b}]", f"{world + 1} increasing page offsets from 0 to {n}", bounds.tolist())
            owned = [pages[bounds[r]:bounds[r + 1]] for r in range(world)]
            starts = [int(bounds[r]) * page_size for r in range(world)]
        elif layout == "interleaved":
            run = (np.arange(n) // block_pages) % world
            owned = [pages[run == r] for r in range(world)]
            starts = [0] * world
        else:
            fail("layout", "'contiguous' or 'interleaved'", repr(layout))
        for r, mine in enumerate(owned):
            ptr, ids, lasts, offsets = per_rank[r]
            ids.extend(indices[mine].tolist())
            ptr.append(len(ids))
            holds_last = len(mine) > 0 and mine[-1] == indptr[b + 1] - 1
            lasts.append(int(last[b]) if holds_last else (page_size if len(mine) else 0))
            offsets.append(min(starts[r], int(global_lens[b])))
    shards = []
    for r, (ptr, ids, lasts, offsets) in enumerate(per_rank):
        shape = Contiguous(tuple(offsets)) if layout == "contiguous" else Interleaved(r, world, block_pages)
        shards.append({"indptr": np.asarray(ptr, dtype=np.int32), "indices": np.asarray(ids, dtype=np.int32),
                       "last_page_len": np.asarray(lasts, dtype=np.int32), "layout": shape})
    return shards
