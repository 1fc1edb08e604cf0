"""The MLA kernel's tensor-core layouts, emulated lane by lane on the CPU.

templates/mla/mma.cuh computes S = Q K^T and O += P V with ldmatrix and mma.sync m16n8k16
from swizzled shared memory. This test replays the same lane arithmetic (each formula below is the
kernel's, term for term) over PTX's definitions of ldmatrix (.x4, with and without .trans) and of
the MMA's A, B and C fragments, for every CTA shape the tiling makes, and checks the products
against numpy, that every key, row and column is covered once, and that every ldmatrix phase hits
eight different 16-byte bank groups (conflict-free). The swizzle, the warps' partition and the
loader's constants are flashjit.jit.layouts' functions, which every MLA kernel's source asserts its
own equal (tests/test_layouts.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from flashjit.kernels.layouts import mla_loader, mla_loader_threads, mla_warps
from flashjit.kernels.layouts import mla_swizzled as swizzled
from flashjit.kernels.mla.spec import MLASpec
from flashjit.kernels.mla.tiling import MLA_TUNING, mla_tiling

QK, LATENT, ROW_ELEMS = 576, 512, 576  # a 16-bit row: 576 values, 72 chunks of 8


class Smem:
    """A shared-memory buffer of 16-bit rows (pitch_elems per row), as (row, element) -> value."""

    def __init__(self, rows: int, pitch_elems: int, base_bytes: int):
        self.data = np.zeros((rows, pitch_elems))
        self.pitch, self.base = pitch_elems, base_bytes

    def row8(self, row: int, elem: int) -> np.ndarray:
        assert elem % 8 == 0
        return self.data[row, elem:elem + 8]

    def address(self, row: int, elem: int) -> int:
        return self.base + 2 * (row * self.pitch + elem)


def store_swizzled(smem: Smem, matrix: np.ndarray):
    """Logical [rows, 576] into swizzled rows: chunk c of row r at chunk swizzled(r, c)."""
    for r in range(matrix.shape[0]):
        for c in range(matrix.shape[1] // 8):
            smem.data[r, 8 * swizzled(r, c):8 * swizzled(r, c) + 8] = matrix[r, 8 * c:8 * c + 8]


def ldmatrix_x4(smem: Smem, lane_address, trans: bool = False, conflicts: list | None = None):
    """PTX ldmatrix.x4: lane 8i + j gives row j of matrix i; returns regs[lane][i] = (lo, hi)."""
    rows = [[smem.row8(*lane_address(8 * i + j)) for j in range(8)] for i in range(4)]
    if conflicts is not None:
        for i in range(4):
            groups = {(smem.address(*lane_address(8 * i + j)) // 16) % 8 for j in range(8)}
            conflicts.append(len(groups) < 8)
    regs = []
    for t in range(32):
        g, c = t // 4, t % 4
        regs.append([(rows[i][2 * c][g], rows[i][2 * c + 1][g]) if trans else
                     (rows[i][g][2 * c], rows[i][g][2 * c + 1]) for i in range(4)])
    return regs


def mma(acc, a, b0, b1):
    """PTX mma.m16n8k16.row.col: acc[lane] (4 floats) += A (a[lane]: 4 pairs) x B (b0, b1[lane]: pairs)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for t in range(32):
        g, c = t // 4, t % 4
        for reg, (row, k) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
            A[row, k:k + 2] = a[t][reg]
        B[2 * c:2 * c + 2, g] = b0[t]
        B[2 * c + 8:2 * c + 10, g] = b1[t]
    C = A @ B
    for t in range(32):
        g, c = t // 4, t % 4
        acc[t] += np.array([C[g, 2 * c], C[g, 2 * c + 1], C[g + 8, 2 * c], C[g + 8, 2 * c + 1]])


# sm_100: the mma.sync kernel at every shape (on sm_90, 16-bit requests of 64 rows or more take the
# wgmma kernel: tests/test_mla_wgmma.py).
SHAPES = [MLASpec(num_heads=h, max_q_len=q, kv_dtype=kv, arch="sm_100")
          for h, q, kv in ((16, 1, "bf16"), (32, 1, "bf16"), (128, 1, "bf16"), (16, 1, "e4m3"), (64, 1, "e4m3"))]
WIDE = MLA_TUNING.with_rows(tile_tokens=64, stages=2)  # benchmarks/mla.py --sweep's 64-key stages
TILINGS = [mla_tiling(spec) for spec in SHAPES] + [mla_tiling(SHAPES[0], WIDE), mla_tiling(SHAPES[2], WIDE),
                                                   mla_tiling(SHAPES[0], WIDE.with_rows(rows=16, warps=8))]


@pytest.mark.parametrize("t", TILINGS, ids=lambda t: f"rows{t.rows}_w{t.warps}_t{t.tile_tokens}")
def test_scores_and_outputs_match_numpy(t):
    M, MT, W, TILE = t.rows, t.m_tiles, t.warps, t.tile_tokens
    KW, NTQ, CW, NTV = (mla_warps(t)[name] for name in ("KW", "NTQ", "CW", "NTV"))
    rng = np.random.default_rng(M * 7 + W)
    q = rng.integers(-4, 5, (M, QK)).astype(float)      # small integers: products are exact
    kv = rng.integers(-4, 5, (TILE, QK)).astype(float)
    p = rng.integers(0, 4, (M, TILE)).astype(float)
    q_smem, kv_smem = Smem(M, ROW_ELEMS, 0), Smem(TILE, ROW_ELEMS, 1 << 20)
    store_swizzled(q_smem, q)
    store_swizzled(kv_smem, kv)
    p_pitch = t.p_pitch // 2
    p_smem = Smem(M, p_pitch, 2 << 20)
    conflicts: list = []

    s_full = np.full((M, TILE), np.nan)
    o_full = np.full((M, LATENT), np.nan)
    for warp in range(W):
        mt_q, ks = warp % MT, warp // MT
        # S = Q K^T, as the kernel's kp / n loops
        s = [np.zeros((32, 4)) for _ in range(NTQ)]
        for kp in range(QK // 32):
            def a_addr(lane, half):
                a_row, a_sub = mt_q * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4
                return a_row, 8 * swizzled(a_row, 4 * kp + 2 * half + a_sub)
            qa0 = ldmatrix_x4(q_smem, lambda l: a_addr(l, 0), conflicts=conflicts)
            qa1 = ldmatrix_x4(q_smem, lambda l: a_addr(l, 1), conflicts=conflicts)
            for n in range(NTQ):
                def k_addr(lane):
                    key = ks * KW + (lane & 7) + 8 * n
                    return key, 8 * swizzled(key, 4 * kp + (lane >> 3))
                kb = ldmatrix_x4(kv_smem, k_addr, conflicts=conflicts)
                mma(s[n], qa0, [r[0] for r in kb], [r[1] for r in kb])
                mma(s[n], qa1, [r[2] for r in kb], [r[3] for r in kb])
        for lane in range(32):
            quad, pair = lane // 4, (lane % 4) * 2
            for n in range(NTQ):
                for e in range(4):
                    row, key = mt_q * 16 + quad + 8 * (e >> 1), ks * KW + 8 * n + pair + (e & 1)
                    assert np.isnan(s_full[row, key])  # each score is computed once
                    s_full[row, key] = s[n][lane][e]
                # P's stores: row_of[h], keys ks * KW + 8n + pair (+1), as the kernel writes them
                for h in range(2):
                    row = mt_q * 16 + quad + 8 * h
                    p_smem.data[row, ks * KW + 8 * n + pair:ks * KW + 8 * n + pair + 2] = \
                        p[row, ks * KW + 8 * n + pair:ks * KW + 8 * n + pair + 2]
    np.testing.assert_array_equal(s_full, q @ kv.T)

    for warp in range(W):
        o = [[np.zeros((32, 4)) for _ in range(NTV)] for _ in range(MT)]
        v_chunk_base = warp * CW // 8
        for kk in range(TILE // 16):
            pa = []
            for mt in range(MT):
                def p_addr(lane):
                    return mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), 8 * (2 * kk + (lane >> 4))
                pa.append(ldmatrix_x4(p_smem, p_addr, conflicts=conflicts))
            for n in range(0, NTV, 2):
                def v_addr(lane):
                    key = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1)
                    return key, 8 * swizzled(key, v_chunk_base + (lane >> 4) + n)
                vb = ldmatrix_x4(kv_smem, v_addr, trans=True, conflicts=conflicts)
                for mt in range(MT):
                    mma(o[mt][n], pa[mt], [r[0] for r in vb], [r[1] for r in vb])
                    mma(o[mt][n + 1], pa[mt], [r[2] for r in vb], [r[3] for r in vb])
        for lane in range(32):
            quad, pair = lane // 4, (lane % 4) * 2
            col0 = warp * CW + pair
            for mt in range(MT):
                for h in range(2):
                    row = mt * 16 + quad + 8 * h
                    for n in range(NTV):
                        cols = slice(col0 + 8 * n, col0 + 8 * n + 2)
                        assert np.isnan(o_full[row, cols]).all()  # each output is written once
                        o_full[row, cols] = o[mt][n][lane][2 * h:2 * h + 2]
    np.testing.assert_array_equal(o_full, p @ kv[:, :LATENT])
    assert not any(conflicts), f"{sum(conflicts)} of {len(conflicts)} ldmatrix phases have bank conflicts"


@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
def test_loader_covers_every_chunk_of_a_stage_once(kv):
    """LatentCopies: TPK threads per row, CPT chunks each, KPP rows per pass (mla/mma.cuh); the CTA's
    threads copy, or in the wgmma kernel (128 heads over 16-bit latents on sm_90) warpgroup 1's."""
    for heads in (16, 128):
        t = mla_tiling(MLASpec(num_heads=heads, kv_dtype=kv, arch="sm_90"))
        nt, tile = mla_loader_threads(t), t.tile_tokens
        stored_chunks = QK * (1 if kv == "e4m3" else 2) // 16
        tpk, kpp, cpt, passes = (mla_loader(nt, tile, 1 if kv == "e4m3" else 2)[name]
                                 for name in ("TPK", "KPP", "CPT", "PASSES"))
        seen = np.zeros((tile, stored_chunks), dtype=int)
        for tid in range(nt):
            for pass_ in range(passes):
                key = pass_ * kpp + tid // tpk
                if key >= tile:
                    continue
                for j in range(cpt):
                    seen[key, tid % tpk + tpk * j] += 1
        assert (seen == 1).all()
