"""FlashJITMetadataBuilder: one per KV-cache group, made by vLLM when it builds the model runner.

At construction it gathers its layers' DecodeForms and compiles (or loads) every kernel their plans
may pick, so no compile happens after vLLM's warm-up (vLLM's JIT monitor does not see NVRTC);
with FLASHJIT_NO_COMPILE=1 a kernel missing from flashjit's cache raises KernelNotPrewarmed
naming it. build() turns each step's CommonAttentionMetadata into a core.StepPlan that every
layer of the group reads.

Rows of up to `reorder_batch_threshold` query tokens (1 + speculative tokens, or
FLASHJIT_VLLM_DECODE_Q_LEN up to 16) come first (vLLM reorders the batch) and run on flashjit;
longer prefill rows run on vLLM's FlashAttention in the same forward. CUDA graphs: UNIFORM_BATCH,
and varlen decode graphs up to the threshold: a FULL graph holds decode rows only, and flashjit's
graph decoders re-plan for any composition up to the captured size (build() plans them before
each replay; with speculative decoding's device-only lengths, the GPU-planned ones on the GPU).
Mixed batches run vLLM's piecewise graphs, attention eager.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionCGSupport, AttentionMetadata, AttentionMetadataBuilder,
                                       CommonAttentionMetadata, max_decode_query_len)

from ... import env, validation
from ...kernels.decode.spec import MAX_Q_LEN
from ..core import StepPlan, StepPlanner
from .impl import FlashJITImpl


@dataclasses.dataclass
class FlashJITMetadata(AttentionMetadata):
    step: StepPlan
    num_actual_tokens: int
    slot_mapping: torch.Tensor


def decode_q_len(vllm_config) -> int:
    """Query tokens a request may have to run on flashjit: 1 + speculative tokens, or
    FLASHJIT_VLLM_DECODE_Q_LEN where larger (short prefill chunks then run on flashjit too)."""
    base = max_decode_query_len(vllm_config)
    if base > MAX_Q_LEN:
        validation.fail("1 + num_speculative_tokens", f"at most {MAX_Q_LEN} (query tokens flashjit's decode kernels "
                        "take)", base)
    return max(base, env.vllm_decode_q_len() or 1)


class FlashJITMetadataBuilder(AttentionMetadataBuilder[FlashJITMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: int = 1
    # BatchDecode keywords for tests without a GPU (arch, load_kernel, host_planner): the CPU planner paths.
    decoder_options: ClassVar[dict] = {}

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_varlen_cudagraph_max_query_len(cls, vllm_config, kv_cache_spec) -> int | None:
        return decode_q_len(vllm_config)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        threshold = decode_q_len(vllm_config)
        self._init_reorder_batch_threshold(threshold, supports_spec_as_decode=True)
        self.reorder_batch_threshold = threshold
        speculative = vllm_config.speculative_config
        self.exact_host_lengths = speculative is None or not speculative.num_speculative_tokens
        block_size = kv_cache_spec.block_size
        model = vllm_config.model_config
        model_dtype = model.dtype if model is not None else kv_cache_spec.dtype
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        forms = [layer.impl.form(block_size, model_dtype) for layer in layers.values()
                 if isinstance(getattr(layer, "impl", None), FlashJITImpl)]
        compilation = vllm_config.compilation_config
        graph_tokens = 0
        if compilation.cudagraph_mode is not None and compilation.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL:
            graph_tokens = compilation.max_cudagraph_capture_size or 0
        self.capture_sizes = sorted(compilation.cudagraph_capture_sizes or [])
        scheduler = vllm_config.scheduler_config
        max_len = model.max_model_len if model is not None else scheduler.max_num_batched_tokens
        max_pages = min(graph_tokens, scheduler.max_num_seqs) * -(-max_len // block_size)
        options = dict(self.decoder_options)
        self.planner = StepPlanner(forms, device, block_size=block_size, max_decode_q_len=threshold,
                                   max_graph_tokens=graph_tokens, max_pages=max_pages,
                                   share_prefixes=env.vllm_share_prefixes(), **options)
        arch = options.get("arch")
        if arch is None and torch.device(device).type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"sm_{major}{minor}"
        if arch is not None:
            self.planner.prewarm(arch)

    def _graph_size(self, num_tokens: int) -> int:
        """The captured size a step of num_tokens replays in: the smallest capture size that holds it."""
        for size in self.capture_sizes:
            if size >= num_tokens:
                return size
        return num_tokens

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashJITMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError(f"FLASHJIT serves causal attention; this step has causal={m.causal!r}")
        seq_lens_cpu = m.seq_lens_cpu_upper_bound if self.exact_host_lengths else None
        step = self.planner.plan(query_start_loc=m.query_start_loc, query_start_loc_cpu=m.query_start_loc_cpu,
                                 seq_lens=m.seq_lens, block_table=m.block_table_tensor, num_reqs=m.num_reqs,
                                 num_actual_tokens=m.num_actual_tokens, max_seq_len=m.max_seq_len,
                                 seq_lens_cpu=seq_lens_cpu, read_seq_lens=lambda: _read_seq_lens(m.seq_lens),
                                 graph_tokens_for=self._graph_size)
        return FlashJITMetadata(step, m.num_actual_tokens, m.slot_mapping)


def _read_seq_lens(seq_lens: torch.Tensor):
    """The exact key counts on the host (waits for the stream; vLLM's sync checker is told it is meant)."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    with gpu_sync_allowed():
        return seq_lens.cpu()
