"""Attention over gathered keys for the requests the decode kernel does not take (long prefill
chunks): torch SDPA per request, on the keys its index lists, with the lower-right causal mask
(query i of n over kv keys sits at position kv - n + i) and, for sliding layers, the window; a soft
cap or sinks take the plain float32 softmax instead of SDPA."""

from __future__ import annotations

import torch


def gather_keys(cache: torch.Tensor, key_index: torch.Tensor, new: torch.Tensor, kv_begin: int, kv_len: int,
                q_begin: int, q_len: int) -> torch.Tensor:
    """[kv_len, kv_heads, head_dim]: the request's cached keys (or values), read before this step
    writes, followed by its new ones. The new tokens are the last q_len of its kv_len keys."""
    past = kv_len - q_len
    new_part = new[q_begin:q_begin + q_len]
    if past == 0:
        return new_part
    cached = cache.index_select(0, key_index[kv_begin:kv_begin + past])
    return torch.cat((cached, new_part), dim=0)


def visible(q_len: int, kv_len: int, window: int | None, device) -> torch.Tensor:
    """[q_len, kv_len] bool: key k is visible to query i when k <= kv_len - q_len + i and, with a
    window of w keys (transformers' sliding_window), when the query is fewer than w positions past it."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= q_pos - k_pos < window
    return seen


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, qo_heads, D], k/v [kv, kv_heads, D] -> [n, qo_heads, D] in q's dtype. softcap: the
    scaled scores become softcap * tanh(score / softcap); sinks: one logit per query head joins each
    row's softmax denominator (and takes no value)."""
    group = q.shape[1] // k.shape[1]
    k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [qo_heads, kv, D]
    v = v.transpose(0, 1).repeat_interleave(group, dim=0)
    mask = visible(q.shape[0], k.shape[1], window, q.device)
    if softcap is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        return out.transpose(0, 1)
    scores = torch.einsum("nhd,hkd->hnk", q.float(), k.float()) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float()[:, None, None].expand(-1, q.shape[0], 1)), dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., :k.shape[1]]
    return torch.einsum("hnk,hkd->nhd", weights, v.float()).to(q.dtype)
