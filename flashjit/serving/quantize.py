"""fp8 KV caches: quantize a 16-bit paged cache to float8 with a scale, and back.

The scale maps the cache's largest magnitude to the format's largest finite value (per tensor, or
per KV head), so the values use the whole fp8 range; pass it to run() as k_scale / v_scale.
Works on one K or V cache of 4 dimensions, NHD or HND; quantize K and V separately. A scale is a
normal float32 at least (so its reciprocal is finite): a cache whose largest magnitude is below
the format's largest value x 2**-126 (about 5e-36 for e4m3) gets that smallest scale, and keeps
fewer fp8 bits. A cache of all zeros, or an empty one, gets the scale 1.
"""

from __future__ import annotations

from .. import validation
from ..jit.dtypes import FP8_DTYPES, normalize_dtype
from ..validation import FLOAT32_MIN_NORMAL

FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
_PAGES_PER_STEP = 4096  # bounds the float32 temporaries of a large cache


def _head_axis(cache, kv_layout: str) -> int:
    validation.tensor("cache", cache, ndim=4)
    layout = str(kv_layout).upper()
    if layout not in ("NHD", "HND"):
        validation.fail("kv_layout", "NHD or HND", kv_layout)
    return 2 if layout == "NHD" else 1


def _broadcastable(scale, axis: int):
    shape = [1, 1, 1, 1]
    shape[axis] = -1
    return scale.reshape(shape) if scale.numel() > 1 else scale.reshape(())


def quantize_kv(cache, kv_dtype="float8_e4m3fn", *, per_head: bool = False, kv_layout: str = "NHD"):
    """(fp8 cache, scale) with cache ~= fp8.float() * scale.

    scale: float32 on the cache's device, shape [1] (per tensor) or [kv_heads] (per_head).
    """
    import torch

    name = normalize_dtype(kv_dtype, "kv_dtype", FP8_DTYPES)
    axis = _head_axis(cache, kv_layout)
    _check_source(cache)
    dims = [d for d in range(4) if d != axis] if per_head else list(range(4))
    if cache.numel() == 0:  # nothing to measure: an empty fp8 cache and the scale 1
        heads = cache.shape[axis] if per_head else 1
        return (torch.empty(cache.shape, dtype=getattr(torch, name), device=cache.device),
                torch.ones(heads, dtype=torch.float32, device=cache.device))
    amax = cache.abs().amax(dim=dims).float().reshape(-1)
    scale = _scale_of(amax, FP8_MAX[name])
    out = torch.empty(cache.shape, dtype=getattr(torch, name), device=cache.device)
    inverse = _broadcastable(1.0 / scale, axis)
    for source, target in zip(cache.split(_PAGES_PER_STEP), out.split(_PAGES_PER_STEP)):
        target.copy_((source.float() * inverse).clamp_(-FP8_MAX[name], FP8_MAX[name]))
    return out, scale


def _check_source(cache) -> None:
    """A cache quantize can read: 16-, 32- or 64-bit floats (an fp8 one is quantized already)."""
    import torch

    if cache.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        already = " (an fp8 cache is quantized already: dequantize_kv gives its values)" if "float8" in str(
            cache.dtype) else ""
        validation.fail("cache", f"a float16, bfloat16, float32 or float64 tensor{already}", cache.dtype)


def _scale_of(amax, fp8_max: float):
    """The scale mapping amax to fp8_max: a normal float32 at least, 1 for an all-zero cache."""
    import torch

    if not bool(torch.isfinite(amax).all()):
        validation.fail("cache", "finite values", "inf or nan")
    return torch.where(amax > 0, (amax / fp8_max).clamp_min(FLOAT32_MIN_NORMAL), torch.ones_like(amax))


def dequantize_kv(cache, scale, *, kv_layout: str = "NHD"):
    """The float32 cache an fp8 cache and its scale (float or tensor of 1 or kv_heads) stand for."""
    import torch

    axis = _head_axis(cache, kv_layout)
    if not torch.is_tensor(scale):
        scale = torch.tensor([float(scale)], device=cache.device)
    return cache.float() * _broadcastable(scale.float(), axis)


def quantize_latent(cache, kv_dtype="float8_e4m3fn"):
    """(fp8 cache, scale) of an MLA latent cache ([pages, page_size, 512], [pages, page_size, 64] or
    one 576-wide cache), one scale per tensor: cache ~= fp8.float() * scale. Quantize c_kv and k_pe
    apart for a scale each; pass them to BatchDecodeMLA.run() as ckv_scale and kpe_scale."""
    import torch

    name = normalize_dtype(kv_dtype, "kv_dtype", FP8_DTYPES)
    validation.tensor("cache", cache, ndim=3)
    _check_source(cache)
    out = torch.empty(cache.shape, dtype=getattr(torch, name), device=cache.device)
    if cache.numel() == 0:
        return out, torch.ones(1, dtype=torch.float32, device=cache.device)
    scale = _scale_of(cache.abs().amax().float().reshape(1), FP8_MAX[name])
    for source, target in zip(cache.split(_PAGES_PER_STEP), out.split(_PAGES_PER_STEP)):
        target.copy_((source.float() / scale).clamp_(-FP8_MAX[name], FP8_MAX[name]))
    return out, scale
