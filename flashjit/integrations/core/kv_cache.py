"""A serving framework's per-layer KV cache seen as flashjit's (k, v) pair of NHD views, in place,
and the step's new keys and values written into it by slot.

vLLM 0.33 hands each layer one tensor of logical shape [blocks, kv_heads, block_size, 2 * head_dim]:
K and V side by side in the last dimension (V = K + head_dim), the physical order of the other
dimensions set by its KV-cache layout (LBNHC, the default, stores a token's heads one after another:
token stride 2 * kv_heads * head_dim). Whatever the layout, the last dimension is contiguous, so K
and V are two strided views [blocks, block_size, kv_heads, head_dim] that flashjit's kernels read
through their page, slot and head strides. Nothing is copied.
"""

from __future__ import annotations

import typing

import torch

from ... import validation

# vLLM's cache dtype names and the torch dtype an fp8 cache holds (its tensors are allocated as uint8).
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT32_MAX = 2**31 - 1


class KVPair(typing.NamedTuple):
    """K and V of one layer: [blocks, block_size, kv_heads, head_dim] views of the same storage."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]


def split_kv_cache(kv_cache: torch.Tensor, head_dim: int, cache_dtype: str = "auto") -> KVPair:
    """The (k, v) views of a packed [blocks, kv_heads, block_size, 2 * head_dim] cache, in place.

    cache_dtype: vLLM's name of the cache's dtype; an fp8 one views the (uint8) storage as that
    fp8 type. Raises ValueError naming the cache when it is not of that shape, its last dimension
    is not contiguous, or its strides do not keep rows 16-byte aligned or fit the kernel's int32."""
    validation.tensor("kv_cache", kv_cache, ndim=4)
    blocks, heads, block_size, width = kv_cache.shape
    if width != 2 * head_dim:
        validation.fail("kv_cache", f"shape [blocks, kv_heads, block_size, 2 * head_dim = {2 * head_dim}] (K then V)",
                        f"shape {tuple(kv_cache.shape)}")
    fp8 = FP8_CACHE_DTYPES.get(cache_dtype)
    if fp8 is not None and kv_cache.dtype != fp8:
        if kv_cache.element_size() != 1:
            validation.fail("kv_cache", f"a 1-byte tensor for cache dtype {cache_dtype!r}", kv_cache.dtype)
        kv_cache = kv_cache.view(fp8)
    pair = kv_cache.transpose(1, 2)  # [blocks, block_size, kv_heads, 2 * head_dim]
    k, v = pair[..., :head_dim], pair[..., head_dim:]
    validation.rows_16b_aligned("kv_cache", k, head_dim)
    validation.rows_16b_aligned("kv_cache", v, head_dim)
    validation.strides_fit_int32("kv_cache", tuple(k.stride()[:3]))
    return KVPair(k, v)


def separate_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVPair:
    """A pair of separate [blocks, block_size, kv_heads, head_dim] K and V buffers (SGLang's pool,
    a page size of 1 and more), checked the same way."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        validation.tensor(name, t, ndim=4)
        validation.rows_16b_aligned(name, t, t.shape[-1])
        validation.strides_fit_int32(name, tuple(t.stride()[:3]))
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        validation.fail("v_cache", f"k_cache's shape {tuple(k_cache.shape)} and dtype {k_cache.dtype}",
                        f"{tuple(v_cache.shape)}, {v_cache.dtype}")
    return KVPair(k_cache, v_cache)


def write_kv(cache: KVPair, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale=None, v_scale=None) -> None:
    """Store the step's new keys and values ([tokens, kv_heads, head_dim]) at their slots (block *
    block_size + offset, one per token; the mapping may be shorter than key, padded tokens beyond
    it are not written), quantized by k_scale / v_scale for an fp8 cache.

    Negative slots mark padding tokens (vLLM's PAD_SLOT_ID); they are written to slot 0 of block 0,
    the null block no request reads. Fixed-shape torch ops, no host synchronization: this is
    captured in CUDA graphs as it is."""
    tokens = slot_mapping.shape[0]
    if tokens == 0:
        return
    block_size = cache.k.shape[1]
    slots = slot_mapping.to(torch.long).clamp_min(0)
    blocks, offsets = slots // block_size, slots % block_size
    for view, new, scale in ((cache.k, key, k_scale), (cache.v, value, v_scale)):
        new = new[:tokens]
        if view.dtype != new.dtype:
            new = _to_cache_dtype(new, view.dtype, scale)
        if view.element_size() == 1:  # fp8: stored as bytes (index_put takes every integer type)
            view, new = view.view(torch.uint8), new.view(torch.uint8)
        view[blocks, offsets] = new


def _to_cache_dtype(values: torch.Tensor, dtype, scale) -> torch.Tensor:
    """values / scale in the cache's dtype; fp8 saturates at its largest finite value (as vLLM's writer does)."""
    if scale is None and dtype in FP8_CACHE_DTYPES.values():
        validation.fail("k_scale/v_scale", "the layer's scale for an fp8 cache", None)
    if dtype not in FP8_CACHE_DTYPES.values():
        return values.to(dtype)
    x = values.float()
    if torch.is_tensor(scale):
        x = x / scale.float().reshape(-1, 1) if scale.numel() > 1 else x / scale.float().reshape(())
    else:
        x = x / float(scale)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)
