"""Manifests from HuggingFace `config.json` files: the kernels a model needs, read from the same
fields transformers reads.

    num_qo_heads  = num_attention_heads
    num_kv_heads  = num_key_value_heads (default: num_attention_heads, i.e. no GQA)
    head_dim      = head_dim, else hidden_size // num_attention_heads
    dtype         = torch_dtype (or `dtype`, its newer name); float32 checkpoints are served in bf16
    masks         = none and causal (plain decode, speculative decoding), plus sliding_window when
                    at least one layer attends through a window:
                      layer_types lists "sliding_attention"            (newer transformers configs)
                      use_sliding_window and max_window_layers < layers (Qwen2/2.5: the layers from
                                                                       max_window_layers on)
                      model_type "gemma2"                              (every other layer, from 0)
                      sliding_window_pattern = p                       (Gemma 3: every p-th layer is global)
                      sliding_window alone                             (Mistral: every layer)
Multimodal configs are read from their `text_config`. Fields a model type's config class fills in
by default (Gemma 3's head_dim, heads and window pattern, which Hub configs omit) are filled the
same way.     variant       = soft_cap when attn_logit_softcapping is set (Gemma 2, Grok-1: every layer), sinks
                    for model_type gpt_oss (a learned logit per query head on every layer), else none
The window's size, like sm_scale (Gemma's query_pre_attn_scalar), the soft cap and the sinks'
values, is a runtime BatchDecode.plan argument, not part of a kernel.
A config whose attention flashjit kernels cannot compute (ALiBi, chunked or linear attention
layers) is refused, never approximated; latent attention (kv_lora_rank) is refused here and read
by hf_mla.py, which derives MLA kernels instead.
Every problem raises ManifestError naming the file, the model and the config field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import SpecError
from .manifest import Manifest, ManifestError, ModelEntry
from ..kernels.decode.spec import HEAD_DIMS
from ..jit.dtypes import QUERY_DTYPES, normalize_dtype


# Defaults of transformers' config classes that the attention shape depends on: Hub configs leave
# out the fields equal to them (gemma-3-4b's text_config names neither heads nor head_dim).
MODEL_DEFAULTS = {
    "gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6},
}

SUPPORTED = ("flashjit kernels compute softmax attention with masks none, causal and sliding_window, soft-capped "
             "logits (soft_cap) and learned sinks (sinks)")
LAYER_TYPES = ("full_attention", "sliding_attention")
ALIBI_VERDICT = ("no built-in variant (a variant registered with register_variant can add the slopes in its logits "
                 "hook)")


@dataclasses.dataclass(frozen=True)
class HFAttention:
    """The attention shape of one model, as a config.json describes it."""

    name: str
    path: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str                      # canonical: bfloat16 or float16
    num_layers: int | None
    sliding_window: int | None      # tokens; None when no layer uses a window
    sliding_layers: int             # layers that attend through the window
    notes: tuple[str, ...] = ()     # what the operator should know (dtype fallbacks, unsupported features)
    logits_soft_cap: float | None = None  # attn_logit_softcapping (every layer)
    sinks: bool = False             # a learned sink logit per query head on every layer (gpt-oss)

    @property
    def variant(self) -> str:
        """The attention variant of every layer (flashjit.masks.variants)."""
        if self.logits_soft_cap and self.sinks:
            return "soft_cap_sinks"
        return "soft_cap" if self.logits_soft_cap else "sinks" if self.sinks else "none"

    @property
    def masks(self) -> tuple[str, ...]:
        return ("none", "causal") + (("sliding_window",) if self.sliding_layers else ())

    def model_entry(self, page_sizes=(16,), kv_dtype=None, max_q_lens=(1,), kv_layouts=("NHD",)) -> ModelEntry:
        return ModelEntry(name=self.name, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, dtype=self.dtype, kv_dtype=kv_dtype,
                          page_sizes=tuple(page_sizes), masks=self.masks, max_q_lens=tuple(max_q_lens),
                          kv_layouts=tuple(kv_layouts), variants=(self.variant,))

    def summary(self) -> str:
        text = (f"{self.name}: {self.num_qo_heads} query / {self.num_kv_heads} KV heads (group "
                f"{self.num_qo_heads // self.num_kv_heads}), head_dim {self.head_dim}, {self.dtype}")
        if self.sliding_layers:
            layers = f"{self.sliding_layers} of {self.num_layers}" if self.num_layers else "its"
            text += (f"; sliding window {self.sliding_window} on {layers} layers "
                     f"(plan those with mask='sliding_window', window_left={self.sliding_window - 1})")
        if self.logits_soft_cap:
            text += f"; soft-capped logits (plan with logits_soft_cap={self.logits_soft_cap})"
        if self.sinks:
            text += "; learned sinks per query head (plan with sinks=<the layer's self_attn.sinks, float32>)"
        return text


def config_path(path) -> Path:
    """A config.json, or a model folder holding one."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def read_hf_config(path, dtype=None) -> HFAttention:
    """Derive a model's attention shape from its config.json. `dtype` overrides torch_dtype."""
    path = config_path(path)
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise ManifestError(path, None, "<file>", f"cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ManifestError(path, None, "<file>", f"is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ManifestError(path, None, "<file>", "is not a JSON object")
    name = _model_name(config, path)
    fail = lambda field, problem: ManifestError(path, name, field, problem)  # noqa: E731
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        outer, config = config, dict(config["text_config"])  # multimodal: the language model's config
        for key in ("torch_dtype", "dtype"):
            config.setdefault(key, outer.get(key))
    config = {**MODEL_DEFAULTS.get(config.get("model_type"), {}), **config}
    refuse_unsupported(config, fail)
    notes = []

    heads = _positive_int(config, "num_attention_heads", fail)
    kv_heads = _positive_int(config, "num_key_value_heads", fail, default=heads)
    if heads % kv_heads:
        raise fail("num_key_value_heads", f"must divide num_attention_heads={heads} (GQA group size), got {kv_heads}")
    if config.get("head_dim") is not None:
        head_dim, field = _positive_int(config, "head_dim", fail), "head_dim"
    else:
        hidden = _positive_int(config, "hidden_size", fail)
        if hidden % heads:
            raise fail("hidden_size", f"{hidden} is not a multiple of num_attention_heads={heads}; "
                                      "the config needs a head_dim field")
        head_dim, field = hidden // heads, f"hidden_size {hidden} / num_attention_heads {heads}"
    if head_dim not in HEAD_DIMS:
        raise fail("head_dim", f"{head_dim} (from {field}) is not supported; flashjit kernels support head_dim "
                               + ", ".join(map(str, HEAD_DIMS)))

    if dtype is None:
        dtype = _config_dtype(config, notes)
    try:
        dtype = normalize_dtype(dtype)
    except SpecError as exc:
        raise fail("torch_dtype", f"{dtype!r} is not supported; accepted: {exc.accepted}") from None

    layers = config.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None
    window, sliding = _sliding_window(config, layers, notes)
    cap = config.get("attn_logit_softcapping")
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or not 0 <= cap < float("inf")):
        raise fail("attn_logit_softcapping", f"must be a positive number (or null/0: none), got {cap!r}")
    scalar = config.get("query_pre_attn_scalar")
    if isinstance(scalar, (int, float)) and scalar != head_dim:
        notes.append(f"query_pre_attn_scalar={scalar}: pass sm_scale={scalar}**-0.5 to BatchDecode.plan")
    return HFAttention(name, str(path), heads, kv_heads, head_dim, dtype, layers, window, sliding, tuple(notes),
                       float(cap) if cap else None, config.get("model_type") == "gpt_oss")


def manifest_from_hf_config(path, page_sizes=(16,), dtype=None, kv_dtype=None, max_q_lens=(1,),
                            kv_layouts=("NHD",), archs=()) -> Manifest:
    """A Manifest with one model, derived from a config.json; .specs(archs) expands it."""
    model = read_hf_config(path, dtype=dtype)
    return Manifest(model.path, tuple(archs), (model.model_entry(page_sizes, kv_dtype, max_q_lens, kv_layouts),))


def _model_name(config: dict, path: Path) -> str:
    named = config.get("_name_or_path")
    if isinstance(named, str) and named.strip():
        return named.rstrip("/").rsplit("/", 1)[-1]
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


def _positive_int(config: dict, key: str, fail, default=None) -> int:
    value = config.get(key, default)
    if value is None:
        raise fail(key, "is required")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise fail(key, f"must be a positive integer, got {value!r}")
    return value


def _config_dtype(config: dict, notes: list) -> str:
    value = config.get("torch_dtype") or config.get("dtype")
    if value is None:
        notes.append("no torch_dtype in the config: using bfloat16 (pass --dtype to choose)")
        return "bfloat16"
    text = str(value).lower().removeprefix("torch.")
    if text in ("float32", "fp32", "float"):
        notes.append(f"torch_dtype {value}: flashjit kernels take {' or '.join(QUERY_DTYPES)} queries; "
                     "using bfloat16, as servers do for float32 checkpoints (pass --dtype to choose)")
        return "bfloat16"
    return text


def _sliding_window(config: dict, layers: int | None, notes: list) -> tuple[int | None, int]:
    """(window, how many layers use it); (None, 0) when no layer attends through a window."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None, 0
    count = layers or 1  # Mistral: every layer
    if isinstance(config.get("layer_types"), list):  # refuse_unsupported checked its entries
        count = sum(kind == "sliding_attention" for kind in config["layer_types"])
    elif "use_sliding_window" in config:  # Qwen2/2.5: layers from max_window_layers on
        if not config["use_sliding_window"]:
            notes.append(f"sliding_window={window} is set but use_sliding_window is false: every layer attends "
                         "to the whole context")
            return None, 0
        first = config.get("max_window_layers") or 0
        count = max(0, layers - first) if layers else 1
    elif config.get("model_type") == "gemma2":  # layers 0, 2, 4, ... use the window
        count = (layers + 1) // 2 if layers else 1
    elif isinstance(config.get("sliding_window_pattern"), int) and config["sliding_window_pattern"] > 0:
        pattern = config["sliding_window_pattern"]  # Gemma 3: every pattern-th layer is global
        count = layers - layers // pattern if layers else 1
    if not count:
        notes.append(f"sliding_window={window} is set but no layer uses it")
        return None, 0
    return window, count


def refuse_unsupported(config: dict, fail) -> None:
    """Raise for the first config field whose attention flashjit kernels do not compute."""
    def refuse(field, feature, verdict="not supported"):
        raise fail(field, f"{config[field]!r}: {feature}; {verdict}: {SUPPORTED}")

    for field in ("alibi", "use_alibi"):
        if config.get(field):
            refuse(field, "ALiBi position biases on the scores", ALIBI_VERDICT)
    if config.get("position_embedding_type") == "alibi":
        refuse("position_embedding_type", "ALiBi position biases on the scores", ALIBI_VERDICT)
    if config.get("kv_lora_rank"):
        refuse("kv_lora_rank", "multi-head latent attention (DeepSeek V2/V3)")
    if config.get("attention_chunk_size"):
        refuse("attention_chunk_size", "chunked attention (Llama 4)")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(kind) for kind in layer_types if kind not in LAYER_TYPES})
        if other:
            raise fail("layer_types", f"layers of type {', '.join(map(repr, other))} are not supported; "
                                      f"layer_types may list {' and '.join(LAYER_TYPES)} ({SUPPORTED})")
