"""A compiled decode specialization: its cubin, lazy per-device loading, and a lean launcher.

Three types, one step each: Kernel is one spec's cubin (what Engine.get_kernel returns, made by
the engine from compile.py's CompiledKernel, NVRTC's cubin and log); LoadedKernel is its driver
handles on one device; PreparedLaunch is one launch of such a handle, its arguments built once.

Modules are loaded with CuPy on first use, on the tensor's device, and pinned for the process
lifetime, so CUDA-graph replays never see an unloaded module. Launches go straight to the driver's
cuLaunchKernelEx through ctypes with a launch configuration and argument structs (abi.DecodeArgs,
abi.MergeArgs) built once and patched per call: the cheapest host path from Python, and captured
correctly by torch.cuda.graph. On sm_90 and later they allow programmatic dependent launch: the
kernel's CTAs may start while the stream's previous kernel finishes, and wait for its writes in
the kernel (wait_for_previous_kernel in templates/include/prelude.cuh).
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading

from .. import cuda_flavour
from ..errors import KernelNotPrewarmed
from ..masks.registry import MaskDef
from .abi import PLAN_MAX_BATCH, plan_batch_limit, plan_smem_bytes
from ..masks.variants import VariantDef, variants
from .spec import DecodeSpec, arch_number
from .tiling import DecodeTiling

DECODE_ENTRY = "flashjit_decode"
MERGE_ENTRY = "flashjit_merge"
PLAN_ENTRY = "flashjit_plan"
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
PROGRAMMATIC_LAUNCH_MIN_ARCH = 90  # griddepcontrol: sm_90 and later


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, and a 64-byte value union (an int here)."""
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("_value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def waits_for_previous_kernel(arch: str) -> bool:
    """Whether kernels compiled for arch wait for the previous kernel themselves, so that they may
    be launched with programmatic stream serialization (every template's entry points do from sm_90)."""
    return arch_number(arch) >= PROGRAMMATIC_LAUNCH_MIN_ARCH


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


def planner_batch_limit(plan: int, device_index: int) -> int:
    """The most requests the loaded GPU planner `plan` takes on the device: what the device's opt-in
    shared memory per block holds beside the planner's static arrays (abi.plan_batch_limit)."""
    from cupy.cuda import driver as cuda_driver, runtime

    block_bytes = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_index)
    static_bytes = cuda_driver.funcGetAttribute(cuda_driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, plan)
    return plan_batch_limit(block_bytes, static_bytes)


@dataclasses.dataclass
class LoadedKernel:
    """Driver handles of one spec's entry points on one device."""

    module: object  # the CuPy Module, kept alive for the process lifetime
    decode: int
    merge: int | None  # None where the decode kernel merges split requests itself (tiling.fused_merge)
    ctas_per_sm: int
    num_sms: int
    plan: int | None = None  # the GPU planner (CUDA-graph mode), in every module since the same render
    plan_max_batch: int = PLAN_MAX_BATCH  # the most requests its shared memory holds on this device
    decode_packed: int | None = None  # tiling.packed_entry: the decode kernel of plans with packed own items


class Kernel:
    """One compiled specialization. Cheap to create; loads on first use per device."""

    def __init__(self, spec: DecodeSpec, tiling: DecodeTiling, mask: MaskDef, cubin: bytes, key: str,
                 variant: VariantDef | None = None):
        self.spec, self.tiling, self.mask, self.cubin, self.key = spec, tiling, mask, cubin, key
        self.variant = variants.get(spec.variant) if variant is None else variant
        self.programmatic_launch = waits_for_previous_kernel(spec.arch)  # PreparedLaunch's programmatic
        self._loaded: dict[int, LoadedKernel] = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"Kernel({self.spec.name}, key={self.key[:12]})"

    def loaded(self, device_index: int) -> LoadedKernel:
        found = self._loaded.get(device_index)
        return found if found is not None else self._load(device_index)

    def _load(self, device_index: int) -> LoadedKernel:
        cuda_flavour.require_cupy()
        import cupy
        import torch

        with self._lock:
            if device_index in self._loaded:
                return self._loaded[device_index]
            if torch.cuda.is_current_stream_capturing():
                raise KernelNotPrewarmed(
                    f"{self.spec.name} is not loaded on cuda:{device_index} and modules cannot be loaded during "
                    "CUDA-graph capture; run one plan()/run() (or engine.get_kernel(spec).loaded(device)) before capturing")
            major, minor = torch.cuda.get_device_capability(device_index)
            device_arch = f"sm_{major}{minor}"
            if self.spec.arch.rstrip("a") != device_arch:
                raise KernelNotPrewarmed(f"{self.spec.name} was compiled for {self.spec.arch} but cuda:{device_index} "
                                         f"is {device_arch}; build the spec with arch={device_arch!r}")
            with cupy.cuda.Device(device_index):
                module = cupy.cuda.function.Module()
                module.load(self.cubin)
                decode = module.get_function(self.tiling.entry).ptr
                merge = None if self.tiling.fused_merge else module.get_function(MERGE_ENTRY).ptr
                plan = module.get_function(PLAN_ENTRY).ptr
                plan_max_batch = planner_batch_limit(plan, device_index)
                check(driver().cuFuncSetAttribute(plan, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                  plan_smem_bytes(plan_max_batch)), "cuFuncSetAttribute")
                packed = None if self.tiling.packed_entry is None else module.get_function(self.tiling.packed_entry).ptr
                smem = self.tiling.smem_bytes
                entries = (decode,) if packed is None else (decode, packed)
                if smem > 48 * 1024:  # opt in to more than the default dynamic shared memory
                    for function in entries:
                        check(driver().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                          smem),
                              f"cuFuncSetAttribute ({self.spec.name}'s {smem} bytes of shared memory on "
                              f"cuda:{device_index})")
            ctas_per_sm = []  # the planner's waves: the fewer of the entry points'
            for function in entries:
                occupancy = ctypes.c_int(0)
                check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(occupancy), function, self.tiling.threads, smem),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor")
                ctas_per_sm.append(occupancy.value)
            num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
            loaded = LoadedKernel(module, decode, merge, max(1, min(ctas_per_sm)), num_sms, plan, plan_max_batch,
                                  packed)
            self._loaded[device_index] = loaded
            return loaded


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
