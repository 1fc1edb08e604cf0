"""Kernels for the prefill rows of a mixed step (more query tokens a request than the decode
kernels take), over the same paged cache, called with the same arguments:

    kernel(q, cache, out, rows, *, sm_scale, window_left, logits_soft_cap, sinks, q_scale, k_scale, v_scale)

q and out are the prefill rows' [tokens, qo_heads, head_dim]; cache the layer's KVPair; rows a
step.PrefillRows. Query token i of a row of n over kv keys sits at kv - n + i (causal).

- Fa3KVCachePrefill: FlashAttention 3's flash_attn_with_kvcache (the tokenspeed-fa3 wheel's
  flash_attn_interface, the same FA3 kernels vLLM ships), paged through the block table.
- ReferencePrefill: flashjit's float32 torch reference (slow; tests, and where no FA3 is installed).
A framework adapter adds its own (vLLM's: vllm.vllm_flash_attn's varlen call).
"""

from __future__ import annotations

import torch

from ...serving.reference import decode_reference
from .kv_cache import KVPair


def fa3_descales(rows, num_kv_heads: int, q_scale, k_scale, v_scale) -> dict:
    """FA3's q/k/v_descale arguments for an fp8 cache: [requests, kv_heads] views of per-tensor scales."""
    shape = (rows.num_rows, num_kv_heads)

    def expand(scale):
        if scale is None:
            return None
        return torch.as_tensor(scale, dtype=torch.float32, device=rows.seqused_k.device).reshape(-1)[:1].expand(shape)

    return dict(q_descale=expand(q_scale), k_descale=expand(k_scale), v_descale=expand(v_scale))


def quantized_query(q: torch.Tensor, kv_dtype, q_scale) -> torch.Tensor:
    """q / q_scale in the fp8 cache's dtype (FA3 takes fp8 queries over an fp8 cache), saturating."""
    limit = torch.finfo(kv_dtype).max
    scale = 1.0 if q_scale is None else q_scale
    return (q.float() / scale).clamp(-limit, limit).to(kv_dtype)


class Fa3KVCachePrefill:
    """FA3's flash_attn_with_kvcache over the prefill rows (module: an imported flash_attn_interface)."""

    name = "fa3"

    def __init__(self, module=None):
        if module is None:
            import flash_attn_interface as module  # tokenspeed-fa3
        self._fa3 = module

    def __call__(self, q, cache: KVPair, out, rows, *, sm_scale, window_left=None, logits_soft_cap=None, sinks=None,
                 q_scale=None, k_scale=None, v_scale=None):
        fp8 = cache.k.element_size() == 1
        extra = fa3_descales(rows, cache.k.shape[2], q_scale, k_scale, v_scale) if fp8 else {}
        if fp8:
            q = quantized_query(q, cache.k.dtype, q_scale)
        result = self._fa3.flash_attn_with_kvcache(
            q, cache.k, cache.v, cache_seqlens=rows.seqused_k, page_table=rows.block_table,
            cu_seqlens_q=rows.cu_seqlens_q, max_seqlen_q=rows.max_seqlen_q, softmax_scale=sm_scale, causal=True,
            window_size=(-1 if window_left is None else window_left, 0), softcap=logits_soft_cap or 0.0,
            sinks=sinks, **extra)
        out.copy_(result[0] if isinstance(result, tuple) else result)
        return out


class ReferencePrefill:
    """The float32 reference over the prefill rows' gathered pages."""

    name = "reference"

    def __call__(self, q, cache: KVPair, out, rows, *, sm_scale, window_left=None, logits_soft_cap=None, sinks=None,
                 q_scale=None, k_scale=None, v_scale=None):
        k, v = cache.k, cache.v
        if k.element_size() == 1:  # dequantize
            k = k.float() * (1.0 if k_scale is None else torch.as_tensor(k_scale).float().reshape(-1, 1))
            v = v.float() * (1.0 if v_scale is None else torch.as_tensor(v_scale).float().reshape(-1, 1))
        block_size = k.shape[1]
        seq = rows.seqused_k.cpu().long()
        pages = (seq + block_size - 1) // block_size
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)])
        table = rows.block_table.cpu()
        indices = torch.cat([table[r, : int(pages[r])] for r in range(len(seq))]).to(k.device)
        last = torch.where(pages > 0, seq - (pages - 1) * block_size, 0)
        mask, params = ("causal", None) if window_left is None else ("sliding_window", {"window_left": window_left})
        variant, vparams = "none", {}
        if logits_soft_cap:
            variant, vparams = "soft_cap", {"logits_soft_cap": float(logits_soft_cap)}
        if sinks is not None:
            variant = "soft_cap_sinks" if logits_soft_cap else "sinks"
            vparams["sinks"] = sinks.float()
        result, _ = decode_reference(q, k, v, indptr, indices, last, qo_indptr=rows.cu_seqlens_q_cpu, mask=mask,
                                     mask_params=params, sm_scale=sm_scale, variant=variant, variant_params=vparams)
        out.copy_(result)
        return out


def default_prefill():
    """FA3 where tokenspeed-fa3's flash_attn_interface imports, else the reference."""
    try:
        return Fa3KVCachePrefill()
    except ImportError:
        return ReferencePrefill()
