"""Thread-block shape of the decode kernels: a spec's tiling, derived from a table of tuned constants.

Python is the single source of these numbers: the template receives them as constants (and
static_asserts their invariants) and the launcher uses them for the grid and block. Every tuned
number sits in one frozen table, TUNING, keyed by what it depends on; decode_tiling(spec, table)
derives the rest, so a sweep passes another table (Tuning.replace, Tuning.with_rows) and changes
nothing here. Timings in the rationale are µs on an H200, L2 flushed, at b16 L8192 unless named.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from ...jit.arch import HOPPER, SWIZZLE_ATOM
from ..worklist_kernel import MERGE_ENTRY, Entries

if TYPE_CHECKING:
    from .spec import DecodeSpec

VEC = 8  # 16-bit elements per 16-byte load
MMA_M = 16  # query rows per 16-bit tensor-core CTA: the MMA's M
MERGE_COLS_PER_THREAD = 4  # output columns per merge thread: one float4
CUDA_CORE_RING_ALIGN = 16  # the CUDA-core kernel's 16-byte copies need no more


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    vec: int            # 16-bit elements per 16-byte load
    chunks_per_row: int  # 16-byte chunks in one K/V row
    bdx: int            # lanes sharing one row (power of two, for the xor-shuffle)
    rows: int           # query rows per CTA
    rows_pad: int       # rows rounded up so a block is whole warps
    bdz: int            # token-parallel slices
    row_tiles: int      # CTAs along the rows of one KV head
    tile_tokens: int    # tokens per pipeline stage
    stages: int
    tensor_cores: bool
    smem_bytes: int     # dynamic shared memory (tensor-core kernel)
    k_pitch: int        # bytes per K row in shared memory (tensor-core kernel)
    v_pitch: int        # bytes per V row
    l2_prefetch: int    # bytes the L2 fetches around each 16-byte copy (0: no hint, 128 or 256)
    swizzle: bool       # shared-memory rows unpadded, 16-byte chunks XOR-swizzled (tensor-core kernels)
    ring_align: int     # the shared-memory ring starts at a multiple of this (tensor-core kernels)
    heads_first: bool   # grid x runs the KV heads of a work item side by side (see CtaCoords)
    fused_merge: bool   # split requests merge in the decode kernel (merge_if_last), not in flashjit_merge
    static_share: int   # % of a split CTA's fair share of tiles read before sharing the rest (100: none)
    min_ctas: int       # __launch_bounds__'s CTAs per SM: ptxas caps registers to fit them
    col_split: int      # warps sharing a 16-key slice, each with a part of O's columns (16-bit tensor cores)
    merge_chunk: int    # partials the fused merge loads at once (tensor-core kernels)
    merge_lanes: int    # merge threads across one output row (4 columns each)
    merge_split_lanes: int  # merge threads reading different partials
    q_smem_bytes: int = 0   # 16-bit tensor cores: Q's MMA fragments in shared memory after the ring (0: in registers)
    # 16-bit tensor cores with col_split > 1: each warp of a slice computes S over its share of the
    # k-steps (its share of Q in registers), and the slice sums the shares in shared memory.
    split_scores: bool = False
    # Shared-prefix kernels: warps whose 16-row tiles one shared record's CTA holds, each warp its
    # own rows over every key (1: the rows of one MMA tile, as an ordinary record's).
    shared_row_warps: int = 1
    # Slices of a stage such a warp attends in one softmax step (its S chains side by side).
    shared_step: int = 1
    # Shared records on Hopper's warpgroup MMAs (sm_90a): the CTA's 4 warps one warpgroup of 64 rows,
    # K and V read from a block-major ring (uses_shared_wgmma).
    shared_wgmma: bool = False
    # Shared-prefix kernels: KV heads one CTA of a short own item may attend, a warp each over 16
    # keys a stage (the record's last field picks it; 1: a CTA per head, as an ordinary record's).
    own_head_pack: int = 1
    # Shared-prefix kernels whose requests' rows fit one row tile: a plan whose working CTAs fit one
    # wave merges in the kernel, each request's last own item waiting for its other partials
    # (merge_when_written); other plans launch flashjit_merge.
    waiting_merge: bool = False

    @property
    def entry(self) -> str:
        """The decode kernel's entry point."""
        return "flashjit_decode"

    @property
    def entries(self) -> Entries:
        """The entry points a module of this tiling has, which Kernel loads."""
        return Entries(self.entry, self.packed_entry, None if self.fused_merge else MERGE_ENTRY)

    @property
    def packed_entry(self) -> str | None:
        """The decode entry point of a plan with packed own items (own_head_pack > 1), else None."""
        return "flashjit_decode_packed" if self.own_head_pack > 1 else None

    def head_pack(self, kv_heads: int) -> int:
        """KV heads one CTA of a short own item attends in a model of kv_heads: own_head_pack where
        it divides them (a CTA's heads are one pack's), else 1."""
        return self.own_head_pack if kv_heads % self.own_head_pack == 0 else 1

    @property
    def merge_threads(self) -> int:
        return self.merge_lanes * self.merge_split_lanes

    @property
    def merge_block(self) -> tuple[int, int, int]:
        return (self.merge_lanes, self.merge_split_lanes, 1)

    def grid(self, work_items: int, kv_heads: int, packed_items: int = 0) -> tuple[int, int, int]:
        """The decode kernel's grid for work_items x kv_heads x row tiles (matching CtaCoords); with
        packed_items, the packed entry point's, whose last packed_items take a CTA for each
        own_head_pack heads."""
        if packed_items:
            return ((work_items - packed_items) * kv_heads + packed_items * (kv_heads // self.own_head_pack),
                    self.row_tiles, 1)
        if self.heads_first:
            return (work_items * kv_heads, self.row_tiles, 1)
        return (work_items, kv_heads, self.row_tiles)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.bdx, self.rows_pad, self.bdz)

    @property
    def threads(self) -> int:
        return self.bdx * self.rows_pad * self.bdz


@dataclasses.dataclass(frozen=True)
class TensorCoreRow:
    """The tuned constants of the tensor-core kernel for one K/V width and head_dim."""

    fp8: bool           # K/V in fp8, else 16-bit
    head_dim: int
    warps: int          # warps per CTA: each slice of col_split warps takes 16 keys of every stage
    col_split: int      # warps per 16-key slice, each keeping head_dim / col_split columns of O
    stages: int         # K/V tiles in flight in the shared-memory ring
    min_ctas: int       # __launch_bounds__'s CTAs per SM (1: no register cap; caps spill and cost more than they gain)
    swizzle: bool       # rows unpadded, 16-byte chunks XOR-swizzled; else padded by k_pad and v_pad
    k_pad: int          # bytes after each K row where unswizzled (32 keeps sectors whole, 16 avoids bank conflicts)
    v_pad: int          # bytes after each V row where unswizzled
    static_share: int   # % of a split CTA's fair share read before it claims tiles one at a time (100: fixed split)
    q_in_smem: bool = False  # 16-bit: Q's MMA fragments in shared memory, read at each k-step (else in registers)
    split_scores: bool = False  # 16-bit, col_split > 1: each warp of a slice takes a share of S's k-steps
    # Shared-prefix records (rows by warp): slices of a stage a warp attends in one softmax step, its
    # S chains side by side (more registers, the same CTAs per SM where the row sets it above 1)
    shared_step: int = 1
    arch: str | None = None  # the arch this row is tuned for (jit/arch.py); None: every arch without a row of its own

    @property
    def key(self) -> tuple[str | None, bool, int]:
        return (self.arch, self.fp8, self.head_dim)


@dataclasses.dataclass(frozen=True)
class CudaCoreTuning:
    """The tuned constants of the CUDA-core kernel (a thread row per query row, 16-byte vectors along head_dim)."""

    max_rows: int         # query rows per CTA; more rows take more row tiles
    threads: int          # threads per block, which token-parallel slices fill up to
    stages: int           # K/V tiles in flight
    max_tile_tokens: int  # tokens per stage at most
    tile_elements: int    # tokens x head_dim per stage otherwise
    fused_merge: bool     # split requests merge in the decode kernel rather than in flashjit_merge


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Every tuned constant of the decode kernels, each keyed by what it depends on."""

    tensor_cores: tuple[TensorCoreRow, ...]  # one row per (arch, fp8, head_dim); arch None: the default
    cuda_cores: CudaCoreTuning
    fp8_rows: int        # query rows per fp8 tensor-core CTA (16-bit: MMA_M)
    ring_align: int      # the tensor-core ring starts at a multiple of this many bytes
    fused_merge: bool    # tensor-core kernels merge split requests in the decode kernel
    merge_chunk: int     # partials the fused merge loads at once
    l2_prefetch: int     # bytes the L2 fetches around each 16-byte copy (0: no hint, 128 or 256), both kernels
    heads_first: bool    # grid x runs the KV heads of a work item side by side, both kernels
    merge_threads: int   # threads of one merge block (flashjit_merge, and the fused merge's lanes)

    def row(self, fp8: bool, head_dim: int, arch: str | None = None) -> TensorCoreRow:
        """The row tuned for arch, else the row for every arch (arch None)."""
        for key in ((arch, fp8, head_dim), (None, fp8, head_dim)):
            for row in self.tensor_cores:
                if row.key == key:
                    return row
        raise KeyError(f"no tensor-core row for {'fp8' if fp8 else '16-bit'} K/V at head_dim {head_dim}")

    def replace(self, **changes) -> Tuning:
        """A copy with some of the table-wide constants changed."""
        return dataclasses.replace(self, **changes)

    def with_rows(self, *, fp8: bool | None = None, head_dim: int | None = None, **changes) -> Tuning:
        """A copy whose tensor-core rows of this K/V width and head_dim (None: every one) take changes."""
        rows = tuple(dataclasses.replace(row, **changes) if fp8 in (None, row.fp8) and head_dim in (None, row.head_dim)
                     else row for row in self.tensor_cores)
        return dataclasses.replace(self, tensor_cores=rows)


TUNING = Tuning(
    tensor_cores=(
        #             fp8    head_dim warps col_split stages min_ctas swizzle k_pad v_pad static_share
        # swizzled rows keep each copied sector whole with ldmatrix conflict-free, as at head_dim 128
        # (shared records: 2 slices a step, 162 registers and 3 CTAs/SM as with 1)
        TensorCoreRow(False, 64,      4,    1,        4,     1,       True,   16,   16,   100, shared_step=2),
        # 192-byte rows, swizzled as a block and a half (swizzled_chunk); 6 warps make the copy's
        # threads whole rows of 12 chunks (PagedKVStage's EVEN layout); tile 96; capped at 168
        # registers for 2 CTAs/SM without spills (180 uncapped: 1 CTA/SM). Unmeasured.
        TensorCoreRow(False, 96,      6,    1,        2,     2,       True,   16,   16,   100),
        # 2 stages beat 3 by 0.1-2.7% at the same 2 CTAs/SM; swizzled rows beat 16-byte pads (139.5 against 148.0 us)
        # (shared records: the whole stage in one step, 239 registers and 2 CTAs/SM as with 1)
        TensorCoreRow(False, 128,     4,    1,        2,     1,       True,   16,   16,   100, shared_step=4),
        # two warps per slice keep O off the 255-register limit, each with half of S's k-steps (193
        # registers; repeating S took 224 and 3 stages: 262 µs against 258 at b16 L8192); swizzling
        # spills, so 32-byte pads; sharing 6% faster
        TensorCoreRow(False, 256,     4,    2,        2,     1,       False,  32,   32,   75, split_scores=True),
        # head_dim 512: four warps per slice, each with a quarter of S's k-steps (and of Q, in registers)
        # and of O: 98% of the read floor at b16 L8192, where Q in shared memory and S repeated reached 62%
        TensorCoreRow(False, 512,     8,    4,        2,     1,       False,  32,   32,   75, split_scores=True),
        # 64-byte rows have too few chunks to swizzle; unpadded K rows already interleave, V rows take 16 bytes
        TensorCoreRow(True,  64,      4,    1,        4,     1,       False,  0,    16,   100),
        # 96-byte rows: the lanes read K in 8-byte pieces, conflict-free unpadded; V rows 16 mod 64
        # bytes apart; 6 warps make the copy's threads whole rows of 6 chunks; 109 registers, 3 CTAs/SM (unmeasured)
        TensorCoreRow(True,  96,      6,    1,        2,     1,       False,  0,    16,   100),
        # 2 stages match 3 at 4 CTAs/SM; 32-byte pads beat 16 (83.5 against 86.5 us), swizzling no faster
        TensorCoreRow(True,  128,     4,    1,        2,     1,       False,  32,   32,   100),
        # no column split, so 2 warps give the 32-key tile; swizzled rows beat padded ones (145.4 against 153.4 us)
        TensorCoreRow(True,  256,     2,    1,        3,     1,       True,   16,   16,   100),
        # head_dim 512: four warps per slice, each keeping a quarter of O^T (all of it takes 128 registers); 185 registers
        TensorCoreRow(True,  512,     8,    4,        3,     1,       True,   16,   16,   100),
    ),
    cuda_cores=CudaCoreTuning(
        max_rows=8,
        threads=128,
        stages=4,
        max_tile_tokens=32,
        tile_elements=2048,  # fp8 stages keep the 16-bit token count: registers, not bytes, bound them
        fused_merge=False,   # fused it is slower: b16 L8192 (group 4) 268.6 against 256.4 with the merge launch
    ),
    fp8_rows=8,        # fp8 rows are the MMA's N: one n-tile of 8 (two would share the K/V conversions, but spill)
    ring_align=128,    # a 16-byte-aligned ring fetches split 32-byte sectors twice (25.2 M L2 sectors for 16.8 M)
    fused_merge=True,  # the last CTA of a split group merging its partials is 1-3% faster than a second launch
    merge_chunk=8,     # 16 is faster with many splits, slower with 2, and takes fp8 head_dim 64 to 128 registers
    l2_prefetch=128,   # beats no hint and 256 bytes by 1-3%
    heads_first=True,  # 0.5-1.5% faster than work items side by side on every shape swept
    merge_threads=128,
)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(x)))


def tc_row_pitches(head_dim: int, kv_bytes: int, swizzle: bool = False, table: Tuning | None = None,
                   arch: str | None = None) -> tuple[int, int]:
    """Shared-memory bytes per K and V row: head_dim elements, and the table's padding unless swizzled.

    fp8 (decode/tc_fp8.cuh): the lanes of one quarter-warp read two K rows (16 bytes each, 32 apart,
    or 16 apart at head_dim 64), so a pitch of 16 mod 32 bytes (64 mod 128 at head_dim 64)
    interleaves the two rows. They read V rows two apart at 16 consecutive bytes each (8 at head_dim
    64): a pitch of 16 mod 64 spreads them. A 32-byte pad trades that for whole 32-byte sectors.
    At head_dim 96 the lanes read 8 bytes of K rows 96 apart (conflict-free unpadded) and 4 bytes
    of V rows two apart, which a pitch of 16 mod 64 spreads.
    """
    row_bytes = head_dim * kv_bytes
    if swizzle:  # PagedKVStage
        return row_bytes, row_bytes
    row = (TUNING if table is None else table).row(kv_bytes == 1, head_dim, arch)
    return row_bytes + row.k_pad, row_bytes + row.v_pad


def tc_rows(spec: DecodeSpec, table: Tuning | None = None) -> int:
    """Query rows per tensor-core CTA: the MMA's M (16) for 16-bit K/V. For fp8, where the rows
    are the MMA's N, the table's fp8_rows: more rows take more row tiles."""
    return (TUNING if table is None else table).fp8_rows if spec.kv_is_fp8 else MMA_M


SHARED_WGMMA_HEAD_DIMS = (64, 128)  # whole 128-byte blocks, O in one warpgroup's registers


def uses_shared_wgmma(spec: DecodeSpec, row: TensorCoreRow) -> bool:
    """Whether a shared-prefix kernel runs its shared records on warpgroup MMAs: Hopper (compiled
    for sm_90a), 16-bit K/V in swizzled rows of whole 128-byte blocks, and one warpgroup a CTA with
    a warp per 16 rows."""
    return (spec.shared_prefix and spec.arch == HOPPER and not spec.kv_is_fp8 and spec.head_dim in SHARED_WGMMA_HEAD_DIMS
            and row.warps == 4 and row.col_split == 1 and row.swizzle and not row.q_in_smem)


def _warps_copy_own_slices(spec: DecodeSpec, row: TensorCoreRow) -> bool:
    """Whether each warp's threads copy exactly the 16 keys of its slice of a stage (PagedKVStage
    with whole columns per thread: 32 / chunks-per-row threads a key column, LOADS keys each), so a
    warp's slice can hold a KV head of its own (own_head_pack)."""
    chunks = spec.head_dim * spec.kv_bytes // 16
    threads, tile = 32 * row.warps, 16 * (row.warps // row.col_split)
    loads = -(-tile * chunks // threads)
    even = threads % chunks == 0 and tile % (threads // chunks) == 0
    return even and 32 % chunks == 0 and 32 // chunks * loads == 16


def decode_tiling(spec: DecodeSpec, table: Tuning | None = None) -> DecodeTiling:
    """The tiling of a spec under table (TUNING when None)."""
    table = TUNING if table is None else table
    merge_lanes = spec.head_dim // MERGE_COLS_PER_THREAD
    merge = dict(merge_lanes=merge_lanes, merge_split_lanes=max(1, table.merge_threads // merge_lanes))
    rows_total = spec.group_size * spec.max_q_len
    if spec.tensor_cores:
        # Block (32 x warps): each slice of col_split warps takes 16 keys of every stage; rows ride in
        # the MMA's M (16-bit) or N (fp8).
        row = table.row(spec.kv_is_fp8, spec.head_dim, spec.arch)
        slices = row.warps // row.col_split
        tile = 16 * slices
        k_pitch, v_pitch = tc_row_pitches(spec.head_dim, spec.kv_bytes, row.swizzle, table, spec.arch)
        rows = tc_rows(spec, table)
        reduction = slices * rows * spec.head_dim * 4  # the slices' fp32 states, in the same memory
        q_smem = MMA_M * spec.head_dim * 2 if row.q_in_smem and not spec.kv_is_fp8 else 0  # 16 rows of 16-bit Q
        split_scores = row.split_scores and row.col_split > 1 and not spec.kv_is_fp8 and not q_smem
        # split scores: each slice's partial S tiles (16 x 16 fp32 per warp), two rounds deep
        score_parts = slices * 2 * row.col_split * MMA_M * 16 * 4 if split_scores else 0
        # A shared-prefix kernel's records write partials of several requests: the separate merge
        # kernel combines them (the fused merge counts one request's arrivals).
        fused_merge = table.fused_merge and not spec.shared_prefix
        static_share = row.static_share if fused_merge else 100  # the fused merge resets the claims
        # A shared record's rows (GQA group x members) fill many MMA tiles: one CTA holds a tile per
        # warp and reads each K/V tile once for all of them, rather than a CTA per 16 rows reading
        # the chunk again from L2. Where warps split O's columns or keep Q in shared memory, the
        # registers do not hold a warp's own rows: there a record holds 16 rows.
        row_warps = row.warps if spec.shared_prefix and row.col_split == 1 and not q_smem else 1
        shared_wgmma = row_warps > 1 and uses_shared_wgmma(spec, row)
        head_pack = row_warps if row_warps > 1 and rows_total <= rows and _warps_copy_own_slices(spec, row) else 1
        row_tiles = -(-rows_total // rows)
        ring_align = max(table.ring_align, SWIZZLE_ATOM) if shared_wgmma else table.ring_align
        smem = max(row.stages * tile * (k_pitch + v_pitch), reduction) + q_smem + score_parts + ring_align - 16
        return DecodeTiling(vec=VEC, chunks_per_row=spec.head_dim // VEC, bdx=32 * row.warps, rows=rows, rows_pad=1,
                            bdz=1, row_tiles=row_tiles, tile_tokens=tile, stages=row.stages,
                            tensor_cores=True, smem_bytes=smem, k_pitch=k_pitch, v_pitch=v_pitch,
                            l2_prefetch=table.l2_prefetch, swizzle=row.swizzle, ring_align=ring_align,
                            heads_first=table.heads_first, fused_merge=fused_merge, static_share=static_share,
                            min_ctas=row.min_ctas, col_split=row.col_split, merge_chunk=table.merge_chunk,
                            q_smem_bytes=q_smem, shared_row_warps=row_warps,
                            shared_step=row.shared_step if row_warps > 1 else 1, shared_wgmma=shared_wgmma,
                            own_head_pack=head_pack, split_scores=split_scores,
                            waiting_merge=spec.shared_prefix and table.fused_merge and row_tiles == 1, **merge)
    cc = table.cuda_cores
    chunks = spec.head_dim // VEC
    bdx = _pow2_ceil(chunks)
    rows = min(rows_total, cc.max_rows)
    align = max(1, 32 // bdx)
    rows_pad = -(-rows // align) * align
    bdz = max(1, cc.threads // (bdx * rows_pad))
    row_bytes = spec.head_dim * spec.kv_bytes
    tile = max(bdz, min(cc.max_tile_tokens, cc.tile_elements // spec.head_dim))
    tile = 1 << int(math.log2(tile))  # power of two, a multiple of bdz
    return DecodeTiling(
        vec=VEC, chunks_per_row=chunks, bdx=bdx, rows=rows, rows_pad=rows_pad, bdz=bdz,
        row_tiles=-(-rows_total // rows), tile_tokens=tile, stages=cc.stages, tensor_cores=False, smem_bytes=0,
        k_pitch=row_bytes, v_pitch=row_bytes, l2_prefetch=table.l2_prefetch, swizzle=False,
        ring_align=CUDA_CORE_RING_ALIGN, heads_first=table.heads_first, fused_merge=cc.fused_merge, static_share=100,
        min_ctas=1, col_split=1, merge_chunk=1, **merge,
    )
