"""LayerAttention: one attention layer's work in a step, framework-free: write the step's new K/V
into the cache, run the decode rows on the step's planned decoder for the layer's form, and the
prefill rows on a prefill kernel, into one output."""

from __future__ import annotations

import torch

from .forms import DecodeForm
from .kv_cache import KVPair, split_kv_cache, write_kv
from .step import StepPlan


class LayerAttention:
    """form: the layer's DecodeForm; cache_dtype: the framework's name of the cache's dtype ("auto",
    "bfloat16", "fp8", ...); prefill: a prefill kernel (core.prefill); sinks: the layer's learned
    sink logits (one per query head) when the form has sinks."""

    def __init__(self, form: DecodeForm, *, cache_dtype: str = "auto", prefill=None, sinks: torch.Tensor | None = None):
        if form.has_sinks != (sinks is not None):
            raise ValueError(f"sinks: expected a tensor of {form.num_qo_heads} values exactly when the form has "
                             f"sinks (has_sinks={form.has_sinks}), got {None if sinks is None else tuple(sinks.shape)}")
        self.form = form
        self.cache_dtype = cache_dtype
        self.prefill = prefill
        self.sinks = sinks
        self._pair_for = None  # (data_ptr, shape, strides, dtype) of the cache the memoized pair views
        self._pair: KVPair | None = None

    def kv_pair(self, kv_cache) -> KVPair:
        """The (k, v) views of the layer's cache: a KVPair as given, or vLLM's packed tensor split in place."""
        if isinstance(kv_cache, KVPair):
            return kv_cache
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        if key != self._pair_for:
            self._pair = split_kv_cache(kv_cache, self.form.head_dim, self.cache_dtype)
            self._pair_for = key
        return self._pair

    def write_kv(self, kv_cache, key, value, slot_mapping, k_scale=None, v_scale=None) -> None:
        """Store the step's new keys and values ([tokens, kv_heads, head_dim]) at their slots."""
        write_kv(self.kv_pair(kv_cache), key, value, slot_mapping, k_scale, v_scale)

    def forward(self, step: StepPlan, query: torch.Tensor, kv_cache, output: torch.Tensor, *, q_scale=None,
                k_scale=None, v_scale=None) -> torch.Tensor:
        """Attention of query ([tokens, qo_heads, head_dim]) into output (the same shape) for the
        step's rows; k_scale / v_scale (tensors or floats) for an fp8 cache, and q_scale for the
        prefill rows' fp8 queries (a host float reads no device value)."""
        pair = self.kv_pair(kv_cache)
        rows, form = step.rows, self.form
        fp8 = form.kv_is_fp8
        if rows.num_decodes:
            decoder = step.decoders.get(form)
            if decoder is None:
                raise RuntimeError(f"the step was planned for {list(step.decoders)}, not for this layer's {form}: "
                                   "the planner must be given every layer's form")
            if self.sinks is not None:
                step.sinks[form].copy_(self.sinks)  # read at launch: a graph replays the copy too
            n = step.decode_tokens
            decoder.run(query[:n], pair, out=output[:n], k_scale=k_scale if fp8 else None,
                        v_scale=v_scale if fp8 else None)
        if step.prefill is not None:
            p = step.prefill
            if self.prefill is None:
                raise RuntimeError("a step with prefill rows needs LayerAttention(prefill=...)")
            self.prefill(query[p.token_begin:p.token_end], pair, output[p.token_begin:p.token_end], p,
                         sm_scale=form.sm_scale, window_left=form.window_left,
                         logits_soft_cap=form.logits_soft_cap if form.capped else None, sinks=self.sinks,
                         q_scale=q_scale, k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None)
        return output
