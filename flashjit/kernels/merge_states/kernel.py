"""MergeStatesKernel: the compiled merge_states kernel of one MergeSpec, loaded lazily per device.

What Engine.get_kernel returns for a MergeSpec. Like Kernel, its module is loaded with CuPy on first
use per device and pinned for the process, so CUDA-graph replays never meet an unloaded module;
launches go through launch.PreparedLaunch.
"""

from __future__ import annotations

from ...jit.arch import waits_for_previous_kernel
from ...jit.launch import PerDevice, load_functions
from .spec import MAX_LANES, MergeSpec

MERGE_STATES_ENTRY = "flashjit_merge_states"
ROW_THREADS = 128  # threads of a block where rows are narrower: a block holds whole rows


class MergeStatesKernel:
    """One compiled merge_states kernel. Cheap to create; loads on first use per device."""

    mask = None  # no mask: the engine's mask bookkeeping skips it

    def __init__(self, spec: MergeSpec, cubin: bytes, key: str):
        self.spec, self.cubin, self.key = spec, cubin, key
        self.programmatic_launch = waits_for_previous_kernel(spec.arch)  # PreparedLaunch's programmatic
        self._devices = PerDevice(self._load)  # device -> (CuPy Module, function handle)

    def __repr__(self):
        return f"MergeStatesKernel({self.spec.name}, key={self.key[:12]})"

    def block_shape(self, head_dim: int) -> tuple[int, int]:
        """(threads per block, rows per block) for rows of head_dim elements."""
        lanes = head_dim // self.spec.vector_elements
        assert 0 < lanes <= MAX_LANES, lanes
        rows = max(1, ROW_THREADS // lanes)
        return rows * lanes, rows

    def function(self, device_index: int) -> int:
        return self._devices.get(device_index)[1]

    def _load(self, device_index: int) -> tuple[object, int]:
        module, (handle,) = load_functions(self.cubin, device_index, [MERGE_STATES_ENTRY], self.spec.name,
                                           self.spec.arch, "call merge_states once before capturing")
        return module, handle
