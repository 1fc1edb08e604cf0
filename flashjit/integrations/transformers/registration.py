"""register(): flashjit under a "paged|NAME" attention name in transformers' AttentionInterface."""

from __future__ import annotations

import inspect

from .attention import PagedAttention

# The continuous-batching API the adapter reads (PagedAttentionCache's flat per-layer caches,
# read_index / write_index lists per layer group): transformers 5.17. Later 5.x releases pack the
# layers of a block into one tensor and pass the indices through cache.update(kwargs) instead.
SUPPORTED_TRANSFORMERS = ">=5.17,<5.18"


def check_transformers_api():
    """The installed transformers module, when its continuous batching has the 5.17 form; else an
    ImportError naming the installed version and the supported range."""
    try:
        import transformers
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
    except ImportError as e:
        raise ImportError(f"flashjit.integrations.transformers needs transformers{SUPPORTED_TRANSFORMERS} "
                          f"(pip install 'flashjit[transformers]'): {e}") from e
    update = inspect.signature(PagedAttentionCache.update).parameters
    if not {"read_index", "write_index"} <= set(update):
        raise ImportError(f"flashjit.integrations.transformers supports transformers{SUPPORTED_TRANSFORMERS}, whose "
                          f"PagedAttentionCache.update takes read_index and write_index; transformers "
                          f"{transformers.__version__} has update{inspect.signature(PagedAttentionCache.update)}")
    return transformers


def register(name: str = "fjit", **options) -> str:
    """Registers a PagedAttention(**options) as "paged|NAME" and returns that name, for
    model.set_attn_implementation() or from_pretrained(attn_implementation=...).

    The name must not contain "flash": transformers reads such names as FlashAttention variants
    (and looks for their kernels on the hub); "org/name" reads as a hub kernel."""
    if not isinstance(name, str) or not name or any(c in name for c in "|/:") or "flash" in name.lower():
        raise ValueError(f"name: expected a non-empty attention name without '|', '/', ':' or 'flash' (transformers "
                         f"reads names containing 'flash' as FlashAttention and 'org/name' as a hub kernel), got {name!r}")
    transformers = check_transformers_api()
    full_name = f"paged|{name}"
    transformers.AttentionInterface.register(full_name, PagedAttention(**options))
    return full_name
