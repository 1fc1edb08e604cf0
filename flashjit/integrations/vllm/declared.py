"""What FLASHJIT and FLASHJIT_MLA both declare to vLLM 0.33: 16-bit queries, blocks of 1 to
MAX_BLOCK_SIZE tokens, compute capability MIN_CAPABILITY and newer, decoder self-attention, plans
made from the host's query lengths, and validate_configuration, which hands every setting to the
backend's own refusals."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionType, MultipleOf

from .checks import MAX_BLOCK_SIZE, MIN_CAPABILITY


class FlashJITDeclarations:
    """Mixed in ahead of vLLM's backend base class; a backend adds refusals(**settings)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # any size up to MAX_BLOCK_SIZE: supports_block_size bounds it

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or 1 <= block_size <= MAX_BLOCK_SIZE

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return tuple(capability) >= MIN_CAPABILITY

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # plans are made from the host's query lengths

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                               use_mm_prefix, use_per_head_quant_scales, device_capability, attn_type,
                               has_sliding_window=False, use_non_causal=False, use_batch_invariant=False,
                               use_kv_connector=False, use_pcp=False, use_adaptive_verification=False,
                               use_dcp=False, use_rswa=False) -> list[str]:
        # KV connectors are served by both backends: they give no reason.
        return cls.refusals(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
            capability=None if device_capability is None else tuple(device_capability), attn_type=attn_type,
            has_sink=has_sink, has_sliding_window=has_sliding_window,
            use_per_head_quant_scales=use_per_head_quant_scales,
            use_mla=use_mla, use_sparse=use_sparse, use_mm_prefix=use_mm_prefix, use_rswa=use_rswa,
            use_non_causal=use_non_causal, use_batch_invariant=use_batch_invariant, use_pcp=use_pcp, use_dcp=use_dcp,
            use_adaptive_verification=use_adaptive_verification)

    @staticmethod
    def refusals(**settings) -> list[str]:
        """One reason per setting the backend does not serve (settings: validate_configuration's,
        device_capability as capability)."""
        raise NotImplementedError
