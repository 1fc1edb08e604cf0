"""Plain torch MLA decode: the float32 oracle the MLA kernel is checked against.

Per request and head, scores over the 576-wide latent key, softmax, and the 512-wide output:

    s[t, h, k] = (q_nope[t, h] . c_kv[k] + q_pe[t, h] . k_pe[k]) * sm_scale
    out[t, h]  = sum_k softmax_k(s[t, h, :]) c_kv[k]

Query token i of a request with q_len tokens sees positions k <= kv_len - q_len + i (causal).
Rows that see no key give out 0 and lse -inf. Same page-table conventions as BatchDecodeMLA.
Slow and simple on purpose.
"""

from __future__ import annotations

import torch

LATENT_DIM = 512


def split_latent_cache(ckv_cache, kpe_cache=None):
    """(c_kv [pages, page_size, 512], k_pe [pages, page_size, rope]) from two caches or one 576-wide one."""
    if kpe_cache is None:
        return ckv_cache[..., :LATENT_DIM], ckv_cache[..., LATENT_DIM:]
    return ckv_cache, kpe_cache


def gather_latents(cache, page_ids, kv_len: int):
    """[kv_len, width] latent rows of one request from a paged [pages, page_size, width] cache."""
    pages = cache[page_ids.long()]
    return pages.reshape(-1, pages.shape[-1])[:kv_len]


def mla_reference(q_nope, q_pe, ckv_cache, kpe_cache, indptr, indices, last_page_len, *, sm_scale: float,
                  qo_indptr=None, ckv_scale: float = 1.0, kpe_scale: float | None = None):
    """Returns (out [tokens, heads, 512] float32, lse [tokens, heads] natural log).

    kpe_cache None: ckv_cache is one [pages, page_size, 576] cache. ckv_scale and kpe_scale (default
    ckv_scale) multiply the stored latents (fp8 caches hold latent / scale)."""
    ckv_cache, kpe_cache = split_latent_cache(ckv_cache, kpe_cache)
    kpe_scale = ckv_scale if kpe_scale is None else kpe_scale
    tokens, heads, latent = q_nope.shape
    page_size = ckv_cache.shape[1]
    indptr = [int(x) for x in indptr]
    last_page_len = [int(x) for x in last_page_len]
    batch = len(indptr) - 1
    qo_indptr = list(range(batch + 1)) if qo_indptr is None else [int(x) for x in qo_indptr]
    out = torch.zeros(tokens, heads, latent, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q_nope.device)
    for b in range(batch):
        n_pages = indptr[b + 1] - indptr[b]
        kv_len = (n_pages - 1) * page_size + last_page_len[b] if n_pages else 0
        q0, q1 = qo_indptr[b], qo_indptr[b + 1]
        if kv_len == 0 or q1 == q0:
            continue
        page_ids = indices[indptr[b]:indptr[b + 1]]
        ckv = gather_latents(ckv_cache, page_ids, kv_len).float() * float(ckv_scale)
        kpe = gather_latents(kpe_cache, page_ids, kv_len).float() * float(kpe_scale)
        scores = (torch.einsum("thd,kd->thk", q_nope[q0:q1].float(), ckv)
                  + torch.einsum("thd,kd->thk", q_pe[q0:q1].float(), kpe)) * sm_scale
        n = q1 - q0
        q_pos = torch.arange(kv_len - n, kv_len, device=q_nope.device)[:, None, None]
        kv_pos = torch.arange(kv_len, device=q_nope.device)[None, None, :]
        scores = scores.masked_fill(kv_pos > q_pos, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [t, h]
        probs = torch.nan_to_num(torch.exp(scores - row_lse[..., None]), nan=0.0)
        out[q0:q1] = torch.einsum("thk,kd->thd", probs, ckv)
        lse[q0:q1] = row_lse
    return out, lse
