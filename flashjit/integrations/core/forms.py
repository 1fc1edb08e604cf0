"""DecodeForm: what a layer's attention asks of a plan (heads, dtypes, block size, scale, window,
soft-cap, sinks). Layers of one form share every plan of a step; a model whose layers differ
(Gemma's windowed and global layers, say) has a form for each kind."""

from __future__ import annotations

import dataclasses
import math

import torch

from ...kernels.decode.spec import FP8_QUERY_DTYPE, DecodeSpec, normalize_dtype, KV_DTYPES
from ...serving import variant_args
from ... import validation


@dataclasses.dataclass(frozen=True)
class DecodeForm:
    """One plan's scalars. window_left: keys at most this far behind the query stay visible (a
    framework's sliding window of w keys, the query's own counted, is w - 1); None: no window.
    logits_soft_cap: None or 0 for none. has_sinks: one learned sink logit per query head, given
    per layer at run time. model_dtype is the model's (and the output's) dtype; fp8_queries: over an
    e4m3 cache the framework hands the queries over in e4m3 (as vLLM does for FA3), on sm_89+."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    model_dtype: str
    kv_dtype: str
    sm_scale: float
    window_left: int | None = None
    logits_soft_cap: float | None = None
    has_sinks: bool = False
    fp8_queries: bool = False

    def __post_init__(self):
        validation.head_counts(self.num_qo_heads, self.num_kv_heads, self.page_size)
        object.__setattr__(self, "model_dtype", normalize_dtype(self.model_dtype))
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES))
        if self.window_left is not None and (not isinstance(self.window_left, int) or self.window_left < 0):
            validation.fail("window_left", "None or a non-negative int", self.window_left)
        cap = self.logits_soft_cap
        if cap is not None and not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap >= 0):
            validation.fail("logits_soft_cap", "None or a finite float >= 0 (0: none)", self.logits_soft_cap)
        if self.fp8_queries not in (True, False) or (self.fp8_queries and self.kv_dtype != FP8_QUERY_DTYPE):
            validation.fail("fp8_queries", f"False, or True over a {FP8_QUERY_DTYPE} cache (kv_dtype {self.kv_dtype})",
                            self.fp8_queries)

    @property
    def mask(self) -> str:
        # causal: query i of n sits at kv_len - n + i, so speculative rows see no later draft.
        return "causal" if self.window_left is None else "sliding_window"

    @property
    def capped(self) -> bool:
        return bool(self.logits_soft_cap)

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype.startswith("float8")

    @property
    def query_dtype(self) -> str:
        """The dtype of the queries the decode rows get: e4m3 with fp8_queries, else the model's."""
        return FP8_QUERY_DTYPE if self.fp8_queries else self.model_dtype

    @property
    def may_share_prefixes(self) -> bool:
        """Whether plan() can read shared leading blocks once: a 16-bit cache, no window, no variant."""
        return not self.kv_is_fp8 and self.window_left is None and not self.capped and not self.has_sinks

    def plan_kwargs(self, sinks: torch.Tensor | None = None) -> dict:
        """BatchDecode.plan()'s keywords for this form (sinks: the float32 buffer the layers fill)."""
        if self.has_sinks and sinks is None:
            validation.fail("sinks", f"a float32 tensor of {self.num_qo_heads} values for a form with sinks", None)
        return dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    page_size=self.page_size, mask=self.mask, window_left=self.window_left, q_dtype=self.query_dtype,
                    out_dtype=self.model_dtype, kv_dtype=self.kv_dtype, sm_scale=self.sm_scale,
                    logits_soft_cap=self.logits_soft_cap if self.capped else None,
                    sinks=sinks if self.has_sinks else None)

    def variant(self) -> str:
        sinks = torch.empty(0) if self.has_sinks else None
        return variant_args.resolve(None, None, self.logits_soft_cap if self.capped else None, sinks)[0]

    def specs(self, arch: str, max_q_len: int, share_prefixes: bool = True) -> list[DecodeSpec]:
        """Every kernel plan() may pick for this form with up to max_q_len query tokens a request:
        one per query count, and the shared-prefix kernel beside each where the form shares."""
        group = self.num_qo_heads // self.num_kv_heads
        variant = self.variant()
        found = []
        for q in range(1, max_q_len + 1):
            found.append(DecodeSpec.cached(self.head_dim, self.model_dtype, self.kv_dtype, self.mask, self.page_size, group,
                                           q, "NHD", arch, None, variant, False, self.fp8_queries))
            if share_prefixes and self.may_share_prefixes:
                try:
                    found.append(DecodeSpec.cached(self.head_dim, self.model_dtype, self.kv_dtype, self.mask,
                                                   self.page_size, group, q, "NHD", arch, True, variant, True))
                except ValueError:  # no shared-prefix kernel for this shape: plan() plans every request alone
                    pass
        return found
