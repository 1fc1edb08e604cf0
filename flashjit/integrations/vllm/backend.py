"""FlashJITBackend: vLLM 0.33's AttentionBackend for flashjit's decode kernels.

What it declares is what its builder and impl serve (checks.refusal_reasons gives the reason for
each refused setting): bf16/fp16 models, 16-bit and fp8 (e4m3) KV caches with per-tensor or
per-head scales, head sizes 64/96/128/256, blocks of 1-256 tokens, sliding windows, logits
soft-capping, learned sinks, compute capability 8.0 and newer, and every KV-cache layout vLLM 0.33
has (the cache is read in place through its strides; LBNHC, the default, first). The impl writes
the cache itself (do_kv_cache_update)."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.v1.kv_cache_layout import KVCacheLayout

from .checks import MAX_BLOCK_SIZE, SUPPORTED_HEAD_SIZES, SUPPORTED_KV_CACHE_DTYPES, refusal_reasons
from .registration import BACKEND_NAME


class FlashJITBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
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

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # any size up to MAX_BLOCK_SIZE: supports_block_size bounds it

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or 1 <= block_size <= MAX_BLOCK_SIZE

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
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # plans are made from the host's query lengths

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return tuple(capability) >= (8, 0)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        first = KVCacheLayout.LBNHC
        return (first,) + tuple(layout for layout in KVCacheLayout if layout is not first)

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                               use_mm_prefix, use_per_head_quant_scales, device_capability, attn_type,
                               has_sliding_window=False, use_non_causal=False, use_batch_invariant=False,
                               use_kv_connector=False, use_pcp=False, use_adaptive_verification=False,
                               use_dcp=False, use_rswa=False) -> list[str]:
        # Sinks, sliding windows, per-head scales and KV connectors are served: they give no reason.
        return refusal_reasons(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                               capability=None if device_capability is None else tuple(device_capability),
                               has_sink=has_sink, use_mla=use_mla, use_sparse=use_sparse, use_mm_prefix=use_mm_prefix,
                               attn_type=attn_type, use_rswa=use_rswa, use_non_causal=use_non_causal,
                               use_batch_invariant=use_batch_invariant, use_pcp=use_pcp, use_dcp=use_dcp,
                               use_adaptive_verification=use_adaptive_verification)
