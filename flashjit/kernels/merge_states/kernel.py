"""MergeStatesKernel: the compiled merge_states kernel of one MergeSpec, loaded lazily per device.

What Engine.get_kernel returns for a MergeSpec. Like Kernel, its module is loaded with CuPy on first
use per device and pinned for the process, so CUDA-graph replays never meet an unloaded module;
launches go through kernel.PreparedLaunch.
"""

from __future__ import annotations

import threading

from ..errors import KernelNotPrewarmed
from .kernel import waits_for_previous_kernel
from .merge_spec import MAX_LANES, MergeSpec

MERGE_STATES_ENTRY = "flashjit_merge_states"
ROW_THREADS = 128  # threads of a block where rows are narrower: a block holds whole rows


class MergeStatesKernel:
    """One compiled merge_states kernel. Cheap to create; loads on first use per device."""

    mask = None  # no mask: the engine's mask bookkeeping skips it

    def __init__(self, spec: MergeSpec, cubin: bytes, key: str):
        self.spec, self.cubin, self.key = spec, cubin, key
        self.programmatic_launch = waits_for_previous_kernel(spec.arch)  # PreparedLaunch's programmatic
        self._functions: dict[int, tuple[object, int]] = {}  # device -> (CuPy Module, function handle)
        self._lock = threading.Lock()

    def __repr__(self):
        return f"MergeStatesKernel({self.spec.name}, key={self.key[:12]})"

    def block_shape(self, head_dim: int) -> tuple[int, int]:
        """(threads per block, rows per block) for rows of head_dim elements."""
        lanes = head_dim // self.spec.vector_elements
        assert 0 < lanes <= MAX_LANES, lanes
        rows = max(1, ROW_THREADS // lanes)
        return rows * lanes, rows

    def function(self, device_index: int) -> int:
        found = self._functions.get(device_index)
        return found[1] if found is not None else self._load(device_index)

    def _load(self, device_index: int) -> int:
        import cupy
        import torch

        with self._lock:
            if device_index in self._functions:
                return self._functions[device_index][1]
            if torch.cuda.is_current_stream_capturing():
                raise KernelNotPrewarmed(
                    f"{self.spec.name} is not loaded on cuda:{device_index} and modules cannot be loaded during "
                    "CUDA-graph capture; call merge_states once before capturing")
            major, minor = torch.cuda.get_device_capability(device_index)
            device_arch = f"sm_{major}{minor}"
            if self.spec.arch.rstrip("a") != device_arch:
                raise KernelNotPrewarmed(f"{self.spec.name} was compiled for {self.spec.arch} but cuda:{device_index} "
                                         f"is {device_arch}; build the spec with arch={device_arch!r}")
            with cupy.cuda.Device(device_index):
                module = cupy.cuda.function.Module()
                module.load(self.cubin)
                handle = module.get_function(MERGE_STATES_ENTRY).ptr
            self._functions[device_index] = (module, handle)
            return handle
