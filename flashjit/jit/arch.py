"""What flashjit knows about GPU architectures, in one place: the archs it compiles for, their
shared memory, and which instructions each has.

A new GPU generation starts here (its name, its block's shared memory, the features it has) and
continues as rows of the families' tuning tables keyed by arch (kernels/<family>/tiling.py).
The templates see an arch only as cfg::ARCH (arch_number) and as __CUDA_ARCH__.
"""

from __future__ import annotations

import re

from ..errors import SpecError

ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")
# The most shared memory one block may have on each arch (CUDA's opt-in limit per block). A tensor-core
# or MLA kernel's dynamic shared memory (its tiling's smem_bytes) and its static arrays (softmax
# states, sinks, merge words: at most 1552 bytes, the MLA kernel's at 64 rows, per ptxas) must fit.
BLOCK_SHARED_BYTES = {"sm_80": 166_912, "sm_86": 101_376, "sm_87": 166_912, "sm_89": 101_376,
                      "sm_90": 232_448, "sm_90a": 232_448, "sm_100": 232_448, "sm_120": 101_376}
KERNEL_STATIC_SHARED_BYTES = 1664
DEFAULT_DYNAMIC_SHARED_BYTES = 48 * 1024  # more takes an opt-in per function (cuFuncSetAttribute)

HOPPER = "sm_90"
# Warpgroup MMAs (wgmma): Hopper, compiled for its arch-specific form, whose instructions only it has.
WGMMA_ARCHS = ("sm_90", "sm_90a")
WGMMA_COMPILE_ARCH = "sm_90a"
# The 128-byte swizzle's repeat (8 rows of 128 bytes): a wgmma operand in shared memory starts on
# one (the MLA and shared-prefix warpgroup kernels' rings; common/wgmma.cuh.j2's WGMMA_SWIZZLE_ATOM).
SWIZZLE_ATOM = 1024
PROGRAMMATIC_LAUNCH_MIN_ARCH = 90  # griddepcontrol: sm_90 and later
FP8_CONVERT_MIN_ARCH = 89  # cvt between fp8 and f16x2 (common/kv_types.cuh reads cfg::ARCH)


def arch_number(arch: str) -> int:
    """90 for sm_90 and sm_90a: what the templates compare against (e.g. fp8 conversions from 89)."""
    return int(arch.removeprefix("sm_").rstrip("a"))


def device_arch(device_index: int | None = None) -> str:
    """The arch of a torch CUDA device (the current one when None)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def current_arch() -> str | None:
    """The arch of torch's current GPU, or None on a machine without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return device_arch()


def runs_on(arch: str, device_arch_name: str) -> bool:
    """Whether code compiled for arch runs on a device of device_arch_name (sm_90a code on sm_90)."""
    return arch.rstrip("a") == device_arch_name


def has_wgmma(arch: str) -> bool:
    return arch in WGMMA_ARCHS


def waits_for_previous_kernel(arch: str) -> bool:
    """Whether kernels compiled for arch wait for the previous kernel themselves, so that they may
    be launched with programmatic stream serialization (every template's entry points do from sm_90)."""
    return arch_number(arch) >= PROGRAMMATIC_LAUNCH_MIN_ARCH


def dynamic_shared_limit(arch: str) -> int:
    """The dynamic shared memory a tensor-core or MLA kernel's tiling may take on arch."""
    return BLOCK_SHARED_BYTES[arch] - KERNEL_STATIC_SHARED_BYTES


def check_shared_memory(spec, dynamic_bytes: int, hint: str, owner: str | None = None):
    """Refuses a spec whose kernel needs more shared memory a block than its arch has (it would
    compile, then fail to launch), naming the archs where it fits (owner: the spec's class name
    where None)."""
    if dynamic_bytes > dynamic_shared_limit(spec.arch):
        fits = [arch for arch in ARCHS if dynamic_shared_limit(arch) >= dynamic_bytes]
        raise SpecError("arch", spec.arch, f"{', '.join(fits)} for {spec.name}, whose kernel takes "
                        f"{dynamic_bytes} bytes of shared memory a block beside its static arrays, where "
                        f"{spec.arch} blocks have {BLOCK_SHARED_BYTES[spec.arch]} in all ({hint})", owner or type(spec).__name__)


def normalize_arch(arch) -> str:
    """"sm_90" from "sm_90", "90", "SM90"; None: the current GPU's. Raises SpecError naming ARCHS."""
    if arch is None:
        arch = current_arch()
        if arch is None:
            raise SpecError("arch", None, "one of " + ", ".join(ARCHS) + " (required on a machine with no GPU)")
    text = str(arch).lower()
    if re.fullmatch(r"\d{2,3}a?", text):  # "90" or "90a"
        text = "sm_" + text
    text = text.replace("sm", "sm_", 1).replace("sm__", "sm_") if not text.startswith("sm_") else text
    if text not in ARCHS:
        raise SpecError("arch", arch, ", ".join(ARCHS))
    return text
