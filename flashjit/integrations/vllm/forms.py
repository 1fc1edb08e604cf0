"""A vLLM layer's attention settings as flashjit's DecodeForm (framework-free: the impl's attributes)."""

from __future__ import annotations

from ..core import FP8_CACHE_DTYPES, DecodeForm


def layer_form(impl, block_size: int, model_dtype) -> DecodeForm:
    """impl: num_heads, num_kv_heads, head_size, scale, sliding_window (w keys, the query's own
    counted: window_left = w - 1), logits_soft_cap, sinks and kv_cache_dtype as vLLM passes them, and
    supports_quant_query_input (vLLM then hands e4m3 queries over). model_dtype: the model's dtype."""
    fp8 = FP8_CACHE_DTYPES.get(impl.kv_cache_dtype)
    kv_dtype = fp8 if fp8 is not None else (model_dtype if impl.kv_cache_dtype == "auto" else impl.kv_cache_dtype)
    window = impl.sliding_window
    return DecodeForm(impl.num_heads, impl.num_kv_heads, impl.head_size, block_size, model_dtype, kv_dtype,
                      float(impl.scale), window_left=None if window is None else window - 1,
                      logits_soft_cap=float(impl.logits_soft_cap) if impl.logits_soft_cap else None,
                      has_sinks=impl.sinks is not None,
                      fp8_queries=bool(getattr(impl, "supports_quant_query_input", False)))
