"""Plain torch decode attention: the float32 oracle every kernel is checked against.

Same conventions as BatchDecode. Per request it gathers the pages, builds the visibility matrix
from the mask's torch predicate and computes softmax attention in float32, with the variant's torch
hooks: its logits transform the scaled scores of visible keys, and its sink logit joins each
row's denominator (and the lse), never the output. Fully masked rows give output 0 and lse -inf
(lse = the sink with a sink). Slow and simple on purpose.
"""

from __future__ import annotations

import math

import torch

from ..masks.registry import masks
from ..masks.variants import variants


def gather_request_kv(cache: torch.Tensor, page_ids: torch.Tensor, kv_len: int, kv_layout: str = "NHD") -> torch.Tensor:
    """[kv_len, kv_heads, head_dim] keys (or values) of one request from a paged cache."""
    pages = cache[page_ids.long()]
    if kv_layout.upper() == "HND":
        pages = pages.transpose(1, 2)
    return pages.reshape(-1, pages.shape[-2], pages.shape[-1])[:kv_len]


def decode_reference(q, k_cache, v_cache, indptr, indices, last_page_len, *, qo_indptr=None, mask: str = "none",
                     mask_params: dict | None = None, sm_scale: float | None = None, kv_layout: str = "NHD",
                     variant: str = "none", variant_params: dict | None = None):
    """Returns (out [tokens, qo_heads, head_dim] float32, lse [tokens, qo_heads] natural log)."""
    mask_def, variant_def = masks.get(mask), variants.get(variant)
    vparams = dict(variant_params or {})
    heads = torch.arange(q.shape[1], device=q.device)
    sink = None if variant_def.sink is None else variant_def.sink(heads, vparams).float()  # [qo_heads]
    params = dict(mask_params or {})
    tokens, num_qo_heads, head_dim = q.shape
    page_size = k_cache.shape[1] if kv_layout.upper() == "NHD" else k_cache.shape[2]
    indptr = [int(x) for x in indptr]
    last_page_len = [int(x) for x in last_page_len]
    batch = len(indptr) - 1
    qo_indptr = list(range(batch + 1)) if qo_indptr is None else [int(x) for x in qo_indptr]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = torch.zeros(tokens, num_qo_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((tokens, num_qo_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n_pages = indptr[b + 1] - indptr[b]
        kv_len = (n_pages - 1) * page_size + last_page_len[b] if n_pages else 0
        q0, q1 = qo_indptr[b], qo_indptr[b + 1]
        if q1 > q0 and sink is not None:  # a row without keys still has the sink: lse = sink, out = 0
            lse[q0:q1] = sink[None, :]
        if kv_len == 0 or q1 == q0:
            continue
        page_ids = indices[indptr[b]:indptr[b + 1]]
        k = gather_request_kv(k_cache, page_ids, kv_len, kv_layout).float()
        v = gather_request_kv(v_cache, page_ids, kv_len, kv_layout).float()
        group = num_qo_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].float()
        scores = torch.einsum("thd,khd->htk", qb, k) * scale
        n = q1 - q0
        q_pos = torch.arange(kv_len - n, kv_len, device=q.device)[:, None]
        kv_pos = torch.arange(kv_len, device=q.device)[None, :]
        if variant_def.logits is not None:
            scores = variant_def.logits(scores, q_pos, kv_pos, heads[:, None, None], vparams)
        if mask_def.reference is not None:
            visible = mask_def.reference(q_pos, kv_pos, b, params).expand(n, kv_len)
            scores = scores.masked_fill(~visible[None], float("-inf"))
        if sink is not None:  # one more column in the denominator, with no value
            scores = torch.cat([scores, sink[:, None, None].expand(-1, n, 1)], dim=-1)
        row_lse = torch.logsumexp(scores, dim=-1)  # [h, t]
        probs = torch.exp(scores - row_lse[..., None].clamp_min(torch.finfo(torch.float32).min))
        probs = torch.nan_to_num(probs, nan=0.0)[..., :kv_len]
        out[q0:q1] = torch.einsum("htk,khd->thd", probs, v)
        lse[q0:q1] = row_lse.transpose(0, 1)
    return out, lse
