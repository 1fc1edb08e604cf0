"""The prefill rows of a mixed vLLM step on vLLM's own FlashAttention (vllm.vllm_flash_attn, through
vLLM's fa_utils, which picks the version the FLASH_ATTN backend would), paged through the block
table: the same kernel and arguments vLLM's FLASH_ATTN backend runs for those rows."""

from __future__ import annotations

from ..core.kv_cache import KVPair
from ..core.prefill import fa3_descales, quantized_query


class VllmFlashAttentionPrefill:
    name = "vllm_flash_attn"

    def __init__(self):
        self._call = self._version = None

    def _kernel(self, head_dim: int):
        if self._call is None:
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

            self._call, self._version = flash_attn_varlen_func, get_flash_attn_version(head_size=head_dim)
        return self._call, self._version

    def __call__(self, q, cache: KVPair, out, rows, *, sm_scale, window_left=None, logits_soft_cap=None, sinks=None,
                 q_scale=None, k_scale=None, v_scale=None):
        call, version = self._kernel(q.shape[-1])
        fp8 = cache.k.element_size() == 1
        descales = fa3_descales(rows, cache.k.shape[2], q_scale, k_scale, v_scale) if fp8 else {}
        if fp8:  # 16-bit queries (FLASHJIT_VLLM_FP8_QUERIES off) are cast; e4m3 ones pass as they are
            q = quantized_query(q, cache.k.dtype, q_scale)
        call(q=q, k=cache.k, v=cache.v, out=out, cu_seqlens_q=rows.cu_seqlens_q, max_seqlen_q=rows.max_seqlen_q,
             seqused_k=rows.seqused_k, max_seqlen_k=rows.max_seqlen_k, softmax_scale=sm_scale, causal=True,
             window_size=[-1, -1] if window_left is None else [window_left, 0], block_table=rows.block_table,
             softcap=logits_soft_cap or 0.0, fa_version=version, s_aux=sinks, **descales)
        return out
