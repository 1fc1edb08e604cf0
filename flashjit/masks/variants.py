"""Variant registry: name -> VariantDef (template, runtime parameters, torch references).

A mask decides which keys a query sees; a variant decides how the scores of the visible keys
become weights. A variant is a Jinja2 template that extends ``variants/base.cuh.j2`` and fills
one or both of its hooks: ``logits`` (a visible score in natural units, transformed: soft-capping)
and ``sink`` (a logit per query head that joins the softmax's denominator, never its output).
Every variant composes with every mask: a kernel is one mask and one variant (DecodeSpec.mask,
DecodeSpec.variant). Built-ins live in ``templates/variants``; users add variants with
``register_variant``, which never needs a change to the engine (docs/masks.md, "Variants").
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Callable, Iterable

from ..errors import SpecError
from ..validation import did_you_mean
from .registry import MaskParam, _parse_params, masks


@dataclasses.dataclass(frozen=True)
class VariantDef:
    """What the engine, plan() and the reference need to know about one variant.

    template: the Jinja2 name the loader resolves (built-ins) or an absolute file path (user variants).
    logits: (scores, q_pos, kv_pos, heads, params) -> scores, the torch version of the template's
        logits hook: scores [heads, q_len, kv_len] float in natural units, q_pos [q_len, 1] and
        kv_pos [1, kv_len] int64 positions, heads [heads, 1, 1] the query heads. None: identity.
    sink: (heads, params) -> float tensor of one sink logit per entry of heads (an int64 tensor of
        query heads), the torch version of the sink hook. None: no sink.
    check: (params, num_qo_heads) -> None, raising ValueError naming a parameter the batch cannot
        use (a sinks tensor of the wrong length). Runs in plan(), after the kinds are checked.
    sample_params: (rng, num_qo_heads, device) -> variant_params for a random batch (check-mask and
        the GPU tests). Needed for variants with tensor parameters.
    """

    name: str
    template: str
    params: tuple[MaskParam, ...] = ()
    logits: Callable | None = None
    sink: Callable | None = None
    check: Callable | None = None
    sample_params: Callable | None = None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


class VariantRegistry:
    """Thread-safe name -> VariantDef map."""

    def __init__(self):
        self._variants: dict[str, VariantDef] = {}
        self._lock = threading.Lock()

    def register(self, name: str, template, params=None, *, logits=None, sink=None, check=None,
                 sample_params=None, replace: bool = False) -> VariantDef:
        if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
            raise SpecError("variant", name, "a C identifier such as 'my_variant'")
        template = str(template)
        if os.path.isabs(template) and not os.path.isfile(template):
            raise SpecError("variant template", template, "an existing template file")
        variant = VariantDef(name, template, _parse_params(params), logits, sink, check, sample_params)
        with self._lock:
            if name in self._variants and not replace and self._variants[name] != variant:
                raise SpecError("variant", name, "a name not registered yet (pass replace=True to override)")
            self._variants[name] = variant
            # One generation for masks and variants: plan()'s setups and the engine's kernels
            # remember it, and a variant registered anew must reach them as a mask would.
            masks.generation += 1
        return variant

    def get(self, name: str) -> VariantDef:
        variant = self._variants.get(name)
        if variant is None:
            raise SpecError("variant", name, ", ".join(sorted(self._variants)) + " (or one added with register_variant)"
                            + did_you_mean(name, self._variants))
        return variant

    def names(self) -> Iterable[str]:
        return list(self._variants)

    def is_template_file(self, path) -> bool:
        """Whether ``path`` (links resolved) is the template file of a registered variant."""
        real = os.path.realpath(path)
        with self._lock:
            files = [v.template for v in self._variants.values() if os.path.isabs(v.template)]
        return any(os.path.realpath(file) == real for file in files)

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self._variants


# ---- built-in variants ------------------------------------------------------------------------

def _soft_cap_logits(scores, q_pos, kv_pos, heads, params):
    import torch

    cap = float(params["logits_soft_cap"])
    return cap * torch.tanh(scores / cap)


def _sinks_sink(heads, params):
    return params["sinks"].to(heads.device).float()[heads]


# The caps the kernel computes cap * tanh(score * (1 / cap)) with exactly, flushing subnormals to 0:
# from the smallest normal float32 (a smaller cap has no finite reciprocal: NaN scores) to 2**64
# (beyond, scores below cap * 2**-126 flush to 0 in the product, 2**-62 and more at the bound;
# tanh is the identity at that scale anyway).
SOFT_CAP_RANGE = (2.0**-126, 2.0**64)


def _check_soft_cap(params, num_qo_heads):
    cap, (low, high) = params["logits_soft_cap"], SOFT_CAP_RANGE
    if not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and low <= cap <= high):
        raise ValueError(f"variant param logits_soft_cap: expected a float in {low:.3g}..{high:.3g} (its reciprocal "
                         f"a normal float32; 0 or None: no capping), got {cap!r}")


def _check_sinks(params, num_qo_heads):
    sinks = params["sinks"]
    if sinks.numel() != num_qo_heads:
        raise ValueError(f"variant param sinks: expected one float32 logit per query head ({num_qo_heads}), "
                         f"got {sinks.numel()} values")


def _check_soft_cap_sinks(params, num_qo_heads):
    _check_soft_cap(params, num_qo_heads)
    _check_sinks(params, num_qo_heads)


def _sample_soft_cap(rng, num_qo_heads, device):
    return {"logits_soft_cap": rng.choice([0.5, 2.0, 30.0, 50.0])}  # small caps bend every score


def _sample_sinks(rng, num_qo_heads, device):
    """Sinks from far below the scores to far above them, so the sink weighs 0 to nearly all."""
    import torch

    values = [rng.choice([-30.0, -2.0, 0.0, 0.5, 3.0, 12.0]) + rng.random() for _ in range(num_qo_heads)]
    return {"sinks": torch.tensor(values, dtype=torch.float32, device=device)}


def _sample_soft_cap_sinks(rng, num_qo_heads, device):
    return {**_sample_soft_cap(rng, num_qo_heads, device), **_sample_sinks(rng, num_qo_heads, device)}


SOFT_CAP = {"logits_soft_cap": "float"}
SINKS = {"sinks": "float_tensor"}

variants = VariantRegistry()
variants.register("none", "variants/none.cuh.j2")
variants.register("soft_cap", "variants/soft_cap.cuh.j2", SOFT_CAP, logits=_soft_cap_logits, check=_check_soft_cap,
                  sample_params=_sample_soft_cap)
variants.register("sinks", "variants/sinks.cuh.j2", SINKS, sink=_sinks_sink, check=_check_sinks,
                  sample_params=_sample_sinks)
variants.register("soft_cap_sinks", "variants/soft_cap_sinks.cuh.j2", {**SOFT_CAP, **SINKS}, logits=_soft_cap_logits,
                  sink=_sinks_sink, check=_check_soft_cap_sinks, sample_params=_sample_soft_cap_sinks)


def register_variant(name: str, template, params=None, *, logits=None, sink=None, check=None, sample_params=None,
                     replace: bool = False) -> VariantDef:
    """Add a variant: a template file extending variants/base.cuh.j2, plus its runtime params.

    ``params`` maps parameter names to kinds ('int', 'float', 'int_tensor', 'float_tensor').
    logits, sink, check and sample_params are described on VariantDef and in docs/masks.md.
    """
    path = Path(template).expanduser().resolve()
    if not path.is_file():
        raise SpecError("template", str(template), "an existing .cuh.j2 file")
    return variants.register(name, path, params, logits=logits, sink=sink, check=check, sample_params=sample_params,
                             replace=replace)
