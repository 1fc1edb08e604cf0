"""The merge_states family (KernelFamily, jit/family.py): one MergeSpec kernel per state dtype and
arch, without mask, variant or tiling, rendered from templates/merge_states/entry.cu.j2."""

from __future__ import annotations

from ..._version import __version__
from ...jit.render import render_template
from ..family_base import SpecFamily
from .args import abi_checks
from .kernel import MergeStatesKernel
from .spec import MAX_LANES, MergeSpec

ENTRY_TEMPLATE = "merge_states/entry.cu.j2"
STATE_TYPES = {"float16": "fj::half_t", "bfloat16": "fj::bfloat16_t", "float32": "float"}


class MergeStatesFamily(SpecFamily):
    name = "merge_states"
    spec_type = MergeSpec
    name_prefix = "merge_states_"
    example_name = "merge_states_bf16_sm90"

    def tiling(self, spec: MergeSpec, table=None):
        return None

    def mask(self, spec: MergeSpec):
        return None

    def variant(self, spec: MergeSpec):
        return None

    def render(self, spec: MergeSpec, mask=None, variant=None, tiling=None) -> str:
        context = dict(spec=spec, state_type=STATE_TYPES[spec.dtype], max_threads=max(128, MAX_LANES),
                       version=__version__, abi_checks=abi_checks())
        return render_template(ENTRY_TEMPLATE, context, spec)

    def kernel(self, spec: MergeSpec, mask, variant, cubin: bytes, key: str) -> MergeStatesKernel:
        return MergeStatesKernel(spec, cubin, key)


MERGE_STATES = MergeStatesFamily()
