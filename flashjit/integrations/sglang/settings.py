"""What flashjit's SGLang backend serves: the settings of a model runner it reads (plain values,
gathered by backend.settings_of), each refused setting's reason, and the decoder's shape and layer
forms where nothing is refused. No SGLang import: the CPU tests check the reasons one by one."""

from __future__ import annotations

import dataclasses

from ...kernels.decode.spec import HEAD_DIMS, MAX_GROUP_SIZE, MAX_PAGE_SIZE
from .decoder import AttentionShape, LayerForm

NAME = "flashjit"
POOL_CLASS = "MHATokenToKVPool"
POOL_LAYOUTS = {"nhd": "NHD", "hnd": "HND"}
MODEL_DTYPES = ("bfloat16", "float16")
KV_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
PREFILL_BACKENDS = "fa3, flashinfer, triton, trtllm_mha"


@dataclasses.dataclass(frozen=True)
class LayerSettings:
    """One RadixAttention layer's settings, as SGLang names them."""

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    qk_head_dim: int
    v_head_dim: int
    scaling: float
    logit_cap: float = 0.0
    logit_capping_method: str = "tanh"
    sliding_window_size: int = -1
    is_cross_attention: bool = False
    attn_type: str = "decoder"
    use_irope: bool = False
    xai_temperature_len: int = -1


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """A model runner's settings the backend depends on (torch dtypes by name, without 'torch.')."""

    prefill_backend: str | None
    speculative_algorithm: str | None  # None: no speculative decoding
    use_mla: bool
    is_encoder_decoder: bool
    dcp_size: int
    pool_class: str
    pool_layout: str
    pool_quantized: bool
    model_dtype: str
    kv_dtype: str
    page_size: int
    layers: tuple[LayerSettings, ...]
    translated_ids: bool = False  # req_to_token holds virtual ids SGLang translates (a unified pool)


def refusals(s: RunnerSettings) -> list[str]:
    """Why the backend cannot serve these settings, one reason per refused setting (empty: it can)."""
    why = []
    if s.prefill_backend == NAME:
        why.append(f"--prefill-attention-backend (or --attention-backend alone) is {NAME}: flashjit serves decode "
                   f"batches; give the prefill batches another backend, e.g. --prefill-attention-backend fa3 "
                   f"(accepted: any other, such as {PREFILL_BACKENDS})")
    if s.speculative_algorithm is not None:
        why.append(f"--speculative-algorithm {s.speculative_algorithm}: flashjit's backend serves one new token "
                   "per request and step (accepted: no speculative decoding)")
    if s.use_mla:
        why.append("the model uses multi-head latent attention (MLA): this backend serves MHA, GQA and MQA models "
                   "(accepted: models SGLang serves with MHATokenToKVPool)")
    if s.is_encoder_decoder:
        why.append("an encoder-decoder model: cross-attention is not served (accepted: decoder-only models)")
    if s.dcp_size > 1:
        why.append(f"decode context parallelism (--dcp-size {s.dcp_size}): each rank's KV shard needs the "
                   "cross-rank merge, which this backend does not do (accepted: 1)")
    if s.pool_class != POOL_CLASS:
        why.append(f"KV pool {s.pool_class}: flashjit reads {POOL_CLASS} (separate K and V buffers per layer); "
                   "hybrid sliding-window pools, linear-attention hybrids and FP4/MXFP8 pools are not served "
                   "(accepted: " + POOL_CLASS + "; for sliding-window models --disable-hybrid-swa-memory)")
    elif s.pool_layout not in POOL_LAYOUTS:
        why.append(f"KV pool layout {s.pool_layout!r}: accepted {', '.join(POOL_LAYOUTS)} "
                   "(SGLANG_USE_HND_KVCACHE selects hnd)")
    if s.translated_ids:
        why.append("req_to_token holds virtual KV ids that SGLang translates to pool slots (a unified hybrid "
                   "allocator or a fused speculative draft): accepted plain pool slots, as MHATokenToKVPool's "
                   "token allocator hands them out")
    if s.pool_quantized:
        why.append("a quantized KV-cache recipe (packed data and scale buffers): accepted --kv-cache-dtype auto, "
                   "bf16, fp16, fp8_e4m3 or fp8_e5m2")
    if s.model_dtype not in MODEL_DTYPES:
        why.append(f"--dtype {s.model_dtype}: accepted {', '.join(MODEL_DTYPES)}")
    if s.kv_dtype not in KV_DTYPES:
        why.append(f"--kv-cache-dtype giving a {s.kv_dtype} pool: accepted auto (the model's 16-bit dtype), "
                   "fp8_e4m3, fp8_e5m2")
    if not 1 <= s.page_size <= MAX_PAGE_SIZE:
        why.append(f"--page-size {s.page_size}: accepted 1..{MAX_PAGE_SIZE}")
    if not s.layers:
        why.append("the model has no RadixAttention layer to serve")
    why += _layer_refusals(s.layers)
    return why


def _layer_refusals(layers) -> list[str]:
    """Reasons about the layers, each setting once with the layers it concerns."""
    checks = (
        (lambda l: l.qk_head_dim not in HEAD_DIMS,
         lambda l: f"head_dim {l.qk_head_dim}: accepted {', '.join(map(str, HEAD_DIMS))}"),
        (lambda l: l.v_head_dim != l.qk_head_dim,
         lambda l: f"value head_dim {l.v_head_dim} unlike the key's {l.qk_head_dim}: accepted equal head dims"),
        (lambda l: l.tp_q_head_num % max(l.tp_k_head_num, 1) or l.tp_k_head_num < 1
         or l.tp_q_head_num // l.tp_k_head_num > MAX_GROUP_SIZE,
         lambda l: f"{l.tp_q_head_num} query heads over {l.tp_k_head_num} KV heads (per rank): accepted a whole "
                   f"number of query heads per KV head, at most {MAX_GROUP_SIZE}"),
        (lambda l: l.is_cross_attention or l.attn_type != "decoder",
         lambda l: f"attention type {'cross' if l.is_cross_attention else l.attn_type}: accepted decoder "
                   "self-attention"),
        (lambda l: l.use_irope, lambda l: "chunked local attention (iRoPE): accepted full or sliding-window layers"),
        (lambda l: l.logit_cap > 0 and l.logit_capping_method != "tanh",
         lambda l: f"logit capping method {l.logit_capping_method!r}: accepted tanh"),
        (lambda l: l.xai_temperature_len != -1,
         lambda l: f"xai temperature scaling (length {l.xai_temperature_len}): accepted none"),
    )
    why = []
    for refused, reason in checks:
        hit = [l for l in layers if refused(l)]
        if hit:
            ids = ", ".join(str(l.layer_id) for l in hit[:8]) + (", ..." if len(hit) > 8 else "")
            why.append(f"layer(s) {ids}: {reason(hit[0])}")
    shapes = {(l.tp_q_head_num, l.tp_k_head_num, l.qk_head_dim) for l in layers}
    if len(shapes) > 1:
        why.append(f"layers of different head shapes (query heads, KV heads, head_dim) {sorted(shapes)}: accepted "
                   "one shape for every layer")
    return why


def attention_plan(s: RunnerSettings) -> tuple[AttentionShape, dict[int, LayerForm]]:
    """The decoder's shape and each layer's form (by layer_id), for settings refusals() accepts."""
    first = s.layers[0]
    shape = AttentionShape(first.tp_q_head_num, first.tp_k_head_num, first.qk_head_dim, q_dtype=s.model_dtype,
                           kv_dtype=s.kv_dtype, page_size=s.page_size, kv_layout=POOL_LAYOUTS[s.pool_layout])
    forms = {l.layer_id: LayerForm(sm_scale=float(l.scaling),
                                   window_left=l.sliding_window_size if l.sliding_window_size >= 0 else None,
                                   logit_cap=float(l.logit_cap) if l.logit_cap > 0 else None) for l in s.layers}
    return shape, forms
