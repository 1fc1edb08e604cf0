"""The MLA family (KernelFamily, jit/family.py): MLASpec kernels, always causal and without a
variant, rendered from templates/mla/entry.cu.j2 and loaded as work-list Kernels."""

from __future__ import annotations

from ..family_base import WorklistFamily
from ..layouts import mla_layout_checks
from .args import abi_checks
from .spec import MLASpec
from .tiling import mla_tiling

ENTRY_TEMPLATE = "mla/entry.cu.j2"


class MLAFamily(WorklistFamily):
    name = "mla"
    spec_type = MLASpec
    name_prefix = "mla_"
    example_name = "mla_c512_r64_h128_bf16_kvbf16_p64_q1_sm90"
    entry_template = ENTRY_TEMPLATE
    tiling_for = staticmethod(mla_tiling)

    def abi_checks(self, spec, mask, variant, tiling) -> str:
        return abi_checks() + "\n" + mla_layout_checks(spec, tiling)


MLA = MLAFamily()
