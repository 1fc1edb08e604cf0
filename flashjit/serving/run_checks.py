"""run()'s full checks of its tensors. BatchDecode.run() recognises the common valid q, out, lse,
cache and scales in a few reads; anything else comes here, to be validated (each failure a
ValueError naming the tensor) and pointed at."""

from __future__ import annotations

import weakref

from .. import validation

# BatchDecode's memo of the cache its arguments point at, before any: (pair?, weak K, weak V,
# K and V pointers, K and V shapes); matches nothing.
NO_CACHE = (None, lambda: None, lambda: None, 0, 0, None, None)
NO_SCALES = (None, None)  # the scale key of run() given neither scale
MAX_VALIDATED_CACHES = 1024  # cache tensors remembered as validated (then forgotten at once)


def check_query(name: str, t, plan, device, dtype):
    """q or out: [tokens (up to the CUDA-graph rows), qo_heads, head_dim] of dtype, 16-byte rows, heads packed."""
    low, high, _, heads, head_dim, _ = plan.query_form
    rows = t.shape[0] if getattr(t, "dim", lambda: 0)() == 3 and low <= t.shape[0] <= high else low
    validation.tensor(name, t, dtype=dtype, device=device, shape=(rows, heads, head_dim))
    validation.rows_16b_aligned(name, t, head_dim)
    if t.stride(1) != head_dim:
        validation.fail(name, f"heads packed densely (stride(1) == head_dim == {head_dim})", f"strides {t.stride()}")


def lse_pointer(lse, out, dtype, device) -> int:
    """data_ptr of lse, a contiguous tensor of dtype [out's rows, qo_heads]."""
    validation.tensor("lse", lse, dtype=dtype, device=device, shape=tuple(out.shape[:2]))
    if not lse.is_contiguous():
        validation.fail("lse", "a contiguous tensor", f"strides {lse.stride()}")
    return lse.data_ptr()


def point_at_cache(kv_cache, a, plan, device, validated: dict):
    """Point the decode arguments a at K and V: a (k_cache, v_cache) pair or one [pages, 2, ...]
    tensor. validated: id(tensor) -> (weakref, data_ptr, dtype, shape, strides) of the tensors
    already checked against this plan, which are recognised instead of checked again."""
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        k, v = kv_cache
        a.k, k_strides = _checked("k_cache", k, 4, plan, device, validated)
        a.v, v_strides = _checked("v_cache", v, 4, plan, device, validated)
        if v_strides != k_strides:
            validation.fail("v_cache", f"the shape and strides of k_cache {tuple(k.shape)}/{k.stride()}",
                            f"{tuple(v.shape)}/{v.stride()}")
    elif isinstance(kv_cache, (tuple, list)):
        validation.fail("kv_cache", "a (k_cache, v_cache) pair or one [pages, 2, ...] tensor",
                        f"{len(kv_cache)} tensors")
    else:
        a.k, k_strides = _checked("kv_cache", kv_cache, 5, plan, device, validated)
        a.v = a.k + kv_cache.stride(1) * kv_cache.element_size()
    a.page_stride, a.slot_stride, a.head_stride = k_strides


def _checked(name: str, t, ndim: int, plan, device, validated: dict):
    """(data_ptr, (page, slot, head) element strides) of a validated cache tensor."""
    seen = validated.get(id(t))
    if seen is not None and seen[0]() is t:
        pointer = t.data_ptr()
        if pointer == seen[1] and t.dtype is seen[2] and t.shape == seen[3]:  # not re-pointed by .set_()
            return pointer, seen[4]
    setup, max_page = plan.setup, plan.max_page
    layout, kv_shape = setup.spec.kv_layout, setup.kv_shape
    validation.tensor(name, t, dtype=setup.kv_dtype, device=device, ndim=ndim)
    if ndim == 5 and t.shape[1] != 2:
        validation.fail(name, "shape [pages, 2, ...] (K then V)", f"shape {tuple(t.shape)}")
    page_view = t[:, 0] if ndim == 5 else t
    if tuple(page_view.shape[1:]) != kv_shape:
        dims = "[pages, page_size, kv_heads, head_dim]" if layout == "NHD" else "[pages, kv_heads, page_size, head_dim]"
        validation.fail(name, f"{layout} layout {dims} = [*, {', '.join(map(str, kv_shape))}]",
                        f"shape {tuple(t.shape)}")
    if page_view.shape[0] <= max_page:
        validation.fail(name, f"more than {max_page} pages (indices refer to page {max_page})",
                        f"{page_view.shape[0]} pages")
    validation.rows_16b_aligned(name, page_view, setup.head_dim)
    slot_dim, head_dim = (1, 2) if layout == "NHD" else (2, 1)
    strides = (page_view.stride(0), page_view.stride(slot_dim), page_view.stride(head_dim))
    validation.strides_fit_int32(name, strides)
    if len(validated) > MAX_VALIDATED_CACHES:
        validated.clear()
    validated[id(t)] = (weakref.ref(t), t.data_ptr(), t.dtype, t.shape, strides)
    return t.data_ptr(), strides


def scale_key(value):
    """What identifies a scale argument: a tensor by its memory and version (in-place writes bump it)."""
    if hasattr(value, "data_ptr"):
        return (value.data_ptr(), value._version, value.dtype, value.device, value.shape)
    return value


def point_at_scales(a, k_scale, v_scale, setup, device):
    """Set the decode arguments' k_scale and v_scale (host factor, device pointer, per-head stride)."""
    import torch

    required, heads = setup.spec.kv_is_fp8, setup.num_kv_heads
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        host, pointer, stride = validation.kv_scale(name, value, num_kv_heads=heads, device=device,
                                                    required=required)
        if pointer and not torch.cuda.is_current_stream_capturing():  # a capture cannot synchronize
            validation.tensor_scale_values(name, value)
        setattr(a, name, host)
        setattr(a, name + "_ptr", pointer)
        setattr(a, name + "_stride", stride)
