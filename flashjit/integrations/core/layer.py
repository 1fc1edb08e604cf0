"""LayerAttention: one attention layer's work in a step, framework-free: write the step's new K/V
into the cache, run the decode rows on the step's planned decoder for the layer's form, and the
prefill rows on a prefill kernel, into one output."""

from __future__ import annotations

import torch

from ...serving.run_checks import scale_key
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
        self._query_k_scale = (None, None)  # ((k_scale's key, q_scale), K's scale times q_scale) of the last forward

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
        """Attention of query ([tokens, qo_heads, head_dim]) into output (the same shape, the form's
        q_dtype) for the step's rows; k_scale / v_scale (tensors or floats) for an fp8 cache. q_scale
        (a host float reads no device value): the fp8 queries' scale, those the prefill rows cast to,
        or with form.fp8_queries those given (query = the true queries / q_scale)."""
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
            decode_k_scale = self._k_scale_with_query(k_scale, q_scale) if form.fp8_queries else k_scale
            decoder.run(query[:n], pair, out=output[:n], k_scale=decode_k_scale if fp8 else None,
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

    def _k_scale_with_query(self, k_scale, q_scale):
        """K's scale times the e4m3 queries' (scores are q . k, so one factor serves both): k_scale
        itself for a unit q_scale; a tensor product is kept while k_scale and q_scale stay the same."""
        if q_scale is None or (not torch.is_tensor(q_scale) and float(q_scale) == 1.0):
            return k_scale
        if not torch.is_tensor(k_scale) and not torch.is_tensor(q_scale):
            return float(k_scale) * float(q_scale)
        key = (scale_key(k_scale), scale_key(q_scale))
        if self._query_k_scale[0] != key:
            self._query_k_scale = (key, (torch.as_tensor(k_scale, dtype=torch.float32) *
                                         torch.as_tensor(q_scale, dtype=torch.float32)).reshape(-1).contiguous())
        return self._query_k_scale[1]
