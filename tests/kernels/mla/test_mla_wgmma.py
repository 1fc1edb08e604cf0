"""The MLA warpgroup kernel (templates/mla/wgmma.cuh) on the CPU: which specs take it and
the arch they compile for, its rendered source and NVRTC compile, and its shared-memory operands.

The operand test places Q, a stage of latent rows and P where the kernel's copies put them
(mla/mma.cuh's operand_offset, the P stores), builds the kernel's matrix descriptors for every MMA it
issues (each formula below is the kernel's, term for term), reads the operands back through the
PTX ISA's canonical 128-byte-swizzled layouts (K-major for Q, K and P; N-major for V) and checks
that the MMAs compute Q K^T and P V. Both warpgroups' P in registers (warpgroup 0's from its scores,
warpgroup 1's by ldmatrix from shared memory) is checked against the MMA's A fragment the same way.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashjit.jit.compile import compile_source
from flashjit.kernels.mla.spec import MLASpec
from flashjit.kernels.mla import tiling as mla_tiling_module
from flashjit.kernels.mla.tiling import SWIZZLE_ATOM, WGMMA_ROWS, mla_tiling, uses_wgmma
from flashjit.jit.render import render
from flashjit.jit.arch import dynamic_shared_limit

from wgmma_operands import read_k_major, read_n_major, smem_operand


QK, LATENT = 576, 512


@pytest.mark.parametrize("fields, wgmma", [
    ({"num_heads": 128}, True), ({"num_heads": 64}, True), ({"num_heads": 32, "max_q_len": 2}, True),
    ({"num_heads": 128, "arch": "sm_90a"}, True), ({"num_heads": 64, "dtype": "f16"}, True),
    ({"num_heads": 32}, False), ({"num_heads": 16, "max_q_len": 2}, False),
    ({"num_heads": 128, "kv_dtype": "e4m3"}, False),
    ({"num_heads": 128, "arch": "sm_80"}, False), ({"num_heads": 128, "arch": "sm_100"}, False),
])
def test_which_specs_take_the_wgmma_kernel(fields, wgmma):
    spec = MLASpec(**{"arch": "sm_90", **fields})
    tiling = mla_tiling(spec)
    assert uses_wgmma(spec) == tiling.wgmma == wgmma
    assert spec.compile_arch == ("sm_90a" if wgmma else spec.arch)
    if wgmma:
        assert (tiling.rows, tiling.threads, tiling.tile_tokens, tiling.stages) == (WGMMA_ROWS, 256, 64, 2)
        assert tiling.row_tiles == -(-spec.num_heads * spec.max_q_len // 64)
        assert tiling.ring_align == SWIZZLE_ATOM and tiling.p_pitch == 128 and tiling.convert_bytes == 0
        assert tiling.smem_bytes <= dynamic_shared_limit(spec.arch)


def test_render_and_compile_for_sm90a():
    spec = MLASpec(num_heads=128, arch="sm_90")
    source = render(spec)
    assert "constexpr bool WGMMA = true;" in source and "mla::attend_wgmma(args);" in source
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in source
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in source
    other = render(MLASpec(num_heads=16, arch="sm_90"))
    assert "constexpr bool WGMMA = false;" in other and "wgmma.mma_async" not in other and "attend_wgmma" not in other
    compiled = compile_source(source, spec.compile_arch, spec.name, extra_options=("--ptxas-options=-v",))
    assert compiled.cubin[:4] == b"\x7fELF" and b"flashjit_mla" in compiled.cubin
    spills = [line for line in compiled.log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills)
    assert "Potential Performance Loss" not in compiled.log  # no MMA serialized by the compiler
    half = render(MLASpec(num_heads=64, dtype="f16", arch="sm_90"))
    assert "m64n256k16.f32.f16.f16" in half


@pytest.mark.parametrize("fields", [{"num_heads": 128, "kv_dtype": "e4m3"}, {"num_heads": 64, "kv_dtype": "e5m2"},
                                    {"num_heads": 32, "max_q_len": 2, "kv_dtype": "e4m3", "dtype": "f16"}])
def test_fp8_latents_take_the_wgmma_kernel_where_switched_on(monkeypatch, fields):
    spec = MLASpec(arch="sm_90", **fields)
    assert not mla_tiling(spec).wgmma and spec.compile_arch == "sm_90"  # MLATuning.wgmma_fp8 is off by default
    table = dataclasses.replace(mla_tiling_module.MLA_TUNING, wgmma_fp8=True)
    assert uses_wgmma(spec, table) and mla_tiling(spec, table).wgmma  # a table of a sweep's
    monkeypatch.setattr(mla_tiling_module, "MLA_TUNING", table)  # the default table
    tiling = mla_tiling(spec)
    assert uses_wgmma(spec) and tiling.wgmma and spec.compile_arch == "sm_90a"
    assert (tiling.rows, tiling.threads, tiling.tile_tokens, tiling.stages) == (WGMMA_ROWS, 256, 64, 2)
    # Two stages as stored, one converted to 16-bit for the MMAs, each a whole number of swizzle atoms.
    assert (tiling.ring_bytes, tiling.convert_bytes) == (2 * 64 * QK, 64 * QK * 2)
    assert tiling.convert_bytes % SWIZZLE_ATOM == 0 and tiling.ring_bytes % SWIZZLE_ATOM == 0
    assert tiling.smem_bytes <= dynamic_shared_limit(spec.arch)
    assert not mla_tiling(MLASpec(arch="sm_80", **fields)).wgmma  # Hopper only


def test_fp8_wgmma_render_and_compile(monkeypatch):
    monkeypatch.setattr(mla_tiling_module, "MLA_TUNING", dataclasses.replace(mla_tiling_module.MLA_TUNING, wgmma_fp8=True))
    spec = MLASpec(num_heads=128, kv_dtype="e4m3", arch="sm_90")
    source = render(spec)
    assert "constexpr bool WGMMA = true;" in source and f"constexpr int CONVERT_BYTES = {64 * QK * 2};" in source
    assert "mla::attend_wgmma(args);" in source and "cvt.rn.f16x2.e4m3x2" in source
    compiled = compile_source(source, spec.compile_arch, spec.name, extra_options=("--ptxas-options=-v",))
    spills = [line for line in compiled.log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills)
    assert "Potential Performance Loss" not in compiled.log


def test_engine_compiles_wgmma_specs_for_sm90a(engine, fake_nvrtc):
    wgmma, plain = MLASpec(num_heads=128, arch="sm_90"), MLASpec(num_heads=16, arch="sm_90")
    engine.prewarm([wgmma, plain])
    assert fake_nvrtc.archs == {wgmma.name: "sm_90a", plain.name: "sm_90"}


# ---- the operands, through the descriptors --------------------------------------------------

M, TILE = 64, 64
Q_BLOCK, KV_BLOCK, HALF = M * 128, TILE * 128, LATENT // 2


def swizzled(row: int, chunk: int) -> int:  # mla/mma.cuh
    return chunk ^ (row & 7)


def operand_offset(rows_in: int, row: int, chunk: int) -> int:  # mla/mma.cuh, cfg::WGMMA
    return (chunk // 8) * (rows_in * 128) + row * 128 + swizzled(row, chunk % 8) * 16


def test_the_mmas_read_q_k_v_and_p_where_the_copies_put_them():
    rng = np.random.default_rng(0)
    q = rng.integers(-4, 5, (M, QK)).astype(np.float64)
    kv = rng.integers(-4, 5, (TILE, QK)).astype(np.float64)
    p = rng.integers(0, 5, (M, TILE)).astype(np.float64)
    # The CTA's shared memory as the kernel lays it out: the ring (stage 1 holds the tile), Q, P.
    stage_bytes = TILE * QK * 2
    ring_at = 2 * SWIZZLE_ATOM
    kv_at, q_at = ring_at + stage_bytes, ring_at + 2 * stage_bytes
    p_at = q_at + M * QK * 2
    smem = np.full((p_at + M * 128) // 2, np.nan)
    for r in range(M):
        for c in range(QK):
            smem[(q_at + operand_offset(M, r, c // 8) + (c % 8) * 2) // 2] = q[r, c]
    for key in range(TILE):
        for c in range(QK):
            smem[(kv_at + operand_offset(TILE, key, c // 8) + (c % 8) * 2) // 2] = kv[key, c]
    for r in range(M):  # warpgroup 0's P stores: row r, keys 8j + pair (+1)
        for key in range(TILE):
            smem[(p_at + r * 128 + swizzled(r, key // 8) * 16 + (key % 8) * 2) // 2] = p[r, key]

    s = np.zeros((M, TILE))
    for k in range(QK // 16):
        step = (k % 4) * 32
        a = smem_operand(q_at + (k // 4) * Q_BLOCK + step, 16)
        b = smem_operand(kv_at + (k // 4) * KV_BLOCK + step, 16)
        s += read_k_major(smem, a, M) @ read_k_major(smem, b, TILE).T
    np.testing.assert_array_equal(s, q @ kv.T)

    for group in (0, 1):
        o = np.zeros((M, HALF))
        v_at = kv_at + group * (HALF // 64) * KV_BLOCK
        for kk in range(TILE // 16):
            v = read_n_major(smem, smem_operand(v_at + kk * 16 * 128, KV_BLOCK), HALF)
            a = p_fragments(p, kk) if group == 0 else ldmatrix_fragments(smem, p_at, kk)
            o += a @ v
        np.testing.assert_array_equal(o, p @ kv[:, group * HALF:(group + 1) * HALF])


def p_fragments(p: np.ndarray, kk: int) -> np.ndarray:
    """Key step kk's A operand [64 x 16] as warpgroup 0's threads hold it: pa[kk][2 (j % 2) + h] is
    P at row first_row + 8h, keys 8j + pair (+1), for j = 2kk, 2kk + 1; read back by the m16n8k16
    A fragment's definition (registers 0-3: row g and g + 8 at keys 2t (+1), then at 8 + 2t (+1)),
    warp w holding rows 16w to 16w + 15."""
    a = np.full((M, 16), np.nan)
    for warp in range(4):
        for lane in range(32):
            quad, pair = lane // 4, (lane % 4) * 2
            first_row = warp * 16 + quad
            regs = {}
            for j in (2 * kk, 2 * kk + 1):
                for h in (0, 1):
                    regs[2 * (j % 2) + h] = (p[first_row + 8 * h, 8 * j + pair], p[first_row + 8 * h, 8 * j + pair + 1])
            g, t = lane // 4, lane % 4
            for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 8 + 2 * t), (g + 8, 8 + 2 * t))):
                a[warp * 16 + row, col:col + 2] = regs[reg]
    assert not np.isnan(a).any()
    return a


def ldmatrix_fragments(smem: np.ndarray, p_at: int, kk: int) -> np.ndarray:
    """Key step kk's A operand as warpgroup 1 loads it: ldmatrix.x4, lane l giving the address of row
    l % 8 of matrix l / 8 (p_row, p_sub); thread (g, t) receives row g, columns 2t (+1) of each
    matrix, its registers 0-3 read back by the A fragment's definition."""
    a = np.full((M, 16), np.nan)
    for warp in range(4):
        addresses = []
        for lane in range(32):
            p_row, p_sub = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4
            addresses.append(p_at + p_row * 128 + swizzled(p_row, 2 * kk + p_sub) * 16)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 8 + 2 * t), (g + 8, 8 + 2 * t))):
                at = addresses[8 * reg + g] + 4 * t  # matrix reg, its row g: two values at column 2t
                a[warp * 16 + row, col:col + 2] = smem[at // 2], smem[at // 2 + 1]
    assert not np.isnan(a).any()
    return a
