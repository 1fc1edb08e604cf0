"""The kernels' shared-memory and register layouts, defined here once and checked where they live.

Each function is the formula a kernel computes with a constexpr function or constant of its own;
layout_checks(spec, tiling) gives static_asserts, which render() pastes into that kernel's source
beside the ABI checks (abi.py), that the kernel's function returns these values over its whole
domain. A formula edited on one side only fails the NVRTC compile with a message naming both. The
CPU tests that replay the layouts lane by lane (test_fp8_layout.py and test_shared_wgmma.py in
tests/kernels/decode/, test_mla_layout.py in tests/kernels/mla/) replay these functions, so they
replay what the compiled kernel computes.

* fp8 tensor cores (decode_tc_fp8.cuh): which 4 key bytes lane column t reads at k-step ks
  (k_byte), and which head dim row r of O^T's m-tile mt holds (o_dim).
* Tensor-core rings (decode_common.cuh): the 16-byte chunk swizzle of a ring row (swizzled_chunk),
  and the block-major stage of the shared-prefix warpgroup kernel (block_major_offset).
* MLA (mla.cuh): the row swizzle (mla_swizzled), where a chunk of a Q or stage row lies
  (mla_operand_offset), the loader's threads per row and passes (mla_loader) and the warps'
  partition of keys and columns (mla_warps).
"""

from __future__ import annotations

MLA_QK, MLA_LATENT = 576, 512
MLA_ROW_BYTES = 2 * MLA_QK  # a 16-bit row of Q or of the latents the MMAs read


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- fp8 tensor cores -------------------------------------------------------------------------

def fp8_block(head_dim: int) -> int:
    """Head dims the fp8 lane layouts repeat over: three blocks of 32 at head_dim 96, else one of
    64 or blocks of 128."""
    return 32 if head_dim == 96 else min(head_dim, 128)


def fp8_k_byte(head_dim: int, ks: int, t: int) -> int:
    """The first of the 4 bytes of a key row that lane column t reads at k-step ks."""
    block = fp8_block(head_dim)
    steps = block // 16
    return block * (ks // steps) + block // 4 * t + 4 * (ks % steps)


def fp8_o_dim(head_dim: int, mt: int, r: int) -> int:
    """The head dim of row r (0..15) of O^T's m-tile mt."""
    block = fp8_block(head_dim)
    steps = block // 16
    return block * (mt // steps) + block // 8 * (r % 8) + 2 * (mt % steps) + r // 8


# ---- tensor-core rings ------------------------------------------------------------------------

def swizzled_chunk(row: int, chunk: int, row_chunks: int) -> int:
    """Where 16-byte chunk `chunk` of ring row `row` (row_chunks chunks a row) lies: XORed with the
    row's low 3 bits inside its 128 bytes; in a row of whole blocks and a half, its last 4 chunks
    with (row / 2) % 4."""
    if row_chunks % 8 == 4 and chunk >= row_chunks - 4:
        return chunk ^ (row // 2 % 4)
    return chunk ^ (row % 8)


def block_major_offset(tile: int, pitch: int, stage: int, key: int, column_bytes: int) -> int:
    """Byte offset, in a block-major ring of tile keys a stage and pitch bytes a key, of the byte
    column_bytes (a swizzled chunk's) of a stage's key: its 128-byte block a column of the stage."""
    return stage * tile * pitch + column_bytes // 128 * tile * 128 + key * 128 + column_bytes % 128


# ---- MLA --------------------------------------------------------------------------------------

def mla_swizzled(row: int, chunk: int) -> int:
    """Chunk `chunk` of a 16-bit MLA row, XOR-swizzled by the row's low 3 bits within its 128 bytes."""
    return chunk ^ (row & 7)


def mla_operand_offset(wgmma: bool, rows_in: int, row: int, chunk: int) -> int:
    """Where chunk `chunk` of row `row` lies in a buffer of rows_in 16-bit rows (Q's, or a stage's):
    swizzled rows of 1152 bytes, or for the wgmma kernel nine blocks of 64 columns of rows_in x 128
    bytes each (wgmma's 128-byte swizzle)."""
    if wgmma:
        return chunk // 8 * (rows_in * 128) + row * 128 + mla_swizzled(row, chunk % 8) * 16
    return row * MLA_ROW_BYTES + mla_swizzled(row, chunk) * 16


def mla_loader(threads: int, tile_tokens: int, kv_bytes: int) -> dict[str, int]:
    """The latent copies of one stage by `threads` threads: TPK threads a row, KPP rows a pass,
    PASSES passes, CPT 16-byte chunks a thread and row."""
    tpk = 4 if kv_bytes == 1 else 8
    kpp = threads // tpk
    return {"TPK": tpk, "KPP": kpp, "PASSES": _ceil_div(tile_tokens, kpp), "CPT": MLA_QK * kv_bytes // 16 // tpk}


def mla_warps(tiling) -> dict[str, int]:
    """The warps' partition of a stage: KS warps score each m-tile, KW keys each (NTQ n-tiles), and
    each warp owns CW output columns (NTV n-tiles)."""
    ks = tiling.warps // tiling.m_tiles
    kw = tiling.tile_tokens // ks
    cw = MLA_LATENT // tiling.warps
    return {"KS": ks, "KW": kw, "NTQ": kw // 8, "CW": cw, "NTV": cw // 8}


def mla_loader_threads(tiling) -> int:
    """The threads that copy the latents: the CTA's, or in the wgmma kernel one warpgroup's."""
    return 128 if tiling.wgmma else 32 * tiling.warps


# ---- the checks -------------------------------------------------------------------------------

def _check(expression: str, value: int, origin: str) -> str:
    return f'static_assert({expression} == {value}, "layout: {expression} is not flashjit.jit.layouts.{origin} ({value})");'


def _swizzle_checks(row_chunks: int) -> list[str]:
    return [_check(f"decode::swizzled_chunk({row}, {chunk})", swizzled_chunk(row, chunk, row_chunks),
                   f"swizzled_chunk({row}, {chunk}, {row_chunks})")
            for row in range(8) for chunk in range(row_chunks)]


def _decode_checks(spec, tiling) -> list[str]:
    if not tiling.tensor_cores:
        return []
    d = spec.head_dim
    checks = _swizzle_checks(d * spec.kv_bytes // 16) if tiling.swizzle else []
    if spec.kv_is_fp8:
        checks += [_check(f"decode::k_byte({ks}, {t})", fp8_k_byte(d, ks, t), f"fp8_k_byte({d}, {ks}, {t})")
                   for ks in range(d // 16) for t in range(4)]
        checks += [_check(f"decode::o_dim({mt}, {r})", fp8_o_dim(d, mt, r), f"fp8_o_dim({d}, {mt}, {r})")
                   for mt in range(d // 16) for r in range(16)]
    if tiling.shared_wgmma:
        tile, pitch, row_chunks = tiling.tile_tokens, tiling.k_pitch, d * spec.kv_bytes // 16
        for stage in range(tiling.stages):
            for key in (0, 1, 7, 9, tile - 1):
                for chunk in range(row_chunks):
                    column = swizzled_chunk(stage * tile + key, chunk, row_chunks) * 16
                    checks.append(_check(f"decode::block_major_offset({tile}, {pitch}, {stage}, {key}, {column})",
                                         block_major_offset(tile, pitch, stage, key, column),
                                         f"block_major_offset({tile}, {pitch}, {stage}, {key}, {column})"))
    return checks


def _mla_checks(spec, tiling) -> list[str]:
    checks = [_check(f"mla::swizzled({row}, {chunk})", mla_swizzled(row, chunk), f"mla_swizzled({row}, {chunk})")
              for row in range(8) for chunk in range(MLA_ROW_BYTES // 16)]
    for rows_in in sorted({tiling.rows, tiling.tile_tokens}):
        for row in sorted({0, 1, 7, 8, rows_in - 1}):
            for chunk in range(MLA_ROW_BYTES // 16):
                checks.append(_check(f"mla::operand_offset<{rows_in}>({row}, {chunk})",
                                     mla_operand_offset(tiling.wgmma, rows_in, row, chunk),
                                     f"mla_operand_offset({tiling.wgmma}, {rows_in}, {row}, {chunk})"))
    threads = mla_loader_threads(tiling)
    for name, value in mla_loader(threads, tiling.tile_tokens, spec.kv_bytes).items():
        checks.append(_check(f"mla::LatentCopies<{threads}>::{name}", value,
                             f"mla_loader({threads}, {tiling.tile_tokens}, {spec.kv_bytes})['{name}']"))
    for name, value in mla_warps(tiling).items():
        checks.append(_check(f"mla::{name}", value, f"mla_warps(tiling)['{name}']"))
    return checks


def _as_source(checks: list[str]) -> str:
    if not checks:
        return ""
    return "\n".join(["// The kernel's layouts (flashjit.jit.layouts), checked value by value.", *checks])


def decode_layout_checks(spec, tiling) -> str:
    """The layout static_asserts of a decode kernel's source; '' for one with none (CUDA cores)."""
    return _as_source(_decode_checks(spec, tiling))


def mla_layout_checks(spec, tiling) -> str:
    """The layout static_asserts of an MLA kernel's source."""
    return _as_source(_mla_checks(spec, tiling))
