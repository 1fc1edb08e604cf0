"""wgmma's shared-memory operands as the PTX ISA lays them out: the matrix descriptor a kernel builds
(mla/wgmma.cuh's smem_operand, term for term), and an operand read back through the canonical
128-byte-swizzled layouts (K-major and N-major). Used by the MLA and the shared-prefix decode tests."""

from __future__ import annotations

import numpy as np

from flashjit.kernels.mla.tiling import SWIZZLE_ATOM


def smem_operand(at: int, lead: int) -> int:  # mla/wgmma.cuh
    return ((at & 0x3FFFF) >> 4) | ((lead >> 4) << 16) | ((SWIZZLE_ATOM >> 4) << 32) | (1 << 62)


def swizzle_128b(address: int) -> int:
    """The 128-byte swizzle: an address's 16-byte chunk (bits 4-6) XOR its row in the 1024-byte
    repeat (bits 7-9)."""
    return address ^ (((address >> 7) & 7) << 4)


def fields(desc: int) -> tuple[int, int, int]:
    assert desc >> 62 == 1, "128-byte swizzle"
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def read_k_major(smem: np.ndarray, desc: int, rows: int) -> np.ndarray:
    """[rows x 16] of a K-major operand: ((8, m), (8, 2)) : ((128 B, SBO), (2 B, 16 B)), swizzled."""
    start, _, sbo = fields(desc)
    out = np.empty((rows, 16))
    for r in range(rows):
        for k in range(16):
            out[r, k] = smem[swizzle_128b(start + (r // 8) * sbo + (r % 8) * 128 + (k // 8) * 16 + (k % 8) * 2) // 2]
    return out


def read_n_major(smem: np.ndarray, desc: int, cols: int) -> np.ndarray:
    """[16 x cols] of an N-major operand: N ((8, 8, m) : (2 B, 16 B, LBO)), K ((8, 2) : (128 B, SBO)), swizzled."""
    start, lbo, sbo = fields(desc)
    out = np.empty((16, cols))
    for k in range(16):
        for n in range(cols):
            at = start + (n // 64) * lbo + ((n // 8) % 8) * 16 + (n % 8) * 2 + (k // 8) * sbo + (k % 8) * 128
            out[k, n] = smem[swizzle_128b(at) // 2]
    return out
