"""tiling: the 16-bit tensor-core rings' row layouts, checked on the CPU.

Two costs trade off (docs/performance.md, sixth and seventh sessions): a cp.async pair whose 32-byte
sector lands across a 32-byte boundary of shared memory fetches the sector twice, and ldmatrix
phases (8 rows x 16 bytes) that hit one bank twice take an extra wavefront.
"""

from __future__ import annotations

import pytest

from flashjit.jit import tiling
from flashjit.jit.spec import DecodeSpec
from flashjit.jit.tiling import decode_tiling


def ldmatrix_extra_wavefronts(pitch: int, swizzle: bool, chunk: int) -> int:
    """Extra wavefronts of one ldmatrix phase: rows 0..7 of one 16-byte column."""
    banks = {}
    for row in range(8):
        address = row * pitch + 16 * ((chunk ^ row % 8) if swizzle else chunk)
        for word in range(address // 4, address // 4 + 4):
            banks.setdefault(word % 32, set()).add(word)
    return max(len(words) for words in banks.values()) - 1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_16bit_rows_keep_sectors_whole_and_ldmatrix_at_most_two_way(head_dim):
    t = decode_tiling(DecodeSpec(head_dim=head_dim, dtype="bf16", kv_dtype="bf16", group_size=4, arch="sm_90",
                                 tensor_cores=True))
    assert t.ring_align % 32 == 0 and t.k_pitch == t.v_pitch
    # whole sectors: every 32-byte piece of a cache row starts 32-byte aligned in the ring
    assert t.k_pitch % 32 == 0
    extra = [ldmatrix_extra_wavefronts(t.k_pitch, t.swizzle, chunk) for chunk in range(head_dim * 2 // 16)]
    assert max(extra) <= (0 if t.swizzle else 1)
    # 16 bytes of padding would be conflict-free but split sectors: the trade the table makes
    assert tiling.ROW_PAD_16BIT[head_dim] * 2 % 32 == 0 or t.swizzle


@pytest.mark.parametrize("kv_dtype", ["bf16", "e4m3"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tiles_are_shared_only_where_the_fused_merge_resets_the_claims(monkeypatch, kv_dtype, head_dim):
    """static_share comes from tiling's table for tensor-core kernels; the CUDA-core kernels, and any
    kernel without the fused merge (whose last CTA sets the claim counter back to 0), never share."""
    table = tiling.STATIC_SHARE_FP8 if kv_dtype == "e4m3" else tiling.STATIC_SHARE

    def share(**kwargs):
        return decode_tiling(DecodeSpec(head_dim=head_dim, kv_dtype=kv_dtype, arch="sm_90", **kwargs)).static_share

    assert share(group_size=4, tensor_cores=True) == table[head_dim]
    assert share(group_size=4, tensor_cores=False) == 100
    monkeypatch.setattr(tiling, "FUSED_MERGE", False)
    assert share(group_size=4, tensor_cores=True) == 100
