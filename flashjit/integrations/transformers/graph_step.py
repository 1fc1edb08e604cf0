"""CUDA-graph steps: the page table of a continuous-batching step computed on the GPU, from the
tensors transformers refills in place before each replay, and a BatchDecode that plans from it.

A replay runs no Python, so nothing may be read back to the host: the step's lengths are known
only on the device. transformers captures its varlen path once per padded size (query rows, read
index length) and replays it for any composition of that size, prefill chunks included. Every
request is therefore cut into pieces of at most `piece` query tokens, each a request of its own
for the decode kernel: piece j of a request with n query tokens over kv keys holds query tokens
[j·piece, min(n, (j+1)·piece)) and sees the first kv − n + (its last token + 1) keys, so the
causal mask's "query i of m at kv_len − m + i" puts every token at its true position. The pieces
read prefixes of the request's pages; each piece lists them again (CSR rows cannot overlap).

The sizes are fixed per (query rows, requests): at most min(rows, (rows + requests·(piece − 1)) //
piece) pieces, each over at most the cache's blocks.
"""

from __future__ import annotations

import torch

from ...worklist.record import PLAN_MAX_BATCH


def max_pieces(rows: int, requests: int, piece: int) -> int:
    """Most pieces a step of `rows` query tokens over `requests` requests can have."""
    return max(1, min(rows, (rows + requests * (piece - 1)) // piece))


def device_step_tables(cu_q: torch.Tensor, cu_k: torch.Tensor, key_index: torch.Tensor, page_size: int,
                       piece: int, num_pieces: int, num_page_ids: int):
    """(batch [1], indptr [num_pieces + 1], last_page_len [num_pieces], qo_indptr [num_pieces + 1],
    page_ids [num_page_ids]) as int32 tensors on cu_q's device, made by fixed-shape torch ops only
    (capturable). Unused pieces have no pages and no query tokens; unused page ids are 0.

    cu_q, cu_k: the step's cumulative query and key lengths ([requests + 1]; padding requests
    repeat the last value). key_index: the cache slot of every key position, request after request
    (page j of request r is the block of key_index[cu_k[r] + j·page_size])."""
    cu_q, cu_k = cu_q.reshape(-1).long(), cu_k.reshape(-1).long()
    device = cu_q.device
    q_lens, kv_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    requests = q_lens.numel()
    pieces = torch.div(q_lens + piece - 1, piece, rounding_mode="floor")
    piece_ends = pieces.cumsum(0)
    total = piece_ends[-1:]
    v = torch.arange(num_pieces, device=device)
    owner = torch.searchsorted(piece_ends, v, right=True).clamp(max=requests - 1)
    j = v - (piece_ends[owner] - pieces[owner])
    used = v < total
    start = j * piece
    q_piece = torch.where(used, (q_lens[owner] - start).clamp(0, piece), 0)
    kv_piece = torch.where(used, kv_lens[owner] - q_lens[owner] + start + q_piece, 0)
    pages = torch.div(kv_piece + page_size - 1, page_size, rounding_mode="floor")
    zero = torch.zeros(1, dtype=torch.long, device=device)
    indptr = torch.cat((zero, pages.cumsum(0)))
    qo_indptr = torch.cat((zero, q_piece.cumsum(0)))
    last_page_len = torch.where(pages > 0, kv_piece - (pages - 1) * page_size, 0)

    p = torch.arange(num_page_ids, device=device)
    holder = torch.searchsorted(indptr[1:], p, right=True).clamp(max=num_pieces - 1)
    position = cu_k[owner[holder]] + (p - indptr[holder]) * page_size
    listed = p < indptr[-1:]
    if key_index.numel():
        slots = key_index.index_select(0, torch.where(listed, position, 0).clamp(max=key_index.numel() - 1))
        page_ids = torch.where(listed, torch.div(slots, page_size, rounding_mode="floor"), 0)
    else:
        page_ids = torch.zeros_like(p)
    as_int = dict(dtype=torch.int32)
    return (total.to(**as_int), indptr.to(**as_int), last_page_len.to(**as_int), qo_indptr.to(**as_int),
            page_ids.to(**as_int))


class GraphDecoder:
    """A CUDA-graph BatchDecode for one padded step size, planned on the GPU every step.

    Made (and planned once on the host, compiling its kernel) outside any capture: transformers
    runs each new size eagerly before it captures it. prepare() writes the step's tables into the
    decoder's page-table and page-id buffers and queues its GPU planner; run() is BatchDecode's."""

    def __init__(self, backend_factory, device, *, rows: int, requests: int, piece: int, cache_blocks: int,
                 page_size: int, plan_form: dict):
        self.piece = piece
        self.page_size = page_size
        self.num_pieces = max_pieces(rows, requests, piece)
        if self.num_pieces > PLAN_MAX_BATCH:
            raise ValueError(f"a CUDA-graph step of {rows} query rows over {requests} requests: at most "
                             f"{PLAN_MAX_BATCH} pieces of {piece} tokens plan on the GPU, this one needs "
                             f"{self.num_pieces}; lower max_batch_tokens")
        self.num_page_ids = self.num_pieces * cache_blocks
        self.decoder = backend_factory(device, use_cuda_graph=True, max_batch_size=self.num_pieces,
                                       max_num_pages=self.num_page_ids, max_tokens=rows, max_q_len=piece)
        int32 = dict(dtype=torch.int32)
        # One request of one key on page 0: a valid first plan that fixes the kernel and the buffers.
        self.decoder.plan(torch.tensor([0, 1], **int32), self.decoder.graph_page_ids, torch.tensor([1], **int32),
                          page_size=page_size, qo_indptr=torch.tensor([0, 1], **int32), check_page_ids=False,
                          **plan_form)
        if self.decoder.graph_page_table is None:
            raise RuntimeError("the CUDA-graph decoder plans on the host for this configuration; transformers' "
                               "graphs need its GPU planner (masks none/causal/sliding_window, and "
                               f"{self.num_pieces} pieces within what this GPU's shared memory per block holds: "
                               "lower max_batch_tokens)")

    def prepare(self, cu_q, cu_k, key_index):
        batch, indptr, last_page_len, qo_indptr, page_ids = device_step_tables(
            cu_q, cu_k, key_index, self.page_size, self.piece, self.num_pieces, self.num_page_ids)
        table = self.decoder.graph_page_table
        table.batch.copy_(batch)
        table.indptr[:indptr.numel()].copy_(indptr)
        table.last_page_len[:last_page_len.numel()].copy_(last_page_len)
        table.qo_indptr[:qo_indptr.numel()].copy_(qo_indptr)
        self.decoder.graph_page_ids.copy_(page_ids)
        self.decoder.replan()

    def run(self, q, pages, out):
        return self.decoder.run(q, pages, out=out)
