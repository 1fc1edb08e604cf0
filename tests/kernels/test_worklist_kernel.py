"""A work-list Kernel loads exactly the entry points its family's tiling names, and the GPU planner,
with the driver calls replaced by fakes that record what was asked (no GPU needed)."""

from __future__ import annotations

import contextlib

import pytest

from flashjit import DecodeSpec, MLASpec
from flashjit.jit.family import tiling_of
from flashjit.kernels import worklist_kernel
from flashjit.kernels.worklist_kernel import MERGE_ENTRY, Kernel
from flashjit.masks.registry import masks
from flashjit.worklist.record import PLAN_ENTRY


@pytest.fixture
def driver(monkeypatch):
    """Fakes of the driver calls Kernel._load makes; returns what they were asked."""
    asked = {"shared": [], "occupancy": []}

    def load_functions(cubin, device_index, entries, spec_name, arch, before_capture):
        asked["entries"] = list(entries)
        return "module", [0x100 + i for i, _ in enumerate(entries)]

    monkeypatch.setattr(worklist_kernel, "load_functions", load_functions)
    monkeypatch.setattr(worklist_kernel, "on_device", lambda device_index: contextlib.nullcontext())
    monkeypatch.setattr(worklist_kernel, "block_shared_optin", lambda device_index: 232_448)
    monkeypatch.setattr(worklist_kernel, "static_shared_bytes", lambda function: 17_000)
    monkeypatch.setattr(worklist_kernel, "set_dynamic_shared_memory",
                        lambda functions, smem, what: asked["shared"].append((tuple(functions), smem)))
    monkeypatch.setattr(worklist_kernel, "occupancy",
                        lambda function, threads, smem: asked["occupancy"].append(function) or 2)
    monkeypatch.setattr(worklist_kernel, "multiprocessor_count", lambda device_index: 132)
    return asked


def kernel_of(spec) -> Kernel:
    return Kernel(spec, tiling_of(spec), masks.get(spec.mask), b"cubin", "key")


def test_a_fused_decode_module_loads_its_attend_kernel_and_the_planner(driver):
    loaded = kernel_of(DecodeSpec(128, group_size=4, arch="sm_90")).loaded(0)
    assert driver["entries"] == ["flashjit_decode", PLAN_ENTRY]
    assert (loaded.decode, loaded.plan, loaded.merge, loaded.decode_packed) == (0x100, 0x101, None, None)
    assert (loaded.ctas_per_sm, loaded.num_sms, loaded.plan_max_batch) == (2, 132, 4096)
    assert driver["occupancy"] == [0x100]


def test_a_cuda_core_module_loads_its_separate_merge(driver):
    loaded = kernel_of(DecodeSpec(128, group_size=4, arch="sm_80", tensor_cores=False)).loaded(0)
    assert driver["entries"] == ["flashjit_decode", PLAN_ENTRY, MERGE_ENTRY] and loaded.merge == 0x102


def test_a_packed_shared_prefix_module_loads_both_attend_kernels(driver):
    spec = DecodeSpec(128, group_size=4, arch="sm_80", shared_prefix=True)
    assert tiling_of(spec).packed_entry == "flashjit_decode_packed"
    loaded = kernel_of(spec).loaded(0)
    assert driver["entries"] == ["flashjit_decode", PLAN_ENTRY, "flashjit_decode_packed", MERGE_ENTRY]
    assert loaded.decode_packed == 0x102 and driver["occupancy"] == [0x100, 0x102]
    assert ((0x100, 0x102), tiling_of(spec).smem_bytes) in driver["shared"]  # both opt in to the ring


def test_an_mla_module_loads_its_own_entry_and_the_planner(driver):
    loaded = kernel_of(MLASpec(128, arch="sm_90")).loaded(3)
    assert driver["entries"] == ["flashjit_mla", PLAN_ENTRY]
    assert (loaded.decode, loaded.plan, loaded.merge, loaded.decode_packed) == (0x100, 0x101, None, None)


def test_a_device_is_loaded_once(driver):
    kernel = kernel_of(DecodeSpec(64, arch="sm_90"))
    assert kernel.loaded(1) is kernel.loaded(1) and len(driver["occupancy"]) == 1
