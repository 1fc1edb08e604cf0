"""Kernel families: what the engine needs of each kind of kernel it builds, and the registry of them.

A family (decode, MLA, merge_states: flashjit/kernels/<family>/) is a spec type with its tiling,
its source and its kernel object. The engine, the renderer and the CLI go through this protocol and
never name a family, so a new family is its own folders plus one registration line
(flashjit/kernels/__init__.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..errors import SpecError


@runtime_checkable
class KernelFamily(Protocol):
    """A kind of kernel: its spec type and what a spec of it renders, compiles and loads as."""

    name: str           # "decode", "mla", "merge_states"
    spec_type: type     # the frozen dataclass of its specs (name, arch, compile_arch, replace, to_dict)
    name_prefix: str    # every spec name of the family starts with it ("decode_")
    example_name: str   # a spec name, for messages

    def from_name(self, name: str):
        """The spec a name (spec.name) stands for."""

    def tiling(self, spec, table=None):
        """The tiling a spec's kernel is rendered and launched with (under a tuning table; None:
        the family's own), or None for a family without one."""

    def mask(self, spec):
        """The MaskDef the spec renders with, or None for a family without masks."""

    def variant(self, spec):
        """The VariantDef the spec renders with, or None for a family without variants."""

    def render(self, spec, mask=None, variant=None, tiling=None) -> str:
        """The spec's CUDA source (mask, variant and tiling: the spec's own where None)."""

    def kernel(self, spec, mask, variant, cubin: bytes, key: str):
        """The kernel object of a compiled spec, which loads its entry points per device."""


_families: list[KernelFamily] = []
_by_type: dict[type, KernelFamily] = {}


def register_family(family: KernelFamily) -> KernelFamily:
    """Add a family; its spec type, name and name prefix must be new."""
    if not isinstance(family, KernelFamily):
        raise TypeError(f"not a KernelFamily: {family!r} (it needs {', '.join(_protocol_members())})")
    for other in _families:
        if family.spec_type is other.spec_type or family.name == other.name or (
                family.name_prefix.startswith(other.name_prefix) or other.name_prefix.startswith(family.name_prefix)):
            raise ValueError(f"kernel family {family.name!r} clashes with {other.name!r} (spec type, name or name prefix)")
    _families.append(family)
    _by_type[family.spec_type] = family
    return family


def _protocol_members() -> list[str]:
    return sorted(name for name in vars(KernelFamily) if not name.startswith("_"))


def families() -> tuple[KernelFamily, ...]:
    return tuple(_families)


def family_of(spec) -> KernelFamily:
    """The family of a spec; TypeError for anything that is not a registered family's spec."""
    family = _by_type.get(type(spec))
    if family is None:
        raise TypeError(f"not a kernel spec: {spec!r} "
                        f"(expected one of {', '.join(f.spec_type.__name__ for f in _families)})")
    return family


def _examples() -> str:
    names = [f.example_name for f in _families]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def spec_from_name(name: str):
    """The spec a name (spec.name) stands for, of whichever family the name's prefix says."""
    if not isinstance(name, str):
        raise SpecError("name", name, f"a spec name such as {_examples()}")
    for family in _families:
        if name.strip().startswith(family.name_prefix):
            return family.from_name(name)
    raise SpecError("name", name, f"names like {_examples()}")


def tiling_of(spec):
    """The tiling a spec's kernel is rendered and launched with; None for a family without one."""
    return family_of(spec).tiling(spec)


def mask_of(spec):
    """The MaskDef a spec renders with; None for a family without masks (merge_states)."""
    return family_of(spec).mask(spec)


def variant_of(spec):
    """The VariantDef a spec renders with; None for a family without variants (merge_states)."""
    return family_of(spec).variant(spec)


def source_of(spec, mask, variant) -> str:
    """The rendered CUDA source of a spec, with the mask and variant mask_of/variant_of gave."""
    return family_of(spec).render(spec, mask, variant)


def make_kernel(spec, mask, variant, cubin: bytes, key: str):
    """The kernel object of a compiled spec."""
    return family_of(spec).kernel(spec, mask, variant, cubin, key)
