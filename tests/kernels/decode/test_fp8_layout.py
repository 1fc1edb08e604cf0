"""The fp8 tensor-core kernel's register layouts (templates/decode/tc_fp8.cuh), emulated lane
by lane on the CPU: which bytes each lane loads, how prmt and the pairwise conversion turn them into
MMA fragments, and what mma.m16n8k16 and movmatrix do with those fragments (PTX ISA fragment
layouts). The products must equal K Q^T and P V, with O^T's rows landing on o_dim's head dims; the
loads must be bank-conflict free at the pitches tiling.py gives. k_byte, o_dim and the ring's
swizzle are flashjit.jit.layouts' functions, which every fp8 kernel's source asserts its own
constexpr functions equal (tests/test_layouts.py): a wrong index in the kernel's layout fails the
compile or shows up here before it reaches a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from flashjit.kernels.layouts import fp8_block as block
from flashjit.kernels.layouts import fp8_k_byte as k_byte
from flashjit.kernels.layouts import fp8_o_dim as o_dim
from flashjit.kernels.layouts import swizzled_chunk
from flashjit.kernels.decode.tiling import tc_row_pitches

LANES = [(lane // 4, lane % 4) for lane in range(32)]  # (g, t) of each lane


def k_width(head_dim: int) -> int:
    """Bytes of one K load of `scores` per lane: 16, or the 8 bytes of a 32-dim block."""
    return min(16, block(head_dim) // 4)


def prmt(a: bytes, b: bytes, select: int) -> bytes:
    pool = a + b
    return bytes(pool[(select >> (4 * i)) & 7] for i in range(4))


# mma.m16n8k16 fragments: (row, column) of each 16-bit element a lane holds, in register order.
def a_slots(g, t):  # A: 16 x 16, 4 registers of 2
    return [(g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)) for i in range(8)]


def b_slots(g, t):  # B: 16 x 8
    return [(2 * t + i % 2 + 8 * (i // 2), g) for i in range(4)]


def c_slots(g, t):  # C: 16 x 8
    return [(g + 8 * (i // 2), 2 * t + i % 2) for i in range(4)]


def mma(a_frags, b_frags) -> dict:
    """Every lane's C fragment of A B, from every lane's A and B fragments (lists of 8 and 4 values)."""
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for (g, t), frag in zip(LANES, a_frags):
        for (r, c), x in zip(a_slots(g, t), frag):
            a[r, c] = x
    for (g, t), frag in zip(LANES, b_frags):
        for (r, c), x in zip(b_slots(g, t), frag):
            b[r, c] = x
    product = a @ b
    return [[product[r, c] for r, c in c_slots(g, t)] for g, t in LANES]


def movmatrix_trans(values) -> list:
    """Each lane holds row g, columns 2t, 2t + 1 of an 8x8 matrix; afterwards, of its transpose."""
    m = np.zeros((8, 8))
    for (g, t), (x0, x1) in zip(LANES, values):
        m[g, 2 * t], m[g, 2 * t + 1] = x0, x1
    return [(m[2 * t, g], m[2 * t + 1, g]) for g, t in LANES]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_scores_fragments_compute_k_q_transposed(head_dim):
    rng = np.random.default_rng(head_dim)
    keys = rng.integers(-8, 8, (16, head_dim)).astype(float)  # one warp's 16 key rows (bytes = values)
    queries = rng.integers(-8, 8, (8, head_dim)).astype(float)
    total = np.zeros((16, 8))
    for ks in range(head_dim // 16):
        a_frags, b_frags = [], []
        for g, t in LANES:
            start = k_byte(head_dim, ks, t)
            w0, w1 = keys[g, start:start + 4], keys[g + 8, start:start + 4]
            # to_f16x4(w0) -> registers 0 and 2, to_f16x4(w1) -> registers 1 and 3
            a_frags.append([w0[0], w0[1], w1[0], w1[1], w0[2], w0[3], w1[2], w1[3]])
            b_frags.append(list(queries[g, start:start + 4]))
        c = mma(a_frags, b_frags)
        for (g, t), frag in zip(LANES, c):
            for (r, col), x in zip(c_slots(g, t), frag):
                total[r, col] += x
    np.testing.assert_array_equal(total, keys @ queries.T)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_value_fragments_compute_p_v_in_o_dim_order(head_dim):
    rng = np.random.default_rng(head_dim + 1)
    values = rng.integers(0, 256, (16, head_dim))  # byte values, to check the byte routing exactly
    p = rng.integers(-4, 5, (8, 16)).astype(float)  # P: query rows x keys
    # P^T as S^T's C fragments (lane: key g / g + 8, rows 2t, 2t + 1), then to B fragments.
    first = movmatrix_trans([(p[2 * t, g], p[2 * t + 1, g]) for g, t in LANES])
    second = movmatrix_trans([(p[2 * t, g + 8], p[2 * t + 1, g + 8]) for g, t in LANES])
    b_frags = [[*x, *y] for x, y in zip(first, second)]
    b = block(head_dim)
    out = np.zeros((head_dim, 8))
    for mt in range(head_dim // 16):
        i = mt % (b // 16)
        a_frags = []
        for g, t in LANES:
            start = b * (mt // (b // 16)) + (b // 8) * g
            word = lambda key: bytes(values[key, start + 4 * (i // 2): start + 4 * (i // 2) + 4].tolist())
            pick = 0x7362 if i % 2 else 0x5140
            lo, hi = prmt(word(2 * t), word(2 * t + 1), pick), prmt(word(2 * t + 8), word(2 * t + 9), pick)
            a_frags.append([lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]])
        c = mma(a_frags, b_frags)
        for (g, t), frag in zip(LANES, c):
            for (r, col), x in zip(c_slots(g, t), frag):
                out[o_dim(head_dim, mt, r), col] += x
    np.testing.assert_array_equal(out, (p @ values).T)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_layouts_cover_every_head_dim_once(head_dim):
    k_dims = sorted(k_byte(head_dim, ks, t) + e for ks in range(head_dim // 16) for t in range(4) for e in range(4))
    o_dims = sorted(o_dim(head_dim, mt, r) for mt in range(head_dim // 16) for r in range(16))
    assert k_dims == o_dims == list(range(head_dim))


def conflicts(addresses, width: int) -> int:
    """Extra shared-memory wavefronts of one warp-wide load of `width` bytes per lane.

    Lanes are served in phases of 128 bytes (8 lanes of 16 bytes, 16 of 8); within a phase two
    lanes conflict when they touch the same bank (4-byte word mod 32) in different words."""
    per_phase = 128 // width
    extra = 0
    for start in range(0, 32, per_phase):
        banks: dict[int, set[int]] = {}
        for address in addresses[start:start + per_phase]:
            for word in range(address // 4, (address + width) // 4):
                banks.setdefault(word % 32, set()).add(word)
        extra += max(len(words) for words in banks.values()) - 1
    return extra


def at(row: int, byte: int, pitch: int, swizzle: bool) -> int:
    """Shared-memory address of a row's byte; swizzled: its 16-byte chunk moved as the ring's
    swizzle moves it (rows of pitch bytes, fp8: a byte a value)."""
    return row * pitch + (swizzled_chunk(row, byte // 16, pitch // 16) * 16 + byte % 16 if swizzle else byte)


def k_loads(head_dim: int, pitch: int, swizzle: bool = False):
    """Byte addresses of each K load of `scores` (k_width bytes), per lane (key rows g and g + 8)."""
    b, width = block(head_dim), k_width(head_dim)
    return [[at(g + 8 * h, b * blk + (b // 4) * t + width * c, pitch, swizzle) for g, t in LANES]
            for blk in range(head_dim // b) for c in range(b // 4 // width) for h in range(2)]


def v_loads(head_dim: int, pitch: int, swizzle: bool = False):
    """Byte addresses of each V load of `accumulate` (key rows 2t, 2t + 1, 2t + 8, 2t + 9)."""
    b = block(head_dim)
    return [[at(2 * t + (k & 1) + 8 * (k >> 1), b * blk + (b // 8) * g, pitch, swizzle) for g, t in LANES]
            for blk in range(head_dim // b) for k in range(4)]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_row_pitches_bound_the_bank_conflicts_of_every_load(head_dim):
    """The pitches with 16 bytes of padding (those of head_dim 64 and 256, and head_dim 96's V rows
    beside unpadded K rows) are conflict-free; head_dim 128 pads 32 (rows of whole 32-byte sectors),
    where every load costs at most one extra wavefront."""
    k_pitch, v_pitch = tc_row_pitches(head_dim, kv_bytes=1)
    v_width = block(head_dim) // 8
    assert k_pitch >= head_dim and v_pitch >= head_dim and k_pitch % 16 == v_pitch % 16 == 0
    allowed = 1 if head_dim == 128 else 0
    if allowed:
        assert k_pitch % 32 == v_pitch % 32 == 0
    loads = [(addresses, k_width(head_dim)) for addresses in k_loads(head_dim, k_pitch)]
    loads += [(addresses, v_width) for addresses in v_loads(head_dim, v_pitch)]
    assert all(conflicts(addresses, width) <= allowed * 32 // (128 // width) for addresses, width in loads)
    # unpadded rows would conflict, so the check has teeth
    assert any(conflicts(addresses, k_width(head_dim)) for addresses in k_loads(head_dim, 2 * head_dim))
    assert any(conflicts(addresses, v_width) for addresses in v_loads(head_dim, head_dim))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_swizzled_rows_make_every_load_conflict_free(head_dim):
    """Unpadded rows with their 16-byte chunks XORed by row % 8 (TensorCoreRow.swizzle): the loads of
    `scores` and `accumulate` conflict-free, and the copies' 32-byte sectors whole (an XOR of the
    chunk index keeps chunks 2m and 2m + 1 in the same aligned 32 bytes)."""
    k_pitch, v_pitch = tc_row_pitches(head_dim, kv_bytes=1, swizzle=True)
    assert k_pitch == v_pitch == head_dim
    assert all(conflicts(addresses, 16) == 0 for addresses in k_loads(head_dim, k_pitch, swizzle=True))
    assert all(conflicts(addresses, 16) == 0 for addresses in v_loads(head_dim, v_pitch, swizzle=True))
    assert all({at(row, 32 * m, k_pitch, True) // 32, at(row, 32 * m + 16, k_pitch, True) // 32} ==
               {at(row, 32 * m, k_pitch, True) // 32} for row in range(16) for m in range(head_dim // 32))
    # unswizzled, the same unpadded rows conflict: the check has teeth
    assert any(conflicts(addresses, 16) for addresses in k_loads(head_dim, k_pitch))
