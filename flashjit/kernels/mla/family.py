"""The MLA family (KernelFamily, jit/family.py): MLASpec kernels, always causal and without a
variant, rendered from templates/mla/entry.cu.j2 and loaded as work-list Kernels."""

from __future__ import annotations

from ..._version import __version__
from ...jit.dtypes import STORAGE_TYPES
from ...jit.render import render_template
from ...masks.registry import masks
from ...masks.variants import variants
from ...worklist import record
from ..layouts import mla_layout_checks
from ..worklist_kernel import Kernel
from .args import abi_checks
from .spec import MLASpec
from .tiling import mla_tiling

ENTRY_TEMPLATE = "mla/entry.cu.j2"


class MLAFamily:
    name = "mla"
    spec_type = MLASpec
    name_prefix = "mla_"
    example_name = "mla_c512_r64_h128_bf16_kvbf16_p64_q1_sm90"

    def from_name(self, name: str) -> MLASpec:
        return MLASpec.from_name(name)

    def tiling(self, spec: MLASpec, table=None):
        return mla_tiling(spec, table)

    def mask(self, spec: MLASpec):
        return masks.get(spec.mask)

    def variant(self, spec: MLASpec):
        return variants.get(spec.variant)

    def render(self, spec: MLASpec, mask=None, variant=None, tiling=None) -> str:
        mask = mask or masks.get(spec.mask)
        variant = variant or variants.get(spec.variant)
        tiling = tiling or mla_tiling(spec)
        checks = abi_checks() + "\n" + mla_layout_checks(spec, tiling)
        context = dict(spec=spec, tiling=tiling, mask=mask, variant=variant, ctype=STORAGE_TYPES,
                       version=__version__, item_ints=record.ITEM_INTS, split_candidates=record.SPLIT_CANDIDATES,
                       plan_smem_ints=record.PLAN_SMEM_INTS, abi_checks=checks)
        return render_template(ENTRY_TEMPLATE, context, spec, mask, variant)

    def kernel(self, spec: MLASpec, mask, variant, cubin: bytes, key: str) -> Kernel:
        return Kernel(spec, mla_tiling(spec), mask, cubin, key, variant)


MLA = MLAFamily()
