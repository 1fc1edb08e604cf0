"""What a layer asks of its attention: the variant flashjit serves it with (soft cap, sinks), and
what flashjit does not do, refused by name before any state changes, so a model is never served
silently wrong."""

from __future__ import annotations

import typing

import torch

from ...kernels.decode.spec import HEAD_DIMS, MAX_GROUP_SIZE

FALLBACK_HINT = "load the model with attn_implementation='paged|sdpa' instead"


class UnsupportedAttention(NotImplementedError):
    """A layer needs an attention feature the flashjit adapter does not serve; names the feature."""

    def __init__(self, layer, feature: str, value):
        self.layer, self.feature, self.value = layer, feature, value
        super().__init__(f"flashjit's paged attention does not support {feature} (layer {layer}: {value!r}); "
                         f"{FALLBACK_HINT}")


class LayerVariant(typing.NamedTuple):
    """How a layer's scores become weights: Gemma 2's logit soft cap, gpt-oss's learned sinks."""

    softcap: float | None
    sinks: torch.Tensor | None  # the layer's parameter as given (one logit per query head)


def refuse_unsupported(module, query, key, value, dropout: float, kwargs: dict) -> LayerVariant:
    """The layer's soft cap and sinks (served by the kernels' variants); raises UnsupportedAttention
    for dropout, unequal q/v head dims, or heads and head_dim the kernels are not generated for
    (BatchDecode refuses other dtypes)."""
    layer = getattr(module, "layer_idx", None)
    softcap = kwargs.get("softcap")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise UnsupportedAttention(layer, "a soft cap that is not a float > 0", softcap)
    sinks = kwargs.get("s_aux", getattr(module, "sinks", None))
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != query.shape[1]):
        raise UnsupportedAttention(layer, f"sinks other than one logit per query head ({query.shape[1]})",
                                   tuple(getattr(sinks, "shape", ())))
    if dropout:
        raise UnsupportedAttention(layer, "attention dropout (training)", dropout)
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if key.shape[-1] != head_dim or v_head_dim != head_dim:
        raise UnsupportedAttention(layer, "different query, key and value head dims",
                                   (head_dim, key.shape[-1], v_head_dim))
    if head_dim not in HEAD_DIMS:
        raise UnsupportedAttention(layer, f"head_dim {head_dim} (generated for {HEAD_DIMS})", head_dim)
    qo_heads, kv_heads = query.shape[1], key.shape[1]
    if qo_heads % kv_heads or qo_heads // kv_heads > MAX_GROUP_SIZE:
        raise UnsupportedAttention(layer, f"{qo_heads} query heads over {kv_heads} KV heads (a whole GQA group "
                                   f"of at most {MAX_GROUP_SIZE})", (qo_heads, kv_heads))
    return LayerVariant(None if softcap is None else float(softcap), sinks)
