"""register(): flashjit under a "paged|NAME" attention name in transformers' AttentionInterface."""

from __future__ import annotations

import functools
import inspect

from .attention import PagedAttention

# The continuous-batching APIs the adapter reads (cache_layout.py): transformers 5.17's flat
# per-layer caches with read_index / write_index in PagedAttentionCache.update, and 5.18's and later
# allocator-carved cache tensor with the indices passed through update(..., kwargs).
SUPPORTED_TRANSFORMERS = ">=5.17,<5.24"
OLDEST, NEWEST = (5, 17), (5, 23)
# From 5.19 on, "paged|" is dropped from implementation names, and the continuous-batching manager
# accepts only paged|eager, sdpa and flash implementations: register() lets it accept flashjit's too.
UNPREFIXED_FROM = (5, 19)


def transformers_version(transformers) -> tuple[int, int]:
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def paged_name(implementation: str) -> str:
    """transformers' own attention `implementation` ("sdpa", "flash_attention_2") under the name the
    installed release serves continuous batching with: "paged|" before it up to 5.18, bare from 5.19."""
    transformers = check_transformers_api()
    return f"paged|{implementation}" if transformers_version(transformers) < UNPREFIXED_FROM else implementation


def check_transformers_api():
    """The installed transformers module, when it is a release the adapter reads (5.17 through 5.23)
    and its PagedAttentionCache.update has one of the two forms; else an ImportError naming the
    installed version and the supported range."""
    try:
        import transformers
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
    except ImportError as e:
        raise ImportError(f"flashjit.integrations.transformers needs transformers{SUPPORTED_TRANSFORMERS} "
                          f"(pip install 'flashjit[transformers]'): {e}") from e
    version = transformers_version(transformers)
    update = set(inspect.signature(PagedAttentionCache.update).parameters)
    if not OLDEST <= version <= NEWEST or not ({"read_index", "write_index"} <= update or "kwargs" in update):
        raise ImportError(f"flashjit.integrations.transformers supports transformers{SUPPORTED_TRANSFORMERS}; "
                          f"transformers {transformers.__version__} is installed, with PagedAttentionCache."
                          f"update{inspect.signature(PagedAttentionCache.update)}")
    return transformers


def register(name: str = "fjit", **options) -> str:
    """Registers a PagedAttention(**options) as "paged|NAME" (transformers 5.17, 5.18) or "NAME"
    (5.19 on, which drops the prefix) and returns that name, for model.set_attn_implementation()
    or from_pretrained(attn_implementation=...). A model's generate_batch with that name raises the
    first exception the attention raised in transformers' generation thread (see _raise_from_generate_batch).

    The name must not contain "flash": transformers reads such names as FlashAttention variants
    (and looks for their kernels on the hub); "org/name" reads as a hub kernel."""
    if not isinstance(name, str) or not name or any(c in name for c in "|/:") or "flash" in name.lower():
        raise ValueError(f"name: expected a non-empty attention name without '|', '/', ':' or 'flash' (transformers "
                         f"reads names containing 'flash' as FlashAttention and 'org/name' as a hub kernel), got {name!r}")
    transformers = check_transformers_api()
    attention = PagedAttention(**options)
    if transformers_version(transformers) < UNPREFIXED_FROM:
        full_name = f"paged|{name}"
    else:
        full_name = name
        _accept_in_continuous_batching(full_name)
    _raise_from_generate_batch(full_name, attention)
    transformers.AttentionInterface.register(full_name, attention)
    return full_name


def _raise_from_generate_batch(name: str, attention: PagedAttention) -> None:
    """Make generate_batch raise what the attention registered as `name` raised.

    transformers runs the model in a background thread that catches every exception, logs it, fails
    the requests with its message and lets generate_batch return them with empty token lists; its
    continuous-batching API offers no hook to raise instead. So ContinuousMixin.generate_batch is
    wrapped once: for a model whose attention is one flashjit registered, it collects what that
    attention raises during the call, and raises the exception a failed request names (by its
    message: a warm-up failure transformers recovers from fails no request). Models on other
    attentions go straight to transformers' generate_batch."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    generate_batch = ContinuousMixin.generate_batch
    attentions = getattr(generate_batch, "flashjit_attentions", None)
    if attentions is None:
        attentions = {}

        @functools.wraps(generate_batch)
        def generate_batch_raising(self, *args, **kwargs):
            attention = attentions.get(getattr(self.config, "_attn_implementation", None))
            if attention is None:
                return generate_batch(self, *args, **kwargs)
            with attention.collect_errors() as raised:
                outputs = generate_batch(self, *args, **kwargs)
            for output in outputs.values():
                if output.error in raised:
                    raise raised[output.error]
            return outputs

        generate_batch_raising.flashjit_attentions = attentions
        ContinuousMixin.generate_batch = generate_batch_raising
    attentions[name] = attention


def _accept_in_continuous_batching(name: str) -> None:
    """Let transformers' continuous-batching manager keep `name` as the model's attention: it reads
    the paged cache itself, as paged|eager does. The manager's check of the implementation is wrapped
    once; the wrapper passes flashjit's registered names through and everything else to the check."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    check = ContinuousBatchingManager.switch_to_cb_friendly_attn
    names = getattr(check, "flashjit_names", None)
    if names is None:
        names = set()

        def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
            if model.config._attn_implementation in names:
                return None
            return check(self, model, *args, **kwargs)

        switch_to_cb_friendly_attn.flashjit_names = names
        switch_to_cb_friendly_attn.__doc__ = check.__doc__
        ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    names.add(name)
