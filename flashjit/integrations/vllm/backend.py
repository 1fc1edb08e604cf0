"""FlashJITBackend: vLLM 0.33's AttentionBackend for flashjit's decode kernels.

What it declares is what its builder and impl serve (checks.refusal_reasons gives the reason for
each refused setting): bf16/fp16 models, 16-bit and fp8 (e4m3) KV caches with per-tensor or
per-head scales, head sizes 64/96/128/256, blocks of 1-256 tokens, sliding windows, logits
soft-capping, learned sinks, compute capability 8.0 and newer, and every KV-cache layout vLLM 0.33
has (the cache is read in place through its strides; LBNHC, the default, first). The impl writes
the cache itself (do_kv_cache_update)."""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_layout import KVCacheLayout

from .checks import SUPPORTED_HEAD_SIZES, SUPPORTED_KV_CACHE_DTYPES, refusal_reasons
from .declared import FlashJITDeclarations
from .registration import BACKEND_NAME


class FlashJITBackend(FlashJITDeclarations, AttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        from .impl import FlashJITImpl

        return FlashJITImpl

    @staticmethod
    def get_builder_cls():
        from .builder import FlashJITMetadataBuilder

        return FlashJITMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        first = KVCacheLayout.LBNHC
        return (first,) + tuple(layout for layout in KVCacheLayout if layout is not first)

    @staticmethod
    def refusals(*, has_sliding_window: bool, use_per_head_quant_scales: bool, **settings) -> list[str]:
        # Sliding windows and per-head scales are served: they give no reason.
        return refusal_reasons(**settings)
