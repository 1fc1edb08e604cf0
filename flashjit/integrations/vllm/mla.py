"""FLASHJIT_MLA: vLLM 0.33's MLA backend (DeepSeek-V3/R1, Kimi-K2) on flashjit's BatchDecodeMLA.

vLLM's MLA layer does the rest (the absorbed up-projections, prefill on its MLA prefill backend,
the latent cache writer); the backend serves the decode rows' MQA step (forward_mqa) over the
[blocks, block_size, 576] latent cache in place. The builder plans once per step for every layer
(rows of 1-4 query tokens: decodes and multi-token prediction), eager or on a graph decoder per
power of two of query tokens for vLLM's FULL decode graphs (UNIFORM_BATCH)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.attention.mla_attention import (MLACommonBackend, MLACommonDecodeMetadata,
                                                                MLACommonImpl, MLACommonMetadata,
                                                                MLACommonMetadataBuilder, QueryLenSupport)
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType

from ...kernels.mla.spec import MAX_Q_LEN
from ..core import FP8_CACHE_DTYPES, host_page_table
from ..core.mla import MLADecoders, MLAForm, latent_cache
from .builder import _read_seq_lens
from .checks import MLA_HEAD_SIZE, MLA_KV_CACHE_DTYPES, mla_refusal_reasons
from .declared import FlashJITDeclarations
from .registration import MLA_BACKEND_NAME


class FlashJITMLABackend(FlashJITDeclarations, MLACommonBackend):
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(MLA_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return MLA_BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return FlashJITMLAImpl

    @staticmethod
    def get_builder_cls():
        return FlashJITMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [MLA_HEAD_SIZE]

    @staticmethod
    def refusals(*, use_per_head_quant_scales: bool, **settings) -> list[str]:
        reasons = mla_refusal_reasons(**settings)
        if use_per_head_quant_scales:
            reasons.append("per-head quant scales: FLASHJIT_MLA takes one latent scale")
        return reasons


@dataclasses.dataclass
class FlashJITMLADecodeMetadata(MLACommonDecodeMetadata):
    decoders: dict = dataclasses.field(default_factory=dict)  # MLAForm -> its planned BatchDecodeMLA


class FlashJITMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    decoder_options: ClassVar[dict] = {}

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, metadata_cls=None):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls)
        if self.reorder_batch_threshold > MAX_Q_LEN:
            raise NotImplementedError(f"FLASHJIT_MLA serves rows of up to {MAX_Q_LEN} query tokens (1 + "
                                      f"num_speculative_tokens <= {MAX_Q_LEN}); this config needs "
                                      f"{self.reorder_batch_threshold}")
        speculative = vllm_config.speculative_config
        self.exact_host_lengths = speculative is None or not speculative.num_speculative_tokens
        self.block_size = kv_cache_spec.block_size
        q_dtype = vllm_config.model_config.dtype
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        forms = {layer.impl.mla_form(self.block_size, q_dtype) for layer in layers.values()
                 if isinstance(getattr(layer, "impl", None), FlashJITMLAImpl)}
        compilation = vllm_config.compilation_config
        self.graph_tokens = 0
        if compilation.cudagraph_mode is not None and compilation.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL:
            self.graph_tokens = compilation.max_cudagraph_capture_size or 0
        self.capture_sizes = sorted(compilation.cudagraph_capture_sizes or [])
        pages = -(-vllm_config.model_config.max_model_len // self.block_size)
        rows = min(self.graph_tokens, vllm_config.scheduler_config.max_num_seqs)
        self.page_ids = torch.zeros(rows * pages, dtype=torch.int32, device=device) if self.graph_tokens else None
        options = dict(self.decoder_options)
        self.decoders = {form: MLADecoders(form, device, max_decode_q_len=self.reorder_batch_threshold,
                                           page_ids_buffer=self.page_ids, **options) for form in forms}
        arch = options.get("arch")
        if arch is None and torch.device(device).type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"sm_{major}{minor}"
        if arch is not None:
            for decoders in self.decoders.values():
                decoders.prewarm(arch)
        self._step = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        self._step = common_attn_metadata  # _build_decode reads its host lengths and token count
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def _graph_size(self, num_tokens: int) -> int:
        return next((size for size in self.capture_sizes if size >= num_tokens), num_tokens)

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len, query_start_loc_cpu,
                      query_start_loc_device, num_decode_tokens, max_query_len, dcp_tot_seq_lens_device):
        m = self._step
        rows = block_table_tensor.shape[0]
        host = m.seq_lens_cpu_upper_bound if self.exact_host_lengths else None
        seq_cpu = host[:rows] if host is not None else _read_seq_lens(seq_lens_device)
        graph = bool(self.page_ids is not None and num_decode_tokens == m.num_actual_tokens
                     and num_decode_tokens <= self.graph_tokens)
        table = host_page_table(block_table_tensor, seq_cpu, query_start_loc_cpu, rows, self.block_size,
                                out_indices=self.page_ids if graph else None)
        tokens = self._graph_size(num_decode_tokens)
        planned = {form: (d.plan_graph(tokens, table) if graph else d.plan_eager(table))
                   for form, d in self.decoders.items()}
        return FlashJITMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                         dcp_tot_seq_lens=dcp_tot_seq_lens_device, decoders=planned)


class FlashJITMLAImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args):
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        refused = [name for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                                            ("logits_soft_cap", logits_soft_cap)) if value]
        if refused or attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"FLASHJIT_MLA does not serve {', '.join(refused) or attn_type}")
        self.supports_quant_query_input = False  # 16-bit queries over an fp8 latent cache

    def mla_form(self, block_size: int, q_dtype) -> MLAForm:
        fp8 = FP8_CACHE_DTYPES.get(self.kv_cache_dtype)
        kv_dtype = fp8 if fp8 is not None else (q_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype)
        return MLAForm(self.num_heads, block_size, q_dtype, kv_dtype, float(self.scale))

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        q_nope, q_pe = q if isinstance(q, tuple) else (q[..., : self.kv_lora_rank], q[..., self.kv_lora_rank:])
        form = self.mla_form(kv_c_and_k_pe_cache.shape[1], q_nope.dtype)
        decoder = attn_metadata.decode.decoders[form]
        cache = latent_cache(kv_c_and_k_pe_cache, self.kv_cache_dtype)
        out = q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], self.kv_lora_rank))
        lse = torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)
        decoder.run(q_nope, q_pe, cache, out=out, lse=lse, return_lse=True,
                    ckv_scale=layer._k_scale if form.kv_is_fp8 else None)
        return out, lse
