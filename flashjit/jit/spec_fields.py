"""What the kernel families' specs share: the integer field check and what kv_dtype and arch imply."""

from __future__ import annotations

from ..errors import SpecError
from .arch import arch_number
from .dtypes import FP8_DTYPES


def check_int(field: str, value, low: int, high: int, allowed=None) -> int:
    """value, where it is an int (not a bool) in allowed (or low..high); else SpecError naming them."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and allowed is not None:
        ok = value in allowed
    elif ok:
        ok = low <= value <= high
    if not ok:
        raise SpecError(field, value, ", ".join(map(str, allowed)) if allowed else f"integers {low}..{high}")
    return value


class CacheAndArch:
    """What a kernel spec's kv_dtype and arch fields imply: the work-list families' specs share these."""

    kv_dtype: str
    arch: str

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype in FP8_DTYPES

    @property
    def kv_bytes(self) -> int:
        return 1 if self.kv_is_fp8 else 2

    @property
    def arch_number(self) -> int:
        return arch_number(self.arch)

    @property
    def compile_arch(self) -> str:
        """The arch NVRTC compiles for: the spec's, or its arch-specific form where the kernel uses
        instructions only that form has (arch.WGMMA_COMPILE_ARCH for warpgroup MMAs)."""
        return self.arch
