"""The host<->CUDA argument ABI, checked at compile time: static_asserts generated from ctypes structs.

Each kernel family defines the ctypes structs its host fills (kernels/<family>/args.py; the work
list's PlanArgs in worklist/record.py) and the CUDA side is written by hand; render() pastes the
checks made here into the family's source: static_asserts of each struct's size and of every
field's offset, size and kind (pointer, integer, float), and of each mask or variant parameter's
size and kind (flashjit.masks.params). A field reordered, retyped, added or dropped on one side only
fails the NVRTC compile with a message naming it.
"""

from __future__ import annotations

import ctypes

from ..masks.params import MASK_PARAM_CTYPES

# How the messages name the host's layouts. It is part of every kernel source, and so of every cache
# key: it stays as it is wherever the structs live.
ABI_NAMESPACE = "flashjit.jit.abi"

# What a ctypes field type is on the CUDA side: fj_abi::kind<T>::value of the C type.
_KINDS = {ctypes.c_void_p: ("p", "pointer"), ctypes.c_int: ("i", "integer"), ctypes.c_int64: ("i", "integer"),
          ctypes.c_float: ("f", "float")}

# FJ_OFFSETOF(T, field): offsetof without <cstddef> (the prelude includes no headers); NVRTC
# before 13.4 has no __builtin_offsetof but folds EDG's __INTADDR__ to a constant.
# fj_abi::kind<T>::value: 'p' for a pointer (restrict-qualified or not), 'i' for int and long
# long, 'f' for float, '?' for anything else. Enums, not variables: the checks leave nothing in
# the cubin.
_PREAMBLE = """\
#ifdef __has_builtin
#if __has_builtin(__builtin_offsetof)
#define FJ_OFFSETOF(T, field) __builtin_offsetof(T, field)
#endif
#endif
#ifndef FJ_OFFSETOF
#define FJ_OFFSETOF(T, field) __INTADDR__(&((T*)0)->field)
#endif
namespace fj_abi {
template <class T> struct kind { enum { value = '?' }; };
template <class T> struct kind<T*> { enum { value = 'p' }; };
template <class T> struct kind<T* __restrict__> { enum { value = 'p' }; };
template <> struct kind<int> { enum { value = 'i' }; };
template <> struct kind<long long> { enum { value = 'i' }; };
template <> struct kind<float> { enum { value = 'f' }; };
}  // namespace fj_abi"""


def _field_assert(c_struct: str, name: str, offset: int | None, ctype, origin: str) -> str:
    letter, kind = _KINDS[ctype]
    size = ctypes.sizeof(ctype)
    member = f"{c_struct}::{name}"
    conditions = ([f"FJ_OFFSETOF({c_struct}, {name}) == {offset}"] if offset is not None else []) + [
        f"sizeof({member}) == {size}", f"fj_abi::kind<decltype({member})>::value == '{letter}'"]
    where = f"offset {offset}, " if offset is not None else ""
    return (f'static_assert({" && ".join(conditions)}, '
            f'"ABI: {member} is not {origin} ({where}{size} bytes, {kind})");')


def struct_asserts(struct: type[ctypes.Structure]) -> list[str]:
    """static_asserts that the CUDA struct struct._c_name_ has struct's size and, field by field,
    its offsets, sizes and kinds."""
    c_struct, origin = struct._c_name_, f"{ABI_NAMESPACE}.{struct.__name__}"
    size = ctypes.sizeof(struct)
    checks = [f'static_assert(sizeof({c_struct}) == {size}, "ABI: {c_struct} is not {size} bytes ({origin})");']
    for name, ctype in struct._fields_:
        checks.append(_field_assert(c_struct, name, getattr(struct, name).offset, ctype, f"{origin}.{name}"))
    return checks


def param_asserts(c_struct: str, params) -> list[str]:
    """static_asserts of a mask's or variant's runtime parameters (c_struct: MaskParams or
    VariantParams): each field of the type of the kernel parameter that fills it."""
    return [_field_assert(c_struct, p.name, None, MASK_PARAM_CTYPES[p.kind],
                          f"flashjit.masks.params.PARAM_KINDS['{p.kind}']") for p in params]


def source_checks(structs, extra=()) -> str:
    """The ABI checks of one kernel source: the structs field by field, then the extra asserts."""
    title = "layouts" if len(structs) > 1 else "layout"
    return "\n".join([f"// The host's argument {title} ({ABI_NAMESPACE}), checked field by field.", _PREAMBLE,
                      *(check for struct in structs for check in struct_asserts(struct)), *extra])
