"""Kernel families: the spec types the engine builds kernels for, and what each one's kernel needs.

A family is a spec class with its tiling, its source and its kernel object: decode kernels
(DecodeSpec: tiling.decode_tiling, templates/decode/paged.cu.j2, Kernel), MLA decode (MLASpec:
mla_tiling.mla_tiling, templates/mla/decode.cu.j2, Kernel) and merge_states (MergeSpec:
templates/merge/merge_states.cu.j2, MergeStatesKernel; no mask, variant or tiling). Every spec
type has the surface the engine and the cache use (name, arch, replace, to_dict, from_name), so
the engine stays one code path; this module is the one place that tells the families apart.
"""

from __future__ import annotations

from ..errors import SpecError
from ..masks.registry import masks
from ..masks.variants import variants
from .kernel import Kernel
from .merge_kernel import MergeStatesKernel
from .merge_spec import MergeSpec
from .mla_spec import MLASpec
from .mla_tiling import mla_tiling
from .render import render, render_merge_states
from .spec import DecodeSpec
from .tiling import decode_tiling

SPEC_TYPES = (DecodeSpec, MLASpec, MergeSpec)
MERGE_PREFIX = "merge_states_"


def _check(spec):
    if not isinstance(spec, SPEC_TYPES):
        raise TypeError(f"not a kernel spec: {spec!r} (expected one of {', '.join(t.__name__ for t in SPEC_TYPES)})")


def tiling_of(spec):
    """The tiling a spec's kernel is rendered and launched with; None for a MergeSpec."""
    _check(spec)
    if isinstance(spec, MLASpec):
        return mla_tiling(spec)
    return decode_tiling(spec) if isinstance(spec, DecodeSpec) else None


def mask_of(spec):
    """The MaskDef a spec renders with; None for a MergeSpec, which has none."""
    _check(spec)
    return None if isinstance(spec, MergeSpec) else masks.get(spec.mask)


def variant_of(spec):
    """The VariantDef a spec renders with (MLASpec: always "none"); None for a MergeSpec."""
    _check(spec)
    return None if isinstance(spec, MergeSpec) else variants.get(spec.variant)


def source_of(spec, mask, variant) -> str:
    """The rendered CUDA source of a spec, with the mask and variant mask_of/variant_of gave."""
    _check(spec)
    return render_merge_states(spec) if isinstance(spec, MergeSpec) else render(spec, mask, variant=variant)


def make_kernel(spec, mask, variant, cubin: bytes, key: str):
    """The kernel object of a compiled spec: a Kernel, or the MergeStatesKernel of a MergeSpec."""
    _check(spec)
    if isinstance(spec, MergeSpec):
        return MergeStatesKernel(spec, cubin, key)
    return Kernel(spec, tiling_of(spec), mask, cubin, key, variant)


def spec_from_name(name: str):
    """The spec a name (spec.name) stands for, of whichever family the name's prefix says."""
    if not isinstance(name, str):
        raise SpecError("name", name, "a spec name such as decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc, "
                                      "mla_c512_r64_h128_bf16_kvbf16_p64_q1_sm90 or merge_states_bf16_sm90")
    if name.strip().startswith(MERGE_PREFIX):
        return MergeSpec.from_name(name)
    return MLASpec.from_name(name) if MLASpec.looks_like(name) else DecodeSpec.from_name(name)
