"""Kernel families: the spec types the engine builds kernels for, and what each one's kernel needs.

A family is a spec class with its tiling function, its entry template and its ABI checks: the
decode kernels (DecodeSpec, tiling.decode_tiling, templates/decode/paged.cu.j2) and MLA decode
(MLASpec, mla_tiling.mla_tiling, templates/mla/decode.cu.j2). Every spec type has the same
surface the engine and the cache use (name, arch, mask, replace, to_dict, from_name), so the
engine stays one code path; this module is the one place that tells the families apart.
"""

from __future__ import annotations

from ..errors import SpecError
from .mla_spec import MLASpec
from .mla_tiling import mla_tiling
from .spec import DecodeSpec
from .tiling import decode_tiling

SPEC_TYPES = (DecodeSpec, MLASpec)


def tiling_of(spec):
    """The tiling a spec's kernel is rendered and launched with."""
    if isinstance(spec, MLASpec):
        return mla_tiling(spec)
    if isinstance(spec, DecodeSpec):
        return decode_tiling(spec)
    raise TypeError(f"not a kernel spec: {spec!r} (expected one of {', '.join(t.__name__ for t in SPEC_TYPES)})")


def spec_from_name(name: str):
    """The spec a name (spec.name) stands for, of whichever family the name's prefix says."""
    if not isinstance(name, str):
        raise SpecError("name", name, "a spec name such as decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc "
                                      "or mla_c512_r64_h128_bf16_kvbf16_p64_q1_sm90")
    return MLASpec.from_name(name) if MLASpec.looks_like(name) else DecodeSpec.from_name(name)
