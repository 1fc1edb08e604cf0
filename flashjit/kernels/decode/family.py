"""The decode family (KernelFamily, jit/family.py): DecodeSpec kernels of any mask and variant,
rendered from templates/decode/entry.cu.j2 and loaded as work-list Kernels."""

from __future__ import annotations

from ...worklist import record
from ..family_base import WorklistFamily
from ..layouts import decode_layout_checks
from .args import abi_checks
from .spec import DecodeSpec
from .tiling import decode_tiling

ENTRY_TEMPLATE = "decode/entry.cu.j2"


class DecodeFamily(WorklistFamily):
    name = "decode"
    spec_type = DecodeSpec
    name_prefix = "decode_"
    example_name = "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc"
    entry_template = ENTRY_TEMPLATE
    tiling_for = staticmethod(decode_tiling)

    def abi_checks(self, spec, mask, variant, tiling) -> str:
        checks = abi_checks(mask.params, merge=not tiling.fused_merge, variant_params=variant.params)
        layouts = decode_layout_checks(spec, tiling)
        return checks + ("\n" + layouts if layouts else "")

    def extra_context(self) -> dict:
        return dict(merge_counts=record.MERGE_COUNTS, merge_waits=record.MERGE_WAITS)


DECODE = DecodeFamily()
