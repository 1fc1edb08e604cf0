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
from pathlib import Path

from ..errors import SpecError
from ..jit.dtypes import QUERY_DTYPES, normalize_dtype
from ..kernels.decode.spec import HEAD_DIMS
from ..masks.variants import SOFT_CAP_RANGE
from .input_files import (ManifestError, bool_field, dict_field, int_field, load_json, number_field, printable,
                          quote, str_field, str_list_field)
from .manifest import Manifest, ModelEntry


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
    config = load_config(path)
    name = _model_name(config, path)
    fail = lambda field, problem: ManifestError(path, name, field, problem)  # noqa: E731
    text_config = dict_field(config, "text_config", fail)
    if "num_attention_heads" not in config and text_config is not None:
        outer, config = config, dict(text_config)  # multimodal: the language model's config
        for key in ("torch_dtype", "dtype"):
            config.setdefault(key, outer.get(key))
    config = {**MODEL_DEFAULTS.get(str_field(config, "model_type", fail), {}), **config}
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
        dtype = _config_dtype(config, notes, fail)
    try:
        dtype = normalize_dtype(dtype)
    except SpecError as exc:
        raise fail("torch_dtype", f"{quote(dtype)} is not supported; accepted: {exc.accepted}") from None

    layers = int_field(config, "num_hidden_layers", fail)
    window, sliding = _sliding_window(config, layers, notes, fail)
    cap, (low, high) = config.get("attn_logit_softcapping"), SOFT_CAP_RANGE
    if cap is not None and cap != 0 and not (isinstance(cap, (int, float)) and not isinstance(cap, bool)
                                              and low <= cap <= high):
        raise fail("attn_logit_softcapping", f"must be a number in {low:.3g}..{high:.3g} (or null/0: none), "
                                             f"got {quote(cap)}")
    scalar = number_field(config, "query_pre_attn_scalar", fail, minimum=1e-30)
    if scalar is not None and scalar != head_dim:
        notes.append(f"query_pre_attn_scalar={scalar:g}: pass sm_scale={scalar:g}**-0.5 to BatchDecode.plan")
    return HFAttention(name, str(path), heads, kv_heads, head_dim, dtype, layers, window, sliding, tuple(notes),
                       float(cap) if cap else None, config.get("model_type") == "gpt_oss")


def manifest_from_hf_config(path, page_sizes=(16,), dtype=None, kv_dtype=None, max_q_lens=(1,),
                            kv_layouts=("NHD",), archs=()) -> Manifest:
    """A Manifest with one model, derived from a config.json; .specs(archs) expands it."""
    model = read_hf_config(path, dtype=dtype)
    return Manifest(model.path, tuple(archs), (model.model_entry(page_sizes, kv_dtype, max_q_lens, kv_layouts),))


def load_config(path: Path) -> dict:
    """A config.json's top-level object (input_files.load_json: never blocks, one line per problem)."""
    config = load_json(path)
    if not isinstance(config, dict):
        raise ManifestError(path, None, "<file>", "is not a JSON object")
    return config


def _model_name(config: dict, path: Path) -> str:
    """The model's name (from _name_or_path, else the folder), control characters escaped."""
    named = config.get("_name_or_path")
    if named is not None and not isinstance(named, str):
        raise ManifestError(path, None, "_name_or_path", f"must be a string, got {quote(named)}")
    if named and named.strip():
        return printable(named.rstrip("/").rsplit("/", 1)[-1])
    return printable(path.parent.name if path.name == "config.json" and path.parent.name else path.stem)


def _positive_int(config: dict, key: str, fail, default=None) -> int:
    value = int_field(config, key, fail, default=default)
    if value is None:
        raise fail(key, "is required")
    return value


def _config_dtype(config: dict, notes: list, fail) -> str:
    value = str_field(config, "torch_dtype", fail) or str_field(config, "dtype", fail)
    if value is None:
        notes.append("no torch_dtype in the config: using bfloat16 (pass --dtype to choose)")
        return "bfloat16"
    text = str(value).lower().removeprefix("torch.")
    if text in ("float32", "fp32", "float"):
        notes.append(f"torch_dtype {value}: flashjit kernels take {' or '.join(QUERY_DTYPES)} queries; "
                     "using bfloat16, as servers do for float32 checkpoints (pass --dtype to choose)")
        return "bfloat16"
    return text


def _sliding_window(config: dict, layers: int | None, notes: list, fail) -> tuple[int | None, int]:
    """(window, how many layers use it); (None, 0) when no layer attends through a window."""
    window = int_field(config, "sliding_window", fail, minimum=0)
    layer_types = str_list_field(config, "layer_types", fail)
    use_window = bool_field(config, "use_sliding_window", fail)
    first = int_field(config, "max_window_layers", fail, minimum=0, default=0)
    pattern = int_field(config, "sliding_window_pattern", fail)
    if not window:
        return None, 0
    count = layers or 1  # Mistral: every layer
    if layer_types is not None:  # refuse_unsupported checked its entries
        count = sum(kind == "sliding_attention" for kind in layer_types)
    elif "use_sliding_window" in config:  # Qwen2/2.5: layers from max_window_layers on
        if not use_window:
            notes.append(f"sliding_window={window} is set but use_sliding_window is false: every layer attends "
                         "to the whole context")
            return None, 0
        count = max(0, layers - first) if layers else 1
    elif config.get("model_type") == "gemma2":  # layers 0, 2, 4, ... use the window
        count = (layers + 1) // 2 if layers else 1
    elif pattern is not None:  # Gemma 3: every pattern-th layer is global
        count = layers - layers // pattern if layers else 1
    if not count:
        notes.append(f"sliding_window={window} is set but no layer uses it")
        return None, 0
    return window, count


def refuse_unsupported(config: dict, fail) -> None:
    """Raise for the first config field whose attention flashjit kernels do not compute."""
    def refuse(field, feature, verdict="not supported"):
        raise fail(field, f"{quote(config[field])}: {feature}; {verdict}: {SUPPORTED}")

    for field in ("alibi", "use_alibi"):
        if config.get(field):
            refuse(field, "ALiBi position biases on the scores", ALIBI_VERDICT)
    if config.get("position_embedding_type") == "alibi":
        refuse("position_embedding_type", "ALiBi position biases on the scores", ALIBI_VERDICT)
    if config.get("kv_lora_rank"):
        refuse("kv_lora_rank", "multi-head latent attention (DeepSeek V2/V3)")
    if config.get("attention_chunk_size"):
        refuse("attention_chunk_size", "chunked attention (Llama 4)")
    layer_types = str_list_field(config, "layer_types", fail)
    other = sorted({kind for kind in layer_types or () if kind not in LAYER_TYPES})
    if other:
        raise fail("layer_types", f"layers of type {', '.join(map(quote, other[:4]))} are not supported; "
                                  f"layer_types may list {' and '.join(LAYER_TYPES)} ({SUPPORTED})")
