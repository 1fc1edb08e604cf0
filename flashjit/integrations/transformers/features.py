"""What a layer asks of its attention that flashjit does not do: each is refused by name, before
any state changes, so a model is never served silently wrong."""

from __future__ import annotations

from ...kernels.decode.spec import HEAD_DIMS, MAX_GROUP_SIZE

FALLBACK_HINT = "load the model with attn_implementation='paged|sdpa' instead"


class UnsupportedAttention(NotImplementedError):
    """A layer needs an attention feature the flashjit adapter does not serve; names the feature."""

    def __init__(self, layer, feature: str, value):
        self.layer, self.feature, self.value = layer, feature, value
        super().__init__(f"flashjit's paged attention does not support {feature} (layer {layer}: {value!r}); "
                         f"{FALLBACK_HINT}")


def refuse_unsupported(module, query, key, value, dropout: float, kwargs: dict) -> None:
    """Raises UnsupportedAttention for soft-capping, learned sinks, dropout, unequal q/v head dims,
    or heads and head_dim the kernels are not generated for (BatchDecode refuses other dtypes)."""
    layer = getattr(module, "layer_idx", None)
    if kwargs.get("softcap") is not None:
        raise UnsupportedAttention(layer, "attention logit soft-capping (softcap)", kwargs["softcap"])
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        sinks = kwargs.get("s_aux", getattr(module, "sinks", None))
        raise UnsupportedAttention(layer, "learned attention sinks (s_aux)", tuple(getattr(sinks, "shape", ())))
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
