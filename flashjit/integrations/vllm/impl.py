"""FlashJITImpl: vLLM's per-layer attention, translated onto flashjit.integrations.core's
LayerAttention (which does the work and is tested without vLLM)."""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from ... import env
from ..core import LayerAttention
from .checks import takes_fp8_queries
from .forms import layer_form
from .prefill import VllmFlashAttentionPrefill


class FlashJITImpl(AttentionImpl):
    can_return_lse_for_decode = False
    supports_quant_query_input = False  # set per layer: e4m3 queries over an e4m3 cache (checks.takes_fp8_queries)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None, **unsupported):
        refused = [name for name, value in (("alibi_slopes", alibi_slopes),) if value is not None]
        refused += sorted(name for name, value in unsupported.items() if value not in (None, False))
        if refused or attn_type != AttentionType.DECODER:
            what = ", ".join(refused) or f"attention type {attn_type}"
            raise NotImplementedError(f"FLASHJIT does not serve {what} (it serves causal decoder attention with "
                                      "optional sliding window, soft-cap and sinks)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        # vLLM's Attention reads this right after making the impl, and then quantizes its queries
        self.supports_quant_query_input = takes_fp8_queries(kv_cache_dtype, env.vllm_fp8_queries())
        self.logits_soft_cap = logits_soft_cap or None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks  # filled when the weights load; each forward copies them into the plan's buffer
        self._layers: dict = {}  # (block_size, query dtype) -> LayerAttention

    def form(self, block_size: int, model_dtype):
        """The DecodeForm of this layer over blocks of block_size tokens."""
        return layer_form(self, block_size, model_dtype)

    def layer_attention(self, block_size: int, model_dtype) -> LayerAttention:
        found = self._layers.get((block_size, model_dtype))
        if found is None:
            found = LayerAttention(self.form(block_size, model_dtype), cache_dtype=self.kv_cache_dtype,
                                   prefill=VllmFlashAttentionPrefill(), sinks=self.sinks)
            self._layers[(block_size, model_dtype)] = found
        return found

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("FLASHJIT does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        attention = self.layer_attention(kv_cache.shape[2], output.dtype)  # the model's dtype (query may be e4m3)
        return attention.forward(attn_metadata.step, query, kv_cache, output, q_scale=query_scale(layer),
                                 k_scale=layer._k_scale, v_scale=layer._v_scale)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        attention = self.layer_attention(kv_cache.shape[2], key.dtype)
        attention.write_kv(kv_cache, key, value, slot_mapping, layer._k_scale, layer._v_scale)


def query_scale(layer):
    """The layer's query scale as flashjit takes it: the host float (no device read) for one scale,
    the tensor for per-KV-head scales (vLLM then quantizes each KV head's queries with its own, and
    keeps only their largest as the float)."""
    scale = getattr(layer, "_q_scale", None)
    return scale if torch.is_tensor(scale) and scale.numel() > 1 else layer._q_scale_float
