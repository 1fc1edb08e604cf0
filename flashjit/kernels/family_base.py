"""What the kernel families share (KernelFamily, jit/family.py): a spec type that parses its own
names, and for the work-list families (decode, MLA) a tiling, a mask and a variant from the registries,
one entry-template context and a work-list Kernel."""

from __future__ import annotations

from .._version import __version__
from ..jit.dtypes import STORAGE_TYPES
from ..jit.render import render_template
from ..masks.registry import masks
from ..masks.variants import variants
from ..worklist import record
from .worklist_kernel import Kernel


class SpecFamily:
    """A family named by its spec type: from_name is the spec type's own parser."""

    name: str
    spec_type: type
    name_prefix: str
    example_name: str

    def from_name(self, name: str):
        return self.spec_type.from_name(name)


class WorklistFamily(SpecFamily):
    """A family whose kernels run the work list: a tiling (tiling_for), the spec's mask and variant,
    and entry_template rendered with the work-list record sizes and the family's abi_checks."""

    entry_template: str

    @staticmethod
    def tiling_for(spec, table=None):
        raise NotImplementedError

    def abi_checks(self, spec, mask, variant, tiling) -> str:
        raise NotImplementedError

    def extra_context(self) -> dict:
        """Template values beyond the shared ones."""
        return {}

    def tiling(self, spec, table=None):
        return self.tiling_for(spec, table)

    def mask(self, spec):
        return masks.get(spec.mask)

    def variant(self, spec):
        return variants.get(spec.variant)

    def render(self, spec, mask=None, variant=None, tiling=None) -> str:
        mask = mask or self.mask(spec)
        variant = variant or self.variant(spec)
        tiling = tiling or self.tiling(spec)
        context = dict(spec=spec, tiling=tiling, mask=mask, variant=variant, ctype=STORAGE_TYPES, version=__version__,
                       item_ints=record.ITEM_INTS, split_candidates=record.SPLIT_CANDIDATES,
                       plan_smem_ints=record.PLAN_SMEM_INTS, abi_checks=self.abi_checks(spec, mask, variant, tiling),
                       **self.extra_context())
        return render_template(self.entry_template, context, spec, mask, variant)

    def kernel(self, spec, mask, variant, cubin: bytes, key: str) -> Kernel:
        return Kernel(spec, self.tiling(spec), mask, cubin, key, variant)
