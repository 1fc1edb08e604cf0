"""The kinds of a mask's (or a variant's) runtime parameters: how CUDA spells each, and the ctypes type the host
passes it as.

A parameter reaches the decode kernel as a kernel parameter of its C type (and from there a field
of MaskParams), copied by cuLaunchKernel from a ctypes value of its kind; the two spellings live
side by side here so they cannot drift apart. The rendered kernel checks that each parameter's C
type has its ctypes value's size (flashjit.jit.abi_checks).
"""

from __future__ import annotations

import ctypes
import dataclasses


@dataclasses.dataclass(frozen=True)
class ParamKind:
    c_type: str       # the CUDA spelling, in MaskParams and the kernel's parameter list
    ctypes_type: type  # what the host fills and hands to cuLaunchKernel


PARAM_KINDS = {
    "int": ParamKind("int", ctypes.c_int),
    "float": ParamKind("float", ctypes.c_float),
    "int_tensor": ParamKind("const int* __restrict__", ctypes.c_void_p),  # a device pointer
    "float_tensor": ParamKind("const float* __restrict__", ctypes.c_void_p),  # a device pointer (variants' sinks)
}
TENSOR_KINDS = ("int_tensor", "float_tensor")
PARAM_CTYPES = {name: kind.c_type for name, kind in PARAM_KINDS.items()}             # kind -> C type
MASK_PARAM_CTYPES = {name: kind.ctypes_type for name, kind in PARAM_KINDS.items()}  # kind -> ctypes type
