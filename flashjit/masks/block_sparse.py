"""The `block_sparse` mask: its span, the checks of its parameters against the batch, its reference.

Request r lists logical block ids ``block_indices[block_indptr[r] .. block_indptr[r+1])`` (CSR);
block b holds the keys ``[b * block_size, (b + 1) * block_size)``. The planner walks the listed
blocks one after another, and the kernel maps span position v to a key through
``block_indices[block_indptr[r] + v / block_size]`` (block_sparse.cuh.j2). So the kernel reads
block_indptr at every request of the batch and block_indices up to block_indptr[batch]: kv_span
refuses tensors shorter than that (a read past their end), ids outside the request's
ceil(kv_len / block_size) blocks, and ids not in increasing order. Increasing ids make the walked
keys increasing, which the loader's runs of consecutive keys rely on (masks/base.cuh.j2), and
list each key once, as the reference predicate counts it.
"""

from __future__ import annotations

import numpy as np

from .. import validation

MASK = "block_sparse"
PARAMS = {"block_size": "int", "block_indptr": "int_tensor", "block_indices": "int_tensor"}
INDPTR, INDICES = "mask param block_indptr", "mask param block_indices"


def kv_span(kv_lens, q_lens, params):
    """[0, listed blocks x block_size) per request, once the parameters fit the batch (one copy of
    each tensor to the host)."""
    block_size, batch = params["block_size"], len(kv_lens)
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 1:
        validation.fail("mask param block_size", "a positive int", repr(block_size))
    indptr = validation.indptr_array(INDPTR, params["block_indptr"])
    if len(indptr) != batch + 1:
        validation.fail(INDPTR, f"batch_size + 1 = {batch + 1} entries", len(indptr))
    counts, total = indptr[1:] - indptr[:-1], int(indptr[-1])
    ids = validation.host_int_array(INDICES, params["block_indices"])
    if len(ids) < total:
        validation.fail(INDICES, f"at least block_indptr[-1]={total} block ids", len(ids))
    ids = ids[:total]
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    blocks = -(-kv_lens // int(block_size))
    outside = (ids < 0) | (ids >= np.repeat(blocks, counts))
    if outside.any():
        at = int(np.argmax(outside))
        r = _request_of(indptr, at)
        validation.fail(INDICES, "each request's block ids in 0..ceil(kv_len / block_size) - 1",
                        f"block_indices[{at}]={ids[at]} of request {r} (kv_len {kv_lens[r]}: {blocks[r]} blocks "
                        f"of {block_size})")
    not_rising = ids[1:] <= ids[:-1]
    not_rising[indptr[1:-1][(indptr[1:-1] > 0) & (indptr[1:-1] < total)] - 1] = False  # a new request starts
    if not_rising.any():
        at = int(np.argmax(not_rising)) + 1
        validation.fail(INDICES, "each request's block ids in increasing order (each once)",
                        f"block_indices[{at}]={ids[at]} after {ids[at - 1]} in request {_request_of(indptr, at)}")
    return np.zeros_like(kv_lens), counts * int(block_size)


def _request_of(indptr: np.ndarray, position: int) -> int:
    """The request whose ids hold block_indices[position]."""
    return int(np.searchsorted(indptr, position, side="right")) - 1


def reference(q_pos, kv_pos, request, params):
    import torch

    indptr, indices = params["block_indptr"], params["block_indices"]
    blocks = indices[int(indptr[request]):int(indptr[request + 1])].to(kv_pos.device).long()
    listed = torch.isin(torch.div(kv_pos, int(params["block_size"]), rounding_mode="floor"), blocks)
    return listed & (kv_pos <= q_pos)


def sample_params(rng, kv_lens, q_lens, page_size, device):
    """About half of each request's blocks, always its last (which holds the query tokens)."""
    import torch

    block_size = page_size * (2 if page_size < 64 else 1)
    indptr, ids = [0], []
    for n in kv_lens:
        blocks = list(range(-(-n // block_size)))
        chosen = sorted(rng.sample(blocks, k=len(blocks) // 2)) if blocks else []
        if blocks and blocks[-1] not in chosen:
            chosen.append(blocks[-1])
        ids += chosen
        indptr.append(len(ids))
    return {"block_size": block_size,
            "block_indptr": torch.tensor(indptr, dtype=torch.int32, device=device),
            "block_indices": torch.tensor(ids or [0], dtype=torch.int32, device=device)}
