"""One continuous-batching step as flashjit's page table: which requests the decode kernel serves,
their CSR page table, and which requests take the gathered fallback.

transformers packs a step's requests one after another: request r owns query rows
[cu_q[r], cu_q[r+1]) and key positions [cu_k[r], cu_k[r+1]) of a per-group index into the layer's
cache, a flat [slots, kv_heads, head_dim] tensor. For full-attention groups that index lists the
request's whole sequence in order, one block after another, so page j of request r is the block
holding position cu_k[r] + j * block_size. Sliding-window groups keep each request in a ring of
blocks read token by token; they are served with pages of one slot, so every key is its own page.

Pure host code over lists of ints: the CPU tests build steps by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTables:
    """The decode kernel's share of a step (host tensors) and the fallback's.

    served: requests the kernel serves, in step order; fallback: requests with more query tokens
    than the kernel takes (or, in a ring, whose new tokens overwrite keys they still read).
    indptr / last_page_len / qo_indptr: int32 CPU tensors over `served`, as BatchDecode.plan takes
    them. page_slots: int64 CPU tensor, for each page of `indptr` the entry of the step's key index
    whose slot lies in that page. token_rows: the query rows of the served requests, or None when
    they are rows 0..num_tokens-1 in order (the common decode step: no gather, no scatter).
    covers_all_rows: the served rows are every row of the step's query tensor.
    """

    served: tuple[int, ...]
    fallback: tuple[int, ...]
    indptr: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor
    page_slots: torch.Tensor
    token_rows: torch.Tensor | None
    num_tokens: int
    covers_all_rows: bool

    @property
    def max_q_len(self) -> int:
        q = self.qo_indptr
        return int((q[1:] - q[:-1]).max()) if len(q) > 1 else 0


def lengths(cumulative: list[int], name: str) -> list[int]:
    """Per-request lengths of a cumulative list; a decreasing one is a ValueError naming it."""
    out = [b - a for a, b in zip(cumulative, cumulative[1:])]
    if any(n < 0 for n in out):
        raise ValueError(f"{name}: expected non-decreasing cumulative lengths, got {cumulative}")
    return out


def step_tables(cu_q: list[int], cu_k: list[int], page_size: int, max_q_len: int, query_rows: int,
                ring_window: int | None = None) -> StepTables:
    """The page table of one step for one layer group.

    cu_q, cu_k: the step's cumulative query and key lengths (padding requests, with no query
    tokens, are skipped). page_size: the cache block size (1 for a ring). max_q_len: most query
    tokens per request the kernel serves. query_rows: rows of the step's query tensor (padded
    steps have more than cu_q[-1]). ring_window: the sliding window of a ring group (None: full
    attention). A ring request is served when its new tokens cannot overwrite a key it reads: one
    query token, or no more keys than the window (the ring has not wrapped).
    """
    if len(cu_q) != len(cu_k) or not cu_q:
        raise ValueError(f"cu_seq_lens_q / cu_seq_lens_k: expected the same number of entries (B+1 >= 1), "
                         f"got {len(cu_q)} and {len(cu_k)}")
    q_lens, kv_lens = lengths(cu_q, "cu_seq_lens_q"), lengths(cu_k, "cu_seq_lens_k")
    served, fallback = [], []
    for r, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        if n == 0:
            continue  # a padding request: no queries, nothing to attend
        if kv < n:
            raise ValueError(f"request {r}: expected at least as many keys as query tokens (its newest "
                             f"positions), got {kv} keys for {n} query tokens")
        fits = n <= max_q_len
        if ring_window is not None:
            fits = fits and (n == 1 or kv <= ring_window)
        (served if fits else fallback).append(r)

    indptr, last_page_len, qo_indptr, slots, rows = [0], [], [0], [], []
    for r in served:
        kv = kv_lens[r]
        pages = -(-kv // page_size)
        indptr.append(indptr[-1] + pages)
        last_page_len.append(kv - (pages - 1) * page_size)
        qo_indptr.append(qo_indptr[-1] + q_lens[r])
        slots.extend(range(cu_k[r], cu_k[r] + pages * page_size, page_size))
        rows.extend(range(cu_q[r], cu_q[r + 1]))
    num_tokens = len(rows)
    in_order = rows == list(range(num_tokens))
    int32 = dict(dtype=torch.int32)
    return StepTables(
        served=tuple(served), fallback=tuple(fallback), indptr=torch.tensor(indptr, **int32),
        last_page_len=torch.tensor(last_page_len, **int32), qo_indptr=torch.tensor(qo_indptr, **int32),
        page_slots=torch.tensor(slots, dtype=torch.int64),
        token_rows=None if in_order else torch.tensor(rows, dtype=torch.int64), num_tokens=num_tokens,
        covers_all_rows=in_order and num_tokens == query_rows)


def page_ids(key_index: torch.Tensor, tables: StepTables, page_size: int) -> torch.Tensor:
    """int32 page ids (on the key index's device) of the served requests' pages: the block of the
    slot each page's first position reads."""
    slots = tables.page_slots.to(key_index.device, non_blocking=True)
    return torch.div(key_index.index_select(0, slots), page_size, rounding_mode="floor").to(torch.int32)
