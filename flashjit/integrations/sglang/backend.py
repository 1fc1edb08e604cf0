"""FlashJITAttnBackend: SGLang 0.5.23's AttentionBackend for decode batches, over PoolDecoder.

SGLang picks it with --decode-attention-backend flashjit; its HybridAttnBackend then sends DECODE
(and IDLE) batches here and EXTEND batches to the prefill backend. Construction checks the model
runner (settings.refusals: one reason per refused setting), reads each layer's form off the
model's RadixAttention layers and prewarms their kernels (FLASHJIT_NO_COMPILE=1: from the cache
or a bundle only).

Steps:
  * eager: init_forward_metadata plans the step on the host (PoolDecoder.plan);
  * CUDA graphs, in 0.5.23's contract: init_cuda_graph_state makes the fixed-capacity decoders
    (every captured batch size up to max_bs, any context length); init_forward_metadata_out_graph
    runs before each capture and each replay, outside the graph, and plans the batch SGLang
    padded to the graph's size into those decoders; the captured forward_decode's launches then
    read what that plan wrote. init_forward_metadata_in_graph has nothing to record.
forward_decode writes the step's K/V with the pool's own set_kv_buffer and runs the layer's plan
over the pool's buffers in place.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from .decoder import PoolDecoder, pages_per_request
from .settings import LayerSettings, RunnerSettings, attention_plan, refusals


class FlashJITAttnBackend(AttentionBackend):
    """flashjit decode attention for one SGLang model runner."""

    def __init__(self, model_runner, *, decoder_options: dict | None = None):
        super().__init__()
        settings = settings_of(model_runner)
        reasons = refusals(settings)
        if reasons:
            raise ValueError("flashjit's SGLang attention backend cannot serve this configuration:\n  - "
                             + "\n  - ".join(reasons))
        shape, self._form_of_layer = attention_plan(settings)
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.max_context_len = int(model_runner.model_config.context_len)
        self.decoder = PoolDecoder(shape, self._form_of_layer.values(), self.device, **(decoder_options or {}))
        self.decoder.prewarm()
        self.forward_metadata = None

    # ---- metadata -------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        """An eager step: planned on the host for every layer form."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        _check_decode(mode)
        bs = forward_batch.batch_size
        self.forward_metadata = self.decoder.plan(
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
            _host_lens(forward_batch, bs))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """The CUDA-graph decoders: batches of up to max_bs requests of up to the context length."""
        self.decoder.init_graphs(max_bs, pages_per_request(self.max_context_len, self.decoder.shape.page_size))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before a capture or a replay (outside the graph): the padded batch planned into the
        CUDA-graph decoders, whose captured launches read the plan's buffers."""
        _check_decode(forward_batch.forward_mode, idle_too=True)
        bs = forward_batch.batch_size
        self.forward_metadata = self.decoder.plan_graph(
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
            _host_lens(forward_batch, bs))

    def get_cuda_graph_seq_len_fill_value(self):
        return 1  # padding rows read one key (slot 0's), so every row of a captured batch has one

    # ---- forward --------------------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        _refuse_extras(kwargs)
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v,
                                                layer.k_scale, layer.v_scale)
        form = self._form_of_layer.get(layer.layer_id)
        if form is None:
            raise ValueError(f"layer {layer.layer_id}: flashjit's backend was built for the model's RadixAttention "
                             f"layers {sorted(self._form_of_layer)}, not this one")
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        out = self.decoder.run(self.forward_metadata, form, q.reshape(-1, heads, dim),
                               self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                               self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                               k_scale=layer.k_scale_float, v_scale=layer.v_scale_float)
        return out.view(-1, heads * dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise RuntimeError(f"flashjit's SGLang backend serves decode batches, not {forward_batch.forward_mode.name} "
                           "ones: give prefill another backend, --decode-attention-backend flashjit "
                           "--prefill-attention-backend fa3 (or flashinfer, triton)")


def _check_decode(mode, idle_too: bool = False):
    if not (mode.is_decode() or (idle_too and mode.is_idle())):
        raise RuntimeError(f"flashjit's SGLang backend plans decode batches, not {mode.name} ones (speculative "
                           "decoding and prefill belong to other backends)")


def _host_lens(forward_batch, bs: int):
    """seq_lens on the host: SGLang's copy when it made one (None: PoolDecoder reads them back)."""
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    return None if lens is None else lens[:bs]


def _refuse_extras(kwargs: dict):
    """Extra inputs that would change the attention (sinks, MLA's rope parts, an LSE): refused by name."""
    given = sorted(name for name, value in kwargs.items() if value is not None and value is not False)
    if given:
        raise ValueError(f"forward_decode: flashjit's SGLang backend takes q, k, v alone; got {', '.join(given)} "
                         "(attention sinks, MLA and returned LSEs are not served)")


def settings_of(model_runner) -> RunnerSettings:
    """The runner's settings settings.refusals() checks, read off SGLang's objects."""
    pool = model_runner.token_to_kv_pool
    server_args = model_runner.server_args
    spec = getattr(model_runner, "spec_algorithm", None)
    speculative = None if spec is None or spec.is_none() else getattr(spec, "name", str(spec))
    return RunnerSettings(
        prefill_backend=getattr(model_runner, "prefill_attention_backend_str", None),
        speculative_algorithm=speculative,
        use_mla=bool(model_runner.use_mla_backend),
        is_encoder_decoder=bool(getattr(model_runner.model_config, "is_encoder_decoder", False)),
        dcp_size=int(getattr(server_args, "dcp_size", 1) or 1),
        pool_class=type(pool).__name__,
        pool_layout=str(getattr(pool, "kv_cache_layout", "nhd")),
        pool_quantized=bool(getattr(pool, "is_quantized_kv_cache", False)),
        model_dtype=_dtype_name(model_runner.dtype),
        kv_dtype=_dtype_name(pool.dtype),
        page_size=int(model_runner.page_size),
        layers=tuple(layer_settings(model_runner.model)),
        translated_ids=bool(getattr(getattr(model_runner, "kv_index_translator", None), "is_translating", False)),
    )


def layer_settings(model):
    """LayerSettings of every RadixAttention layer of the model, in order."""
    for module in model.modules():
        if isinstance(module, RadixAttention):
            attn_type = getattr(module, "attn_type", None)
            yield LayerSettings(
                layer_id=int(module.layer_id), tp_q_head_num=int(module.tp_q_head_num),
                tp_k_head_num=int(module.tp_k_head_num), qk_head_dim=int(module.qk_head_dim),
                v_head_dim=int(module.v_head_dim), scaling=float(module.scaling),
                logit_cap=float(module.logit_cap or 0.0),
                logit_capping_method=str(getattr(module, "logit_capping_method", "tanh") or "tanh"),
                sliding_window_size=int(module.sliding_window_size),
                is_cross_attention=bool(module.is_cross_attention),
                attn_type=str(getattr(attn_type, "value", attn_type or "decoder")),
                use_irope=bool(getattr(module, "use_irope", False)),
                xai_temperature_len=int(getattr(module, "xai_temperature_len", -1)))


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
