"""SGLang's step metadata as flashjit page tables, and its KV pool as flashjit caches (torch only).

SGLang keeps the KV-pool slot of every token of a request in `req_to_token[slot, position]`
(int32, [request slots, context length]). A step names its requests by `req_pool_indices` (their
slots) and their lengths by `seq_lens`: keys, the step's new tokens included, whose K/V land at
`out_cache_loc` before attention reads them. Its token pool (MHATokenToKVPool) keeps each layer's K
and V apart, token-major [slots, kv_heads, head_dim] (NHD), or page-major [pages, kv_heads,
page_size, head_dim] with SGLANG_USE_HND_KVCACHE (HND). With page size P a request's tokens fill
P-aligned pages of P consecutive slots, so page j of request r is req_to_token[r, j·P] // P; with
P = 1 every token is a page of its own.

Nothing here imports SGLang: the GPU tests drive these functions with tensors shaped as SGLang
builds them.
"""

from __future__ import annotations

import typing

import numpy as np
import torch

from ... import validation
from ...kernels.decode.spec import MAX_PAGE_SIZE

LAYOUTS = ("NHD", "HND")


class HostTable(typing.NamedTuple):
    """A step's page table on the host, as BatchDecode.plan() takes it: contiguous int32 CPU tensors
    (its fast path). qo_indptr is None when every request has one query token."""

    indptr: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor | None
    num_page_ids: int
    max_q_len: int

    @property
    def batch(self) -> int:
        return self.indptr.numel() - 1


def host_table(seq_lens, page_size: int, q_lens=None) -> HostTable:
    """The page table of requests with seq_lens keys each (a CPU tensor, array or list; SGLang's
    seq_lens_cpu) in pages of page_size; q_lens: query tokens per request (None: one each), the
    newest positions of each request."""
    check_page_size(page_size)
    kv = validation.host_int_array("seq_lens", seq_lens)
    if kv.size and kv.min() < 0:
        validation.fail("seq_lens", "non-negative key counts", kv.tolist())
    pages = -(-kv // page_size)
    indptr = np.zeros(kv.size + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    if indptr[-1] > validation.INT32_MAX:
        validation.fail("seq_lens", f"at most {validation.INT32_MAX} pages in all (int32 page ids)", int(indptr[-1]))
    last = np.where(pages > 0, kv - (pages - 1) * page_size, 0)
    qo_indptr, max_q = None, 1 if kv.size else 0
    if q_lens is not None:
        q = validation.host_int_array("q_lens", q_lens, length=kv.size)
        if q.size and (q.min() < 0 or (q > kv).any()):
            validation.fail("q_lens", "0..seq_lens[i] query tokens per request (its newest positions)",
                            f"q_lens {q.tolist()} for seq_lens {kv.tolist()}")
        qo = np.zeros(kv.size + 1, dtype=np.int64)
        np.cumsum(q, out=qo[1:])
        qo_indptr, max_q = _int32(qo), int(q.max(initial=0))
    return HostTable(_int32(indptr), _int32(last), qo_indptr, int(indptr[-1]), max_q)


def page_ids(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
             num_page_ids: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The page ids of a step's requests, request after request (int32, on req_to_token's device):
    page j of request i is req_to_token[req_pool_indices[i], j·page_size] // page_size.

    num_page_ids is host_table()'s count for the same seq_lens (the device's seq_lens are not read
    back: no synchronization). out: a buffer to write them into (its first num_page_ids entries are
    returned), e.g. a CUDA-graph decoder's page-id buffer; checked to hold them before anything is
    written."""
    check_page_size(page_size)
    validation.tensor("req_to_token", req_to_token, ndim=2)
    if req_to_token.dtype not in (torch.int32, torch.int64):
        validation.fail("req_to_token", "an int32 or int64 tensor", req_to_token.dtype)
    device = req_to_token.device
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        validation.tensor(name, t, device=device, ndim=1)
    if req_pool_indices.shape != seq_lens.shape:
        validation.fail("req_pool_indices", f"one slot per request ({seq_lens.shape[0]}, as seq_lens)",
                        tuple(req_pool_indices.shape))
    if out is not None:
        validation.tensor("out", out, dtype=torch.int32, device=device, ndim=1)
        if out.numel() < num_page_ids or (num_page_ids > 1 and out.stride(0) != 1):
            validation.fail("out", f"a contiguous int32 buffer of at least {num_page_ids} page ids",
                            f"{out.numel()} entries, stride {out.stride(0)}")
    if num_page_ids == 0:
        return (torch.empty(0, dtype=torch.int32, device=device) if out is None else out[:0])
    pages = torch.div(seq_lens.long() + page_size - 1, page_size, rounding_mode="floor")
    starts = pages.cumsum(0) - pages
    owner = torch.repeat_interleave(torch.arange(pages.numel(), device=device), pages, output_size=num_page_ids)
    position = (torch.arange(num_page_ids, device=device) - starts[owner]) * page_size
    slots = req_to_token[req_pool_indices.long()[owner], position]
    ids = slots if page_size == 1 else torch.div(slots, page_size, rounding_mode="floor")
    if out is None:
        return ids.to(torch.int32)
    target = out[:num_page_ids]
    target.copy_(ids)
    return target


def paged_kv(buffer: torch.Tensor, page_size: int, layout: str = "NHD") -> torch.Tensor:
    """One layer's K or V buffer of the pool as the paged cache BatchDecode.run() reads, in place:
    NHD [slots, kv_heads, head_dim] as [slots // page_size, page_size, kv_heads, head_dim]; HND
    [pages, kv_heads, page_size, head_dim] as it is."""
    layout = check_layout(layout)
    check_page_size(page_size)
    if layout == "HND":
        validation.tensor("kv buffer (HND)", buffer, ndim=4)
        if buffer.shape[2] != page_size:
            validation.fail("kv buffer (HND)", f"[pages, kv_heads, {page_size}, head_dim]", tuple(buffer.shape))
        return buffer
    validation.tensor("kv buffer (NHD)", buffer, ndim=3)
    if page_size == 1:
        return buffer.unsqueeze(1)
    whole = buffer.shape[0] // page_size * page_size  # a tail short of a page holds no page of any request
    if not buffer[:whole].is_contiguous():
        validation.fail("kv buffer (NHD)", "a contiguous [slots, kv_heads, head_dim] tensor",
                        f"strides {buffer.stride()}")
    return buffer[:whole].view(whole // page_size, page_size, *buffer.shape[1:])


def write_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
             page_size: int = 1, layout: str = "NHD", k_scale: float | None = None,
             v_scale: float | None = None) -> None:
    """The step's new K and V ([tokens, kv_heads, head_dim]) into one layer's buffers at slots loc
    (SGLang's out_cache_loc), as the pool's own set_kv_buffer stores them: an fp8 pool holds
    K / k_scale and V / v_scale. Capturable in a CUDA graph (no host synchronization)."""
    layout = check_layout(layout)
    for buffer, new, scale in ((k_buffer, k, k_scale), (v_buffer, v, v_scale)):
        if buffer.dtype != new.dtype:
            new = (new if scale is None else new.float() / scale).to(buffer.dtype)
        if buffer.dtype.itemsize == 1:  # index_put has no fp8 kernel: move the bytes
            buffer, new = buffer.view(torch.uint8), new.view(torch.uint8)
        if layout == "NHD":
            buffer[loc] = new
        else:
            loc64 = loc.long()
            buffer[torch.div(loc64, page_size, rounding_mode="floor"), :, loc64 % page_size] = new


def check_page_size(page_size) -> int:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or not 1 <= page_size <= MAX_PAGE_SIZE:
        validation.fail("page_size", f"an int in 1..{MAX_PAGE_SIZE}", repr(page_size))
    return page_size


def check_layout(layout) -> str:
    name = str(layout).upper()
    if name not in LAYOUTS:
        validation.fail("kv layout", " or ".join(LAYOUTS), repr(layout))
    return name


def _int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
