"""The shared-prefix kernel's warpgroup path (templates/decode/tc.cuh, cfg::SHARED_WGMMA) on
the CPU: a stage laid out block-major as PagedKVStage::copy writes it, read back through the
descriptors the kernel issues (S = Q K^T: K K-major; O += P V: V N-major) and through the
ldmatrix addresses of the ordinary records in the same kernel."""

from __future__ import annotations

import numpy as np
import pytest

from flashjit.kernels import layouts
from flashjit.kernels.decode.spec import DecodeSpec
from flashjit.kernels.decode.tiling import SWIZZLE_ATOM, decode_tiling

from wgmma_operands import read_k_major, read_n_major, smem_operand


def test_the_engine_compiles_the_wgmma_shared_kernels_for_sm90a(engine, fake_nvrtc):
    """Only the shared-prefix kernels that take the warpgroup path compile for sm_90a."""
    shared = DecodeSpec(128, "bf16", group_size=4, arch="sm_90", tensor_cores=True, shared_prefix=True)
    plain = shared.replace(shared_prefix=False)
    d96 = DecodeSpec(96, "bf16", group_size=4, arch="sm_90", tensor_cores=True, shared_prefix=True)
    engine.prewarm([shared, plain, d96])
    assert fake_nvrtc.archs == {shared.name: "sm_90a", plain.name: "sm_90", d96.name: "sm_90"}


def block_major_offset(stage: int, key: int, column: int, tile: int, pitch: int) -> int:
    """Byte offset of 16-byte chunk `column` of a stage's key row (PagedKVStage::copy, cfg::SHARED_WGMMA):
    the chunk swizzled by its ring row, its 128-byte block a column of the stage (flashjit.jit.layouts,
    whose values the kernel's source asserts its own functions give)."""
    column_bytes = layouts.swizzled_chunk(stage * tile + key, column, pitch // 16) * 16
    return layouts.block_major_offset(tile, pitch, stage, key, column_bytes)


def stage_memory(values: np.ndarray, stage: int, tile: int, pitch: int, at: int) -> np.ndarray:
    """Shared memory (16-bit slots, NaN where nothing was copied) holding values [tile keys x D] in `stage`."""
    memory = np.full((at + (stage + 1) * tile * pitch) // 2, np.nan)
    for key in range(tile):
        for column in range(values.shape[1] // 8):
            start = (at + block_major_offset(stage, key, column, tile, pitch)) // 2
            memory[start:start + 8] = values[key, column * 8:column * 8 + 8]
    return memory


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_warpgroup_mmas_read_k_and_v_where_the_copies_put_them(head_dim):
    spec = DecodeSpec(head_dim, "bf16", group_size=4, page_size=16, arch="sm_90", tensor_cores=True,
                      shared_prefix=True)
    tiling = decode_tiling(spec)
    assert tiling.shared_wgmma and tiling.ring_align == SWIZZLE_ATOM
    tile, pitch, stage = tiling.tile_tokens, tiling.k_pitch, tiling.stages - 1
    assert tile == 64 and pitch == head_dim * 2 and tiling.v_pitch == pitch
    row_block = tile * 128  # decode/tc.cuh's ROW_BLOCK
    rng = np.random.default_rng(head_dim)
    kv = rng.integers(-4, 5, (tile, head_dim)).astype(np.float64)
    q = rng.integers(-4, 5, (64, head_dim)).astype(np.float64)
    p = rng.integers(0, 5, (64, tile)).astype(np.float64)
    at = 2 * SWIZZLE_ATOM  # the ring's start, on a swizzle atom as aligned_ring puts it
    memory = stage_memory(kv, stage, tile, pitch, at)
    stage_at = at + stage * tile * pitch
    assert stage_at % SWIZZLE_ATOM == 0

    s = np.zeros((64, tile))
    for k in range(head_dim // 16):  # wgmma_rs_kmajor(s, qa[k], smem_operand(k_at + k / 4 * ROW_BLOCK + k % 4 * 32, 16))
        keys = read_k_major(memory, smem_operand(stage_at + k // 4 * row_block + k % 4 * 32, 16), tile)
        s += q[:, 16 * k:16 * k + 16] @ keys.T
    np.testing.assert_array_equal(s, q @ kv.T)

    o = np.zeros((64, head_dim))
    for i in range(tile // 16):  # wgmma_rs_nmajor(o, pa[i], smem_operand(v_at + i * 16 * 128, ROW_BLOCK))
        o += p[:, 16 * i:16 * i + 16] @ read_n_major(memory, smem_operand(stage_at + i * 16 * 128, row_block), head_dim)
    np.testing.assert_array_equal(o, p @ kv)


def ldmatrix_rows(memory: np.ndarray, addresses: list[int]) -> list[np.ndarray]:
    """The four 8 x 8 matrices of ldmatrix.x4: lane l gives the address of row l % 8 of matrix l / 8."""
    return [np.array([memory[addresses[8 * m + r] // 2:addresses[8 * m + r] // 2 + 8] for r in range(8)])
            for m in range(4)]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ordinary_records_ldmatrix_the_block_major_stage(head_dim):
    """decode/tc.cuh's k_ld and v_ld with K_ROW = V_ROW = 128 and ROW_BLOCK = TILE x 128: each warp's
    slice of 16 keys, every k-step of K and n-tile pair of V, reads the keys and dims it multiplies."""
    spec = DecodeSpec(head_dim, "bf16", group_size=4, page_size=16, arch="sm_90", tensor_cores=True,
                      shared_prefix=True)
    tiling = decode_tiling(spec)
    tile, pitch, stage = tiling.tile_tokens, tiling.k_pitch, tiling.stages - 1
    kv = np.random.default_rng(1).integers(-50, 50, (tile, head_dim)).astype(np.float64)
    memory = stage_memory(kv, stage, tile, pitch, 0)
    stage_at, row_block = stage * tile * pitch, tile * 128
    for slice_ in range(tile // 16):
        for k in range(head_dim // 16):  # K: matrix m holds keys 8 (m >> 1).., dims 16k + 8 (m & 1)..
            addresses = []
            for lane in range(32):
                mat, mrow = lane // 8, lane % 8
                k_ld = (slice_ * 16 + mrow + (mat >> 1) * 8) * 128
                addresses.append(stage_at + k_ld + k // 4 * row_block + ((2 * k % 8) ^ (mat & 1) ^ mrow) * 16)
            for m, got in enumerate(ldmatrix_rows(memory, addresses)):
                key, dim = slice_ * 16 + (m >> 1) * 8, 16 * k + (m & 1) * 8
                np.testing.assert_array_equal(got, kv[key:key + 8, dim:dim + 8])
        for n in range(0, head_dim // 8, 2):  # V (transposed): matrix m holds keys 8 (m & 1).., dims 8 (n + (m >> 1))..
            addresses = []
            for lane in range(32):
                mat, mrow = lane // 8, lane % 8
                v_ld = (slice_ * 16 + mrow + (mat & 1) * 8) * 128
                addresses.append(stage_at + v_ld + n // 8 * row_block + ((n % 8) ^ (mat >> 1) ^ mrow) * 16)
            for m, got in enumerate(ldmatrix_rows(memory, addresses)):
                key, dim = slice_ * 16 + (m & 1) * 8, 8 * (n + (m >> 1))
                np.testing.assert_array_equal(got, kv[key:key + 8, dim:dim + 8])
