"""The decode family (KernelFamily, jit/family.py): DecodeSpec kernels of any mask and variant,
rendered from templates/decode/entry.cu.j2 and loaded as work-list Kernels."""

from __future__ import annotations

from ..._version import __version__
from ...jit.dtypes import STORAGE_TYPES
from ...jit.render import render_template
from ...masks.registry import masks
from ...masks.variants import variants
from ...worklist import record
from ..layouts import decode_layout_checks
from ..worklist_kernel import Kernel
from .args import abi_checks
from .spec import DecodeSpec
from .tiling import decode_tiling

ENTRY_TEMPLATE = "decode/entry.cu.j2"


class DecodeFamily:
    name = "decode"
    spec_type = DecodeSpec
    name_prefix = "decode_"
    example_name = "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc"

    def from_name(self, name: str) -> DecodeSpec:
        return DecodeSpec.from_name(name)

    def tiling(self, spec: DecodeSpec, table=None):
        return decode_tiling(spec, table)

    def mask(self, spec: DecodeSpec):
        return masks.get(spec.mask)

    def variant(self, spec: DecodeSpec):
        return variants.get(spec.variant)

    def render(self, spec: DecodeSpec, mask=None, variant=None, tiling=None) -> str:
        mask = mask or masks.get(spec.mask)
        variant = variant or variants.get(spec.variant)
        tiling = tiling or decode_tiling(spec)
        checks = abi_checks(mask.params, merge=not tiling.fused_merge, variant_params=variant.params)
        layouts = decode_layout_checks(spec, tiling)
        checks += "\n" + layouts if layouts else ""
        context = dict(spec=spec, tiling=tiling, mask=mask, variant=variant, ctype=STORAGE_TYPES, version=__version__,
                       item_ints=record.ITEM_INTS, merge_counts=record.MERGE_COUNTS, merge_waits=record.MERGE_WAITS,
                       split_candidates=record.SPLIT_CANDIDATES, plan_smem_ints=record.PLAN_SMEM_INTS,
                       abi_checks=checks)
        return render_template(ENTRY_TEMPLATE, context, spec, mask, variant)

    def kernel(self, spec: DecodeSpec, mask, variant, cubin: bytes, key: str) -> Kernel:
        return Kernel(spec, decode_tiling(spec), mask, cubin, key, variant)


DECODE = DecodeFamily()
