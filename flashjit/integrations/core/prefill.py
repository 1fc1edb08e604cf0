"""Kernels for the prefill rows of a mixed step (more query tokens a request than the decode
kernels take), over the same paged cache, called with the same arguments:

    kernel(q, cache, out, rows, *, sm_scale, window_left, logits_soft_cap, sinks, q_scale, k_scale, v_scale)

q and out are the prefill rows' [tokens, qo_heads, head_dim]; cache the layer's KVPair; rows a
step.PrefillRows. Over an fp8 cache q may come quantized already (the cache's dtype, q_scale its
scale), as vLLM hands queries over to a backend that takes them so; 16-bit queries are cast here.
Query token i of a row of n over kv keys sits at kv - n + i (causal).

- Fa3KVCachePrefill: FlashAttention 3's paged forward, flash_attn_with_kvcache's op (the
  tokenspeed-fa3 wheel's flash_attn_interface, the same FA3 kernels vLLM ships), into out in place.
- ReferencePrefill: flashjit's float32 torch reference (slow; tests, and where no FA3 is installed).
A framework adapter adds its own (vLLM's: vllm.vllm_flash_attn's varlen call).
"""

from __future__ import annotations

import torch

from ...serving.reference import decode_reference
from .kv_cache import KVPair


def fa3_descales(rows, num_kv_heads: int, q_scale, k_scale, v_scale) -> dict:
    """FA3's q/k/v_descale arguments for an fp8 cache: [requests, kv_heads] views of per-tensor or
    per-KV-head scales (tensors, or host floats: 1 is FA3's default, no tensor)."""
    shape = (rows.num_rows, num_kv_heads)

    def expand(scale):
        if scale is None or (not torch.is_tensor(scale) and float(scale) == 1.0):
            return None
        if not torch.is_tensor(scale):  # a fill on the device: no host-to-device copy
            scale = torch.full((1,), float(scale), dtype=torch.float32, device=rows.seqused_k.device)
        flat = scale.float().reshape(-1)
        return (flat.view(1, -1) if flat.numel() == num_kv_heads else flat[:1]).expand(shape)

    return dict(q_descale=expand(q_scale), k_descale=expand(k_scale), v_descale=expand(v_scale))


def quantized_query(q: torch.Tensor, kv_dtype, q_scale) -> torch.Tensor:
    """q / q_scale in the fp8 cache's dtype (FA3 takes fp8 queries over an fp8 cache), saturating at
    the format's largest value. q_scale: None or a host float (no device read), or a tensor. A scale
    of 1 (vLLM's default) is one cast where the device's cast saturates, a clamp and a cast where it
    does not; another scale divides in float32 first. Queries of kv_dtype already are returned as given."""
    if q.dtype == kv_dtype:
        return q
    limit = torch.finfo(kv_dtype).max
    if q_scale is None or (not torch.is_tensor(q_scale) and float(q_scale) == 1.0):
        if casts_saturate(q.device, q.dtype, kv_dtype):
            return q.to(kv_dtype)
        return q.clamp(-limit, limit).to(kv_dtype)  # the fp8 limits are exact in bf16 and fp16
    return q.float().div_(q_scale).clamp_(-limit, limit).to(kv_dtype)


_SATURATING_CASTS: dict = {}  # (device, source dtype, fp8 dtype) -> the probe's answer


def casts_saturate(device: torch.device, src_dtype, kv_dtype) -> bool:
    """Whether torch's src_dtype -> kv_dtype cast on device clamps finite overflow to the largest fp8
    value (torch versions differ; the others give NaN). Probed once per device and dtypes; while a
    CUDA graph is captured an unprobed one is taken as no (the clamp is right either way)."""
    key = (device, src_dtype, kv_dtype)
    if key not in _SATURATING_CASTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        limit = torch.finfo(kv_dtype).max
        probe = torch.tensor([2 * limit, -2 * limit, 1.0], device=device).to(src_dtype).to(kv_dtype)
        _SATURATING_CASTS[key] = probe.float().tolist() == [limit, -limit, 1.0]
    return _SATURATING_CASTS[key]


class Fa3KVCachePrefill:
    """FA3's paged forward over the prefill rows (module: an imported flash_attn_interface)."""

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
        # FA3's forward op given out: the rows land in place, as vLLM's flash_attn_varlen_func(out=...)
        # puts them. FA3 writes bf16 from fp8 queries: other outputs take a copy.
        target = out if not fp8 or out.dtype == torch.bfloat16 else torch.empty_like(out, dtype=torch.bfloat16)
        if sinks is not None:  # this FA3 build takes its sink logits in bf16
            sinks = sinks.to(torch.bfloat16)
        self._fa3.flash_attn_3_gpu.fwd(*fa3_forward_args(
            q=q, k=cache.k, v=cache.v, out_=target, cu_seqlens_q=rows.cu_seqlens_q, seqused_k=rows.seqused_k,
            max_seqlen_q=rows.max_seqlen_q, page_table=rows.block_table, softmax_scale=sm_scale, causal=True,
            window_size_left=-1 if window_left is None else window_left, window_size_right=0,
            softcap=logits_soft_cap or 0.0, sinks=sinks, **extra))
        if target is not out:
            out.copy_(target)
        return out


# FA3's forward op (torch.ops.flash_attn_3.fwd) takes its arguments by position, in this order
FA3_FORWARD_ARGS = ("q", "k", "v", "k_new", "v_new", "qv", "out_", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new",
                    "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx",
                    "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale",
                    "softmax_scale", "causal", "window_size_left", "window_size_right", "attention_chunk", "softcap",
                    "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "sinks")
FA3_FORWARD_DEFAULTS = dict(causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, num_splits=0, sm_margin=0)  # 0 splits: FA3's own choice


def fa3_forward_args(**given) -> list:
    """The positional arguments of FA3's forward op from named ones (None or the default for the rest)."""
    unknown = sorted(set(given) - set(FA3_FORWARD_ARGS))
    if unknown:
        raise TypeError(f"FA3's forward takes no {unknown}; it takes {', '.join(FA3_FORWARD_ARGS)}")
    return [given.get(name, FA3_FORWARD_DEFAULTS.get(name)) for name in FA3_FORWARD_ARGS]


class ReferencePrefill:
    """The float32 reference over the prefill rows' gathered pages."""

    name = "reference"

    def __call__(self, q, cache: KVPair, out, rows, *, sm_scale, window_left=None, logits_soft_cap=None, sinks=None,
                 q_scale=None, k_scale=None, v_scale=None):
        k, v = cache.k, cache.v
        if q.element_size() == 1:  # queries quantized by the framework, per tensor or per KV head
            scale = torch.as_tensor(1.0 if q_scale is None else q_scale, device=q.device).float().reshape(-1)
            q = q.float() * scale.repeat_interleave(q.shape[1] // scale.numel()).view(1, -1, 1)
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
