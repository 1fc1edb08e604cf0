"""Kernel: the compiled module of a family whose kernels read the split-KV work list (decode, MLA).

Such a module holds the attend entry point (and, for decode plans with packed own items, a second
one), the separate merge where split requests are not merged in the attend kernel, and the GPU
planner (worklist/record.PLAN_ENTRY) that CUDA-graph mode launches. The family's tiling names them
(its `entries`); Kernel loads exactly those, on first use per device (jit/launch.py), sizes the GPU
planner's batch to the device's shared memory and reads the occupancy the host planner splits for.
"""

from __future__ import annotations

import dataclasses

from ..jit.arch import waits_for_previous_kernel
from ..jit.launch import (PerDevice, block_shared_optin, load_functions, multiprocessor_count, occupancy, on_device,
                          set_dynamic_shared_memory, static_shared_bytes)
from ..masks.registry import MaskDef
from ..masks.variants import VariantDef, variants
from ..worklist.record import PLAN_ENTRY, PLAN_MAX_BATCH, plan_batch_limit, plan_smem_bytes

MERGE_ENTRY = "flashjit_merge"


@dataclasses.dataclass(frozen=True)
class Entries:
    """The entry points of a work-list module besides the GPU planner."""

    attend: str                 # the attention kernel every plan launches
    packed: str | None = None   # the attention kernel of plans with packed own items (decode's shared prefixes)
    merge: str | None = None    # the separate merge of split requests (None: the attend kernel merges)


@dataclasses.dataclass
class LoadedKernel:
    """Driver handles of one spec's entry points on one device."""

    module: object  # the CuPy Module, kept alive for the process lifetime
    decode: int     # the attend entry point
    merge: int | None  # None where the attend kernel merges split requests itself (tiling.fused_merge)
    ctas_per_sm: int
    num_sms: int
    plan: int | None = None  # the GPU planner (CUDA-graph mode), in every work-list module
    plan_max_batch: int = PLAN_MAX_BATCH  # the most requests its shared memory holds on this device
    decode_packed: int | None = None  # Entries.packed: the attend kernel of plans with packed own items


def planner_batch_limit(plan: int, device_index: int) -> int:
    """The most requests the loaded GPU planner `plan` takes on the device: what the device's opt-in
    shared memory per block holds beside the planner's static arrays (record.plan_batch_limit)."""
    return plan_batch_limit(block_shared_optin(device_index), static_shared_bytes(plan))


class Kernel:
    """One compiled work-list specialization. Cheap to create; loads on first use per device."""

    def __init__(self, spec, tiling, mask: MaskDef, cubin: bytes, key: str, variant: VariantDef | None = None):
        self.spec, self.tiling, self.mask, self.cubin, self.key = spec, tiling, mask, cubin, key
        self.variant = variants.get(spec.variant) if variant is None else variant
        self.programmatic_launch = waits_for_previous_kernel(spec.arch)  # PreparedLaunch's programmatic
        self._devices = PerDevice(self._load)

    def __repr__(self):
        return f"Kernel({self.spec.name}, key={self.key[:12]})"

    def loaded(self, device_index: int) -> LoadedKernel:
        return self._devices.get(device_index)

    def _load(self, device_index: int) -> LoadedKernel:
        entries: Entries = self.tiling.entries
        names = [entries.attend, PLAN_ENTRY] + [name for name in (entries.packed, entries.merge) if name]
        module, handles = load_functions(
            self.cubin, device_index, names, self.spec.name, self.spec.arch,
            "run one plan()/run() (or engine.get_kernel(spec).loaded(device)) before capturing")
        found = dict(zip(names, handles))
        attend, plan = found[entries.attend], found[PLAN_ENTRY]
        packed, merge = found.get(entries.packed), found.get(entries.merge)
        smem = self.tiling.smem_bytes
        launched = (attend,) if packed is None else (attend, packed)
        with on_device(device_index):
            plan_max_batch = planner_batch_limit(plan, device_index)
            set_dynamic_shared_memory([plan], plan_smem_bytes(plan_max_batch), "cuFuncSetAttribute")
            set_dynamic_shared_memory(launched, smem, f"cuFuncSetAttribute ({self.spec.name}'s {smem} bytes of "
                                                      f"shared memory on cuda:{device_index})")
        ctas_per_sm = min(occupancy(function, self.tiling.threads, smem) for function in launched)
        return LoadedKernel(module, attend, merge, max(1, ctas_per_sm), multiprocessor_count(device_index), plan,
                            plan_max_batch, packed)
