"""The `tree` mask: speculative-decoding tree verification (Medusa, EAGLE).

A request verifies its n draft tokens in one decode step: they are its last n positions
(q_len = n). Draft token i sees the whole cached prefix (kv_pos < kv_len - n), itself and its
ancestors in the draft tree, and no other draft token. The tree travels as one int32 word per
query token: bit j of ``tree_mask[tree_qo_indptr[r] + i]`` says draft token i of request r sees
draft token j, so n <= 32 (and n <= DecodeSpec's max_q_len). The visible hook does not receive a
request's first query row, hence the ``tree_qo_indptr`` parameter: the plan's qo_indptr, on the GPU.

Every key can be visible, so the planner walks [0, kv_len); kv_span only validates the parameters.
"""

from __future__ import annotations

import numpy as np

from .. import validation

MASK = "tree"
PARAMS = {"tree_mask": "int_tensor", "tree_qo_indptr": "int_tensor"}
MAX_TREE_TOKENS = 32  # bits in one int32 word


def tree_words(parents) -> list[int]:
    """One request's visibility words (unsigned) from its parent array.

    parents[i] is the draft token draft token i extends (parents[i] < i), or -1 when it extends
    the cached prefix directly. Word i has bit i and the bits of all of i's ancestors set.
    """
    parents = [int(p) for p in parents]
    if len(parents) > MAX_TREE_TOKENS:
        validation.fail("parents", f"at most {MAX_TREE_TOKENS} draft tokens per request", len(parents))
    words: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            validation.fail(f"parents[{i}]", f"-1 (a child of the prefix) or an earlier draft token 0..{i - 1}", parent)
        words.append((1 << i) | (words[parent] if parent >= 0 else 0))
    return words


def pack_tree_mask(parents_per_request, device="cuda") -> dict:
    """The `tree` mask's parameters from each request's parent array (see tree_words).

    Returns {"tree_mask": int32 [total draft tokens], "tree_qo_indptr": int32 [batch + 1]} on
    `device`; pass the dict as plan's mask_params and tree_qo_indptr as its qo_indptr:

    >>> params = pack_tree_mask([[-1, 0, 0, 1], [-1, -1]])
    >>> decoder.plan(..., qo_indptr=params["tree_qo_indptr"], mask="tree", mask_params=params)
    """
    import torch

    validation.require_cuda(torch, torch.device(device), f"pack_tree_mask(device={device!r})",
                            "pass device='cpu' to build the parameters on the CPU")
    words, indptr = [], [0]
    for parents in parents_per_request:
        words += tree_words(parents)
        indptr.append(len(words))
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # bit 31 is the int32 sign bit
    return {"tree_mask": torch.tensor(signed or [0], dtype=torch.int32, device=device),
            "tree_qo_indptr": torch.tensor(indptr, dtype=torch.int32, device=device)}


def kv_span(kv_lens, q_lens, params):
    """[0, kv_len): every key may be visible. Checks the parameters against the plan (one copy to the host)."""
    if int(q_lens.max(initial=0)) > MAX_TREE_TOKENS:
        validation.fail("q_len", f"at most {MAX_TREE_TOKENS} query tokens per request for mask 'tree'",
                    int(q_lens.max()))
    indptr = validation.host_int_array("mask param tree_qo_indptr", params["tree_qo_indptr"])
    expected = np.concatenate([[0], np.cumsum(q_lens)])
    if len(indptr) != len(expected) or np.any(indptr != expected):
        bad = next((i for i, (a, b) in enumerate(zip(indptr, expected)) if a != b), min(len(indptr), len(expected)))
        validation.fail("mask param tree_qo_indptr", f"the plan's qo_indptr ({len(expected)} entries, "
                    f"entry {bad} = {expected[bad] if bad < len(expected) else 'none'})",
                    f"{len(indptr)} entries, entry {bad} = {indptr[bad] if bad < len(indptr) else 'none'}")
    if len(params["tree_mask"]) < expected[-1]:
        validation.fail("mask param tree_mask", f"at least one word per query token ({expected[-1]})",
                    len(params["tree_mask"]))
    return np.zeros_like(kv_lens), kv_lens


def reference(q_pos, kv_pos, request, params):
    """Torch predicate: the cached prefix, plus the draft tokens whose bits are set."""
    import torch

    n = q_pos.shape[0]
    prefix = q_pos.reshape(-1)[:1]  # kv_len - n
    start = int(params["tree_qo_indptr"][request])
    words = params["tree_mask"][start:start + n].to(device=kv_pos.device, dtype=torch.int64) & 0xFFFFFFFF
    j = kv_pos - prefix  # draft token index of each key (negative inside the prefix)
    bits = (words[:, None] >> j.clamp(0, MAX_TREE_TOKENS - 1)) & 1
    return (kv_pos < prefix) | ((j >= 0) & (j < MAX_TREE_TOKENS) & (bits == 1))


def sample_params(rng, kv_lens, q_lens, page_size, device):
    """A random tree per request: each draft token extends the prefix or an earlier draft token."""
    return pack_tree_mask([[rng.randint(-1, i - 1) for i in range(n)] for n in q_lens], device=device)
