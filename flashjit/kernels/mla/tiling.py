"""Thread-block shape of the MLA decode kernel (templates/mla/mma.cuh): an MLASpec's tiling,
derived from a table of tuned constants, as tiling.py does for the decode kernels.

One CTA serves ROWS query rows (heads x query tokens of one request: 16, 32 or 64, the MMA's M in
16-row m-tiles) over one work item's span of the latent cache. Each pipeline stage holds
tile_tokens latent rows of 576 values in shared memory; every warp scores a slice of them for one
m-tile (S = Q K^T, 576 wide), the probabilities meet in shared memory, and every warp accumulates
its own slice of the 512 output columns for all rows (O += P V, V being the same rows' first 512
values). On Hopper, 16-bit latents whose request fills 64-row tiles take the warpgroup kernel
instead (templates/mla/wgmma.cuh, compiled for sm_90a): two warpgroups, Q and the stages
in 128-byte-swizzled blocks of 64 columns that wgmma reads as they are. Python is the one source of
these numbers: the template receives them as constants and static_asserts their invariants; the
launcher takes grid, block and shared memory from here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ...jit.arch import SWIZZLE_ATOM, dynamic_shared_limit, has_wgmma
from ..worklist_kernel import Entries

if TYPE_CHECKING:
    from .spec import MLASpec

MMA_M = 16
ENTRY = "flashjit_mla"
P_PAD = 16  # bytes after each row of P in shared memory: rows 16 bytes apart keep ldmatrix conflict-free
RING_ALIGN = 128
WGMMA_ROWS = 64        # a warpgroup MMA's M


def uses_wgmma(spec: MLASpec, table: MLATuning | None = None) -> bool:
    """The warpgroup kernel: Hopper, 16-bit latents (fp8 ones too where the table's wgmma_fp8 is
    set), and a request whose heads x query tokens fill 64-row tiles (128 heads, or 64; 32 with two
    query tokens). table: MLA_TUNING when None."""
    table = MLA_TUNING if table is None else table
    return (has_wgmma(spec.arch) and (table.wgmma_fp8 or not spec.kv_is_fp8)
            and spec.num_heads * spec.max_q_len >= WGMMA_ROWS)


@dataclasses.dataclass(frozen=True)
class MLATiling:
    rows: int            # query rows per CTA (a multiple of 16)
    warps: int           # warps per CTA: warps / m_tiles score each m-tile, each warp owns 512 / warps columns
    tile_tokens: int     # latent rows per pipeline stage
    stages: int          # stages in flight in the shared-memory ring
    row_tiles: int       # CTAs along the rows of one request
    min_ctas: int        # __launch_bounds__'s CTAs per SM
    q_bytes: int         # shared memory of Q: rows x 576 16-bit values
    ring_bytes: int      # the ring: stages x tile_tokens rows as stored (16-bit or fp8)
    convert_bytes: int   # fp8: one stage converted to 16-bit; 0 otherwise
    p_pitch: int         # bytes per row of P (tile_tokens 16-bit values and a pad)
    smem_bytes: int      # dynamic shared memory, with the slack to align the ring
    merge_chunk: int     # partials the fused merge loads at once
    merge_cells: int     # cells (a row's 4 columns) a thread of the fused merge combines at once
    l2_prefetch: int     # bytes the L2 fetches around each 16-byte copy
    wgmma: bool = False  # the warpgroup kernel (mla/wgmma.cuh, sm_90a): 64 rows, two warpgroups
    fused_merge: bool = True   # split requests merge in the decode kernel (worklist/kernel_core.cuh)
    heads_first: bool = True   # grid x: work items (one latent head each); y: row tiles
    ring_align: int = RING_ALIGN
    entry: str = ENTRY

    @property
    def m_tiles(self) -> int:
        return self.rows // MMA_M

    @property
    def key_slices(self) -> int:
        """Warps scoring one m-tile, each over tile_tokens / key_slices keys."""
        return self.warps // self.m_tiles

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def entries(self) -> Entries:
        """The entry points of an MLA module, which Kernel loads: the attend kernel merges split requests."""
        return Entries(self.entry)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    def grid(self, work_items: int, kv_heads: int = 1) -> tuple[int, int, int]:
        return (work_items * kv_heads, self.row_tiles, 1)


@dataclasses.dataclass(frozen=True)
class MLATuningRow:
    fp8: bool
    rows: int
    warps: int
    tile_tokens: int
    stages: int
    min_ctas: int
    wgmma: bool = False
    arch: str | None = None  # the arch this row is tuned for (jit/arch.py); None: every arch without a row of its own

    @property
    def key(self) -> tuple[str | None, bool, int, bool]:
        return (self.arch, self.fp8, self.rows, self.wgmma)


@dataclasses.dataclass(frozen=True)
class MLATuning:
    rows: tuple[MLATuningRow, ...]
    merge_chunk: int = 8
    # 1 until more has been timed on a GPU: the last CTA of a 64-row tile merges 32 cells a thread,
    # each a round trip to L2 after the one before; several at once keep more loads in flight.
    merge_cells: int = 1
    l2_prefetch: int = 128
    # fp8 latents on the warpgroup kernel too (each stage converted to 16-bit in shared memory, in
    # the layout its MMAs read): off until the GPU tests and benchmarks/mla.py have run it, so fp8
    # specs take the mma.sync kernel.
    wgmma_fp8: bool = False

    def row(self, fp8: bool, rows: int, wgmma: bool = False, arch: str | None = None) -> MLATuningRow:
        """The row tuned for arch, else the row for every arch (arch None)."""
        for key in ((arch, fp8, rows, wgmma), (None, fp8, rows, wgmma)):
            for row in self.rows:
                if row.key == key:
                    return row
        raise KeyError(f"no MLA tuning row for {'fp8' if fp8 else '16-bit'} latents at {rows} rows per CTA"
                       f"{' (wgmma)' if wgmma else ''}")

    def with_rows(self, *, fp8: bool | None = None, rows: int | None = None, wgmma: bool = False,
                  **changes) -> "MLATuning":
        """A copy whose rows of this cache width and CTA rows (None: every one) of the mma.sync kernel,
        or the wgmma kernel's, take changes (sweeps)."""
        new = tuple(dataclasses.replace(r, **changes)
                    if fp8 in (None, r.fp8) and rows in (None, r.rows) and r.wgmma == wgmma else r
                    for r in self.rows)
        return dataclasses.replace(self, rows=new)


# Starting points, not yet swept on the GPU. 16 rows (16 heads, memory-bound): two CTAs per SM, so
# one CTA's barriers overlap the other's copies. 64 rows (128 heads, compute-bound): 8 warps, each
# with 64 output columns of 4 m-tiles (128 accumulator registers). fp8 rings hold twice the stages.
# The wgmma rows: two warpgroups, stages of 64 keys (S is one 64 x 64 MMA chain), two of them beside
# Q and P in 225 KB; with fp8 latents two stages as stored and one converted to 16-bit, as much.
MLA_TUNING = MLATuning(rows=(
    #            fp8    rows warps tile stages min_ctas
    MLATuningRow(False, 16,  4,    32,  2,     2),
    MLATuningRow(False, 32,  8,    32,  3,     1),
    MLATuningRow(False, 64,  8,    32,  3,     1),
    MLATuningRow(True,  16,  4,    32,  3,     2),
    MLATuningRow(True,  32,  8,    32,  4,     1),
    MLATuningRow(True,  64,  8,    32,  4,     1),
    MLATuningRow(False, 64,  8,    64,  2,     1, wgmma=True),
    MLATuningRow(True,  64,  8,    64,  2,     1, wgmma=True),
))


def cta_rows(total_rows: int) -> int:
    """Query rows per CTA for a request's heads x query tokens: 16, 32 or 64."""
    for rows in (16, 32):
        if total_rows <= rows:
            return rows
    return 64


def mla_tiling(spec: MLASpec, table: MLATuning | None = None) -> MLATiling:
    """The tiling of a spec under table (MLA_TUNING when None): the wgmma kernel's where uses_wgmma,
    else cta_rows' rows a CTA, or half as many (down to 16) while its shared memory is more than the
    spec's arch gives a block."""
    table = MLA_TUNING if table is None else table
    if uses_wgmma(spec, table):
        return _wgmma_tiling(spec, table)
    rows = cta_rows(spec.num_heads * spec.max_q_len)
    tiling = _tiling(spec, table, rows)
    while tiling.smem_bytes > dynamic_shared_limit(spec.arch) and tiling.rows > MMA_M:
        tiling = _tiling(spec, table, tiling.rows // 2)
    return tiling


def _tiling(spec: MLASpec, table: MLATuning, rows: int) -> MLATiling:
    total = spec.num_heads * spec.max_q_len
    row = table.row(spec.kv_is_fp8, rows, arch=spec.arch)
    qk_row_bytes = spec.qk_dim * 2  # 16-bit Q and converted latent rows
    q_bytes = rows * qk_row_bytes
    ring_bytes = row.stages * row.tile_tokens * spec.qk_dim * spec.kv_bytes
    convert_bytes = row.tile_tokens * qk_row_bytes if spec.kv_is_fp8 else 0
    p_pitch = row.tile_tokens * 2 + P_PAD
    smem = ring_bytes + convert_bytes + q_bytes + rows * p_pitch + RING_ALIGN - 16
    return MLATiling(rows=rows, warps=row.warps, tile_tokens=row.tile_tokens, stages=row.stages,
                     row_tiles=-(-total // rows), min_ctas=row.min_ctas, q_bytes=q_bytes, ring_bytes=ring_bytes,
                     convert_bytes=convert_bytes, p_pitch=p_pitch, smem_bytes=smem, merge_chunk=table.merge_chunk,
                     merge_cells=table.merge_cells, l2_prefetch=table.l2_prefetch)


def _wgmma_tiling(spec: MLASpec, table: MLATuning) -> MLATiling:
    row = table.row(spec.kv_is_fp8, WGMMA_ROWS, wgmma=True, arch=spec.arch)
    qk_row_bytes = spec.qk_dim * 2
    q_bytes = WGMMA_ROWS * qk_row_bytes
    ring_bytes = row.stages * row.tile_tokens * spec.qk_dim * spec.kv_bytes
    convert_bytes = row.tile_tokens * qk_row_bytes if spec.kv_is_fp8 else 0  # the stage the MMAs read
    p_pitch = row.tile_tokens * 2  # P: one swizzled 128-byte row of 64 keys per query row
    smem = ring_bytes + convert_bytes + q_bytes + WGMMA_ROWS * p_pitch + SWIZZLE_ATOM - 16
    return MLATiling(rows=WGMMA_ROWS, warps=row.warps, tile_tokens=row.tile_tokens, stages=row.stages,
                     row_tiles=-(-spec.num_heads * spec.max_q_len // WGMMA_ROWS), min_ctas=row.min_ctas,
                     q_bytes=q_bytes, ring_bytes=ring_bytes, convert_bytes=convert_bytes, p_pitch=p_pitch,
                     smem_bytes=smem, merge_chunk=table.merge_chunk, merge_cells=table.merge_cells,
                     l2_prefetch=table.l2_prefetch, wgmma=True, ring_align=SWIZZLE_ATOM)
