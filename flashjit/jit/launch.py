"""Loading a cubin on a device and launching its functions: the half of a kernel no family owns.

load_functions is the one per-device load (capture and arch checks, CuPy's module load) and
PerDevice keeps what it made for the process lifetime, so CUDA-graph replays never see an unloaded
module; each family's kernel object names the entry points it loads (kernels/<family>/).
PreparedLaunch is one launch of such a function, its configuration and argument structs built once
and patched per call, going straight to the driver's cuLaunchKernelEx through ctypes: the cheapest
host path from Python, and captured correctly by torch.cuda.graph. On sm_90 and later launches
allow programmatic dependent launch (arch.waits_for_previous_kernel): the kernel's CTAs may start
while the stream's previous kernel finishes, and wait for its writes in the kernel
(wait_for_previous_kernel in the templates' prelude).
"""

from __future__ import annotations

import ctypes
import threading

from .. import cuda_flavour
from ..errors import KernelNotPrewarmed
from .arch import DEFAULT_DYNAMIC_SHARED_BYTES, device_arch, runs_on

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_driver = None
_driver_lock = threading.Lock()
_cu_launch = None  # cuLaunchKernelEx, cached for the launch path


def driver():
    """libcuda through ctypes (loaded on first launch; a GPU-less host never needs it)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
                ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _driver = lib
    return _driver


CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, and a 64-byte value union (an int here)."""
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("_value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _launcher():
    """cuLaunchKernelEx without argtypes: PreparedLaunch passes ctypes objects of the parameters'
    own types (a reference to its LaunchConfig, the function handle, the void*[] of arguments,
    None for `extra`), which ctypes hands over as they are."""
    global _cu_launch
    launch = driver()["cuLaunchKernelEx"]  # a function pointer of its own: no argtypes
    launch.restype = ctypes.c_int
    _cu_launch = launch
    return launch


def check(status: int, what: str):
    if status != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(status, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: CUDA error {status} ({(text.value or b'?').decode()})")


def load_functions(cubin: bytes, device_index: int, entries, spec_name: str, arch: str, before_capture: str):
    """(the CuPy Module, the handle of each entry point named) of a cubin loaded on one device: the
    one per-device load every family's kernel does. Refuses (KernelNotPrewarmed) during CUDA-graph
    capture, where modules cannot be loaded (before_capture: what to run first), and on a device of
    another arch than the cubin's."""
    cuda_flavour.require_cupy()
    import cupy
    import torch

    if torch.cuda.is_current_stream_capturing():
        raise KernelNotPrewarmed(f"{spec_name} is not loaded on cuda:{device_index} and modules cannot be loaded during "
                                 f"CUDA-graph capture; {before_capture}")
    found = device_arch(device_index)
    if not runs_on(arch, found):
        raise KernelNotPrewarmed(f"{spec_name} was compiled for {arch} but cuda:{device_index} "
                                 f"is {found}; build the spec with arch={found!r}")
    with cupy.cuda.Device(device_index):
        module = cupy.cuda.function.Module()
        module.load(cubin)
        return module, [module.get_function(entry).ptr for entry in entries]


def on_device(device_index: int):
    """A context with the device's CUDA context current, for the driver calls on its functions."""
    import cupy

    return cupy.cuda.Device(device_index)


def set_dynamic_shared_memory(functions, smem: int, what: str):
    """Let each function launch with smem bytes of dynamic shared memory, where that is more than
    the default (an opt-in per function)."""
    if smem > DEFAULT_DYNAMIC_SHARED_BYTES:
        for function in functions:
            check(driver().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), what)


def occupancy(function: int, threads: int, smem: int) -> int:
    """CTAs of function (threads a block, smem bytes of dynamic shared memory) one SM holds at once."""
    ctas = ctypes.c_int(0)
    check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(ctas), function, threads, smem),
          "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return ctas.value


def multiprocessor_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_shared_optin(device_index: int) -> int:
    """The most shared memory one block may opt in to on the device."""
    from cupy.cuda import runtime

    return runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_index)


def static_shared_bytes(function: int) -> int:
    """The static shared memory of a loaded function (its __shared__ arrays)."""
    from cupy.cuda import driver as cuda_driver

    return cuda_driver.funcGetAttribute(cuda_driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)


class PerDevice:
    """What make(device_index) returns, made once per device under a lock (a kernel's loaded module
    and handles, pinned for the process so CUDA-graph replays never meet an unloaded module)."""

    def __init__(self, make):
        self._make, self._made, self._lock = make, {}, threading.Lock()

    def get(self, device_index: int):
        found = self._made.get(device_index)
        if found is not None:
            return found
        with self._lock:
            if device_index not in self._made:
                self._made[device_index] = self._make(device_index)
            return self._made[device_index]


class PreparedLaunch:
    """One kernel's launch with its configuration and arguments converted to ctypes once, at plan
    time: a call passes only the stream. programmatic: launched with programmatic stream
    serialization, for kernels that wait for the previous kernel themselves
    (waits_for_previous_kernel)."""

    def __init__(self, function: int, grid, block, params, smem: int = 0, programmatic: bool = False):
        self.function, self.grid, self.block, self.smem = function, tuple(grid), tuple(block), smem
        self.programmatic = programmatic
        self.params = params  # the void*[] of argument addresses, kept alive here
        self._attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self.config = LaunchConfig((ctypes.c_uint * 3)(*self.grid), (ctypes.c_uint * 3)(*self.block), smem, None,
                                   ctypes.pointer(self._attribute), int(programmatic))
        self._args = (ctypes.byref(self.config), ctypes.c_void_p(function), params, None)
        self._stream_handle = 0

    @classmethod
    def update(cls, launch: "PreparedLaunch | None", function: int, grid: tuple, block: tuple, params,
               smem: int = 0, programmatic: bool = False) -> "PreparedLaunch":
        """launch with its grid set to grid when it runs the same function over the same params
        array, else a new launch: a new plan() changes only the work counts, and patching three
        values costs less than building the ctypes values again. (A captured CUDA graph keeps the
        values it was captured with.)"""
        if (launch is None or launch.function != function or launch.params is not params
                or launch.block != block or launch.smem != smem or launch.programmatic != programmatic):
            return cls(function, grid, block, params, smem, programmatic)
        if grid != launch.grid:
            launch.config.grid[:] = grid
            launch.grid = grid
        return launch

    def __call__(self, stream: int):
        if stream != self._stream_handle:
            self.config.stream, self._stream_handle = stream, stream
        status = (_cu_launch or _launcher())(*self._args)
        if status:
            check(status, "cuLaunchKernelEx")
