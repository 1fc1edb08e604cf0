"""A framework's block table turned into flashjit's CSR page table.

Request r's keys live in blocks block_table[r, 0], block_table[r, 1], ...; its seq_len keys fill
ceil(seq_len / block_size) of them. flashjit's page table lists the same blocks (indptr into
indices, last_page_len), in the same order, so requests whose block tables start with the same
block ids (prefix caching: n > 1 samples, beams, shared system prompts) have page lists that start
with the same ids, which plan() finds and reads once (docs/shared_prefix.md).

host_page_table: the lengths on the host (one copy of the rows' page counts to the device, no wait).
device_page_table: the lengths on the device only (torch ops, no host synchronization), for a
CUDA-graph decoder's GPU planner.
"""

from __future__ import annotations

import typing

import numpy as np
import torch

from ... import validation


class HostPageTable(typing.NamedTuple):
    """plan()'s page table: indptr, last_page_len and qo_indptr as int32 CPU tensors, indices on the device."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor

    @property
    def num_pages(self) -> int:
        return int(self.indptr[-1])


def pages_of(seq_lens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(blocks each request reads, keys in its last block; 0 for a request without keys)."""
    pages = (seq_lens + block_size - 1) // block_size
    last = np.where(pages > 0, seq_lens - (pages - 1) * block_size, 0)
    return pages, last


def host_page_table(block_table: torch.Tensor, seq_lens_cpu, query_start_loc_cpu, num_rows: int,
                    block_size: int, out_indices: torch.Tensor | None = None) -> HostPageTable:
    """The page table of rows [0, num_rows) of a block table ([requests, max_blocks] int32 on the
    device), from their key counts and query offsets on the host.

    out_indices: a device int32 buffer to gather the page ids into (a CUDA-graph decoder's page-id
    buffer); default a new tensor."""
    seq = validation.host_int_array("seq_lens", seq_lens_cpu[:num_rows], num_rows)
    qo = validation.indptr_array("query_start_loc", query_start_loc_cpu[: num_rows + 1], length=num_rows + 1)
    if seq.size and seq.min() < 0:
        validation.fail("seq_lens", "non-negative key counts", int(seq.min()))
    pages, last = pages_of(seq, block_size)
    width = block_table.shape[1] if block_table.dim() == 2 else 0
    if pages.size and pages.max() > width:
        at = int(np.argmax(pages))
        validation.fail("block_table", f"at least {int(pages[at])} blocks in row {at} (seq_len {int(seq[at])}, "
                        f"block_size {block_size})", f"{width} columns")
    indptr = np.zeros(num_rows + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    total = int(indptr[-1])
    # The gather's positions are made on the device from the rows' page counts: the host sends
    # 2 x rows values, not one per page (a step of 256 requests over 32k keys lists 512k pages).
    device = block_table.device
    counts = torch.from_numpy(np.stack([pages, indptr[:-1]]).astype(np.int64)).to(device, non_blocking=True)
    rows = torch.repeat_interleave(torch.arange(num_rows, device=device), counts[0], output_size=total)
    cols = torch.arange(total, device=device) - counts[1][rows]
    ids = block_table[rows, cols].to(torch.int32)
    if out_indices is None:
        indices = ids
    else:
        if out_indices.numel() < total:
            validation.fail("out_indices", f"room for the step's {total} page ids", out_indices.numel())
        out_indices[:total].copy_(ids)
        indices = out_indices
    return HostPageTable(torch.from_numpy(indptr), indices, torch.from_numpy(last.astype(np.int32)),
                         torch.from_numpy(qo.astype(np.int32)))


class DevicePageTable(typing.NamedTuple):
    """The page table as device tensors: batch [1], indptr [rows + 1], last_page_len [rows],
    qo_indptr [rows + 1], and page ids [rows * max_blocks] (the listed ones first, then zeros)."""

    batch: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor
    page_ids: torch.Tensor


def device_page_table(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      num_rows: int, block_size: int, max_decode_q_len: int) -> DevicePageTable:
    """The page table of rows [0, num_rows) from device tensors alone: no value is read back.

    Rows with more than max_decode_q_len query tokens (prefill rows, which another kernel serves)
    get no query tokens and no pages here."""
    device = block_table.device
    qsl = query_start_loc[: num_rows + 1].to(torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    served = q_lens <= max_decode_q_len
    seq = torch.where(served, seq_lens[:num_rows].to(torch.long), 0)
    q_lens = torch.where(served, q_lens, 0)
    pages = (seq + block_size - 1) // block_size
    zero = torch.zeros(1, dtype=torch.long, device=device)
    indptr = torch.cat((zero, pages.cumsum(0)))
    qo_indptr = torch.cat((zero, q_lens.cumsum(0)))
    last = torch.where(pages > 0, seq - (pages - 1) * block_size, 0)
    width = block_table.shape[1]
    p = torch.arange(num_rows * width, device=device)
    holder = torch.searchsorted(indptr[1:], p, right=True).clamp(max=max(num_rows - 1, 0))
    col = (p - indptr[holder]).clamp(0, width - 1)
    listed = p < indptr[-1:]
    ids = torch.where(listed, block_table[holder, col].to(torch.long), 0) if num_rows else p
    batch = torch.full((1,), num_rows, dtype=torch.int32, device=device)
    as_int32 = dict(dtype=torch.int32)
    return DevicePageTable(batch, indptr.to(**as_int32), last.to(**as_int32), qo_indptr.to(**as_int32),
                           ids.to(**as_int32))


def shared_leading_blocks(indptr, page_ids) -> np.ndarray:
    """For each pair of neighbouring requests (b, b + 1), how many leading page ids their lists
    have in common (on the host): what plan()'s shared-prefix detection starts from."""
    indptr = np.asarray(indptr, dtype=np.int64)
    ids = np.asarray(page_ids.cpu() if hasattr(page_ids, "cpu") else page_ids)
    shared = np.zeros(max(len(indptr) - 2, 0), dtype=np.int64)
    for b in range(len(shared)):
        a, c = ids[indptr[b]:indptr[b + 1]], ids[indptr[b + 1]:indptr[b + 2]]
        n = min(len(a), len(c))
        differ = np.flatnonzero(a[:n] != c[:n])
        shared[b] = differ[0] if differ.size else n
    return shared
