"""Thread-block shape of the decode kernel, derived from a spec.

Python is the single source of these numbers: the template receives them as constants
(and static_asserts their invariants) and the launcher uses them for the grid and block.
"""

from __future__ import annotations

import dataclasses
import math

from .spec import DecodeSpec

MAX_ROWS_PER_CTA = 8  # query rows (group heads x query tokens) one CTA serves on CUDA cores
TARGET_THREADS = 128
STAGES = 4
MERGE_COLS_PER_THREAD = 4
MERGE_THREADS = 128


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(x)))


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

    @property
    def merge_threads(self) -> int:
        return self.merge_lanes * self.merge_split_lanes

    @property
    def merge_block(self) -> tuple[int, int, int]:
        return (self.merge_lanes, self.merge_split_lanes, 1)

    def grid(self, work_items: int, kv_heads: int) -> tuple[int, int, int]:
        """The decode kernel's grid for work_items x kv_heads x row tiles (matching CtaCoords)."""
        if self.heads_first:
            return (work_items * kv_heads, self.row_tiles, 1)
        return (work_items, kv_heads, self.row_tiles)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.bdx, self.rows_pad, self.bdz)

    @property
    def threads(self) -> int:
        return self.bdx * self.rows_pad * self.bdz


TC_ROWS = 16  # MMA M: query rows per tensor-core CTA (16-bit K/V)
TC_WARPS = {64: 4, 128: 4, 256: 4}      # 16-bit K/V
TC_WARPS_FP8 = {64: 4, 128: 4, 256: 2}
# Warps per 16-key slice (16-bit K/V), each keeping head_dim / COL_SPLIT columns of O. At head_dim
# 256 one warp with all of O (128 registers) and Q (64) sits at the 255-register limit, where ptxas
# alone spends ~0.7 s; two warps per slice each hold half of O.
TC_COL_SPLIT = {64: 1, 128: 1, 256: 2}
# head_dim 128 takes 2 stages: in two sweeps on the H200 (benchmarks/tiling_sweep.py) 2 beat 3 on
# every bf16 shape by 0.1-2.7% (b1 L32768 54.4 against 55.9 us, window 86.2 against 87.2) at the same
# 2 CTAs/SM, which registers set; the shared memory given back goes to L1.
TC_STAGES = {64: 4, 128: 2, 256: 3}
# CTAs per SM that ptxas must fit (a register cap); 1 leaves it free to use what the kernel needs.
# Caps cost more than the occupancy buys: 3 bf16 CTAs/SM at head_dim 128 (168 registers, 24-byte
# spills) took the sliding-window row from 87.2 to 95.0 us.
TC_MIN_CTAS = {64: 1, 128: 1, 256: 1}
# fp8: CTAs per SM matter more than bytes in flight per CTA (H200, benchmarks/tiling_sweep.py:
# at head_dim 128, 3 stages and 3 CTAs/SM beat 5 stages and 2 CTAs/SM by 8%). Since the swapped
# kernel runs 4 CTAs/SM (registers), 2 stages match 3 (b16 L8192 86.4 against 87.2 us, b64 286.5
# against 286.2). Capping registers for 5 CTAs/SM (TC_MIN_CTAS) is slower: 90.6 and 321.8. The
# masks whose fp8 kernels exceed 128 registers (sink_window 135, tree and block_sparse 130) run
# 3 CTAs/SM; capped to 4 (120-126 registers, no spills) sink_window was slower: b16 L32768 with 4
# sinks + window 4096, 53.3-53.8 -> 54.5-55.2 us (tenth session, same process pairs).
TC_STAGES_FP8 = {64: 4, 128: 2, 256: 3}
L2_PREFETCH = 128
L2_PREFETCH_FP8 = 128
# The K/V ring starts 128-byte aligned, and its rows keep every 32-byte sector of the cache whole:
# a cp.async pair whose sector lands 16 bytes off a 32-byte boundary fetches the sector twice (ncu,
# H200: 25.2 M L2 sectors for 16.8 M at b16 L8192 with padded 16-bit rows from a 16-byte-aligned
# base). 16-bit rows are unpadded and XOR-swizzled (ldmatrix stays conflict-free): 148.0 -> 139.5 us
# at b16 L8192, 526.7 -> 499.5 at b64 L8192, varlen 355.4 -> 333.1. Not at head_dim 256, where the
# swizzled addresses spill registers.
SWIZZLE = {64: True, 128: True, 256: False}  # per head_dim (16-bit K/V)
# fp8: the same swizzle is conflict-free for decode_tc_fp8.cuh's loads at head_dims 128 and 256
# (tests/test_fp8_layout.py); 64-byte rows at head_dim 64 have too few chunks for it. H200, one
# process against 32/16-byte padding (FP8_ROW_PAD), e4m3: head_dim 256 153.4 -> 145.4 us at b16
# L8192; head_dim 128 no faster (b16 L8192 82.9 -> 83.6, b64 270.9 -> 274.3, HND 82.2 -> 82.1).
SWIZZLE_FP8 = {64: False, 128: False, 256: True}
RING_ALIGN = 128
# 16-bit rows where SWIZZLE is off (head_dim 256), in elements: 16 (32 bytes) keeps each copied
# sector whole at the cost of 2-way ldmatrix conflicts, and beat 8 (conflict-free, half the sectors
# fetched twice) on the H200 in one process: b16 L8192 293.3 -> 281.5 us, b64 L2048 285.5 -> 276.5,
# b1 L32768 106.1 -> 103.8.
ROW_PAD_16BIT = {64: 8, 128: 8, 256: 16}
# fp8 row padding: 32 bytes keeps the sectors whole at the cost of 2-way conflicts on the
# consumer's loads (tc_row_pitches), and is faster at head_dim 128 (e4m3 b16 L8192 86.5 -> 83.5 us,
# b64 286.1 -> 269.4); 16 (conflict-free, half the sectors fetched twice) at head_dim 64.
FP8_ROW_PAD = {64: 16, 128: 32, 256: 16}  # where SWIZZLE_FP8 is off
HEADS_FIRST = True
# Split requests on tensor cores merge in the decode kernel (the last CTA of a group combines the
# partials) rather than in a second launch (flashjit_merge): 1-3% faster on the H200 (b1 L2048 eager
# 16.1 -> 14.9 us, e4m3 b16 L8192 87.8 -> 85.2). The CUDA-core kernel keeps the launch: fused, it
# took 268.6 us against 256.4 at b16 L8192 (group 4).
FUSED_MERGE = True
# The CTAs of a split request may share its tiles (stream_shared_tiles): each reads this percentage
# of its fair share first, then claims the rest one tile at a time, so CTAs the memory system serves
# faster read more (100: a fixed split). Needs the fused merge, whose last CTA resets the claims.
# H200, one process, 100 / 75 / 50: head_dim 256 (2 warps, the fewest CTAs) b16 L8192 288.1 / 271.6
# / 275.9 us. At head_dims 64 and 128 the CTAs of one request finish within ~2 us of each other
# once sharing, yet the call is no shorter (e4m3 b16 L8192 83.2 / 83.5 / 83.3: whole requests finish
# up to 11 us apart, benchmarks/cta_timeline.py) and the claims cost a little (varlen 339.0 /
# 344.0, d64 81.5 / 83.1, e4m3 b64 L8192 270.8 / 273.5). fp8 head_dim 256: 145.1 / 145.2 / 145.3.
STATIC_SHARE = {64: 100, 128: 100, 256: 75}       # per head_dim, 16-bit K/V
STATIC_SHARE_FP8 = {64: 100, 128: 100, 256: 100}  # fp8 K/V
# Partials the fused merge's last CTA loads at once, each chunk one L2 round trip
# (merge_partials_if_last); no kernel spills with 8. 16 is faster with many splits but slower with
# few, whose merge then runs 16 slots for 2 partials. H200, same-process pairs (8 / 16, us): b1
# L2048 (16 splits) 13.1-13.2 / 12.8, b1 L32768 (32 splits) 51.5-51.6 / 50.7-50.8, but b16 L8192
# (2 splits) 138.4-138.6 / 139.4-139.5 and head_dim 256 (2 splits) 267.0-267.2 / 268.5-268.8.
# And the merge's registers count in the kernel's: 16 takes fp8 head_dim 64 from 89-100 to 122-128.
MERGE_CHUNK = 8


def tc_row_pitches(head_dim: int, kv_bytes: int, swizzle: bool = False) -> tuple[int, int]:
    """Shared-memory bytes per K and V row.

    Unpadded when swizzled (PagedKVStage). Else 16-bit: ROW_PAD_16BIT elements of padding. fp8
    (decode_tc_fp8.cuh): the lanes of one quarter-warp read two K rows (16 bytes each, 32 apart, or
    16 apart at head_dim 64), so a pitch of 16 mod 32 bytes (64 mod 128 at head_dim 64) interleaves
    the two rows. They read V rows two apart at 16 consecutive bytes each (8 at head_dim 64): a
    pitch of 16 mod 64 spreads them. FP8_ROW_PAD trades that for whole 32-byte sectors where faster.
    """
    if kv_bytes == 2:
        return ((head_dim if swizzle else head_dim + ROW_PAD_16BIT[head_dim]) * 2,) * 2
    if swizzle:
        return head_dim, head_dim
    pad = FP8_ROW_PAD[head_dim]
    return (head_dim if head_dim == 64 else head_dim + pad), head_dim + pad


def tc_rows(spec: DecodeSpec) -> int:
    """Query rows per tensor-core CTA: the MMA's M (16) for 16-bit K/V. For fp8, where the rows
    are the MMA's N, one n-tile of 8: more rows take more row tiles (two n-tiles per CTA would
    share the K/V conversions, but spill registers)."""
    return 8 if spec.kv_is_fp8 else TC_ROWS


def _l2_prefetch(spec: DecodeSpec) -> int:
    return L2_PREFETCH_FP8 if spec.kv_is_fp8 else L2_PREFETCH


def _static_share(spec: DecodeSpec) -> int:
    """STATIC_SHARE of a tensor-core kernel: sharing needs the fused merge to reset its claims."""
    return (STATIC_SHARE_FP8 if spec.kv_is_fp8 else STATIC_SHARE)[spec.head_dim] if FUSED_MERGE else 100


def decode_tiling(spec: DecodeSpec) -> DecodeTiling:
    merge_lanes = spec.head_dim // MERGE_COLS_PER_THREAD
    merge = dict(merge_lanes=merge_lanes, merge_split_lanes=max(1, MERGE_THREADS // merge_lanes))
    rows_total = spec.group_size * spec.max_q_len
    if spec.tensor_cores:
        # Block (32 x warps): each slice of col_split warps takes 16 keys of every stage; rows ride in
        # the MMA's M.
        warps = (TC_WARPS_FP8 if spec.kv_is_fp8 else TC_WARPS)[spec.head_dim]
        col_split = 1 if spec.kv_is_fp8 else TC_COL_SPLIT[spec.head_dim]
        stages = (TC_STAGES_FP8 if spec.kv_is_fp8 else TC_STAGES)[spec.head_dim]
        slices = warps // col_split
        tile = 16 * slices
        swizzle = (SWIZZLE_FP8 if spec.kv_is_fp8 else SWIZZLE)[spec.head_dim]
        k_pitch, v_pitch = tc_row_pitches(spec.head_dim, spec.kv_bytes, swizzle)
        rows = tc_rows(spec)
        reduction = slices * rows * spec.head_dim * 4  # the slices' fp32 states, in the same memory
        smem = max(stages * tile * (k_pitch + v_pitch), reduction) + RING_ALIGN - 16
        return DecodeTiling(vec=8, chunks_per_row=spec.head_dim // 8, bdx=32 * warps, rows=rows, rows_pad=1, bdz=1,
                            row_tiles=-(-rows_total // rows), tile_tokens=tile, stages=stages, tensor_cores=True,
                            smem_bytes=smem, k_pitch=k_pitch, v_pitch=v_pitch, l2_prefetch=_l2_prefetch(spec),
                            swizzle=swizzle, ring_align=RING_ALIGN, heads_first=HEADS_FIRST, fused_merge=FUSED_MERGE,
                            static_share=_static_share(spec), min_ctas=TC_MIN_CTAS[spec.head_dim], col_split=col_split,
                            merge_chunk=MERGE_CHUNK, **merge)
    vec = 8
    chunks = spec.head_dim // vec
    bdx = _pow2_ceil(chunks)
    rows = min(rows_total, MAX_ROWS_PER_CTA)
    align = max(1, 32 // bdx)
    rows_pad = -(-rows // align) * align
    bdz = max(1, TARGET_THREADS // (bdx * rows_pad))
    row_bytes = spec.head_dim * spec.kv_bytes
    tile = max(bdz, min(32, 2048 // spec.head_dim))  # tokens: fp8 stages keep the 16-bit count (registers)
    tile = 1 << int(math.log2(tile))  # power of two, a multiple of bdz
    return DecodeTiling(
        vec=vec, chunks_per_row=chunks, bdx=bdx, rows=rows, rows_pad=rows_pad, bdz=bdz,
        row_tiles=-(-rows_total // rows), tile_tokens=tile, stages=STAGES, tensor_cores=False, smem_bytes=0,
        k_pitch=row_bytes, v_pitch=row_bytes, l2_prefetch=_l2_prefetch(spec), swizzle=False, ring_align=16,
        heads_first=HEADS_FIRST,
        fused_merge=False, static_share=100, min_ctas=1, col_split=1, merge_chunk=1, **merge,
    )
