"""tiling: the tuning table, the tiling it gives every spec, and the 16-bit tensor-core rings' row
layouts, checked on the CPU.

Two costs trade off in the row layouts: a cp.async pair whose 32-byte sector lands across a
32-byte boundary of shared memory fetches the sector twice, and ldmatrix phases (8 rows x 16 bytes)
that hit one bank twice take an extra wavefront.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import pytest

from flashjit.kernels.decode.spec import CUDA_CORE_HEAD_DIMS, DecodeSpec, HEAD_DIMS, TENSOR_CORE_HEAD_DIMS
from flashjit.kernels.decode.tiling import DecodeTiling, TUNING, decode_tiling

# Each family's tiling at group 16 (both kernels' row tiles), as a tuple of DecodeTiling's fields:
# (tensor cores, K/V dtype, head_dim) -> tiling.
PINNED = {
    (False, "bf16",  64): (8, 8, 8, 8, 8, 2, 2, 32, 4, False, 0, 128, 128, 128, False, 16, True, False, 100, 1, 1, 1, 16, 8),
    (False, "bf16",  96): (8, 12, 16, 8, 8, 1, 2, 16, 4, False, 0, 192, 192, 128, False, 16, True, False, 100, 1, 1, 1, 24, 5),
    (False, "bf16", 128): (8, 16, 16, 8, 8, 1, 2, 16, 4, False, 0, 256, 256, 128, False, 16, True, False, 100, 1, 1, 1, 32, 4),
    (False, "bf16", 256): (8, 32, 32, 8, 8, 1, 2, 8, 4, False, 0, 512, 512, 128, False, 16, True, False, 100, 1, 1, 1, 64, 2),
    (False, "e4m3",  64): (8, 8, 8, 8, 8, 2, 2, 32, 4, False, 0, 64, 64, 128, False, 16, True, False, 100, 1, 1, 1, 16, 8),
    (False, "e4m3",  96): (8, 12, 16, 8, 8, 1, 2, 16, 4, False, 0, 96, 96, 128, False, 16, True, False, 100, 1, 1, 1, 24, 5),
    (False, "e4m3", 128): (8, 16, 16, 8, 8, 1, 2, 16, 4, False, 0, 128, 128, 128, False, 16, True, False, 100, 1, 1, 1, 32, 4),
    (False, "e4m3", 256): (8, 32, 32, 8, 8, 1, 2, 8, 4, False, 0, 256, 256, 128, False, 16, True, False, 100, 1, 1, 1, 64, 2),
    (True,  "bf16",  64): (8, 8, 128, 16, 1, 1, 1, 64, 4, True, 65648, 128, 128, 128, True, 128, True, True, 100, 1, 1, 8, 16, 8),
    # head_dim 96: 6 warps (whole rows of 12 chunks per copy pass), rows swizzled as a block and a half
    (True,  "bf16",  96): (8, 12, 192, 16, 1, 1, 1, 96, 2, True, 73840, 192, 192, 128, True, 128, True, True, 100, 2, 1, 8, 24, 5),
    (True,  "bf16", 128): (8, 16, 128, 16, 1, 1, 1, 64, 2, True, 65648, 256, 256, 128, True, 128, True, True, 100, 1, 1, 8, 32, 4),
    # head_dim 256 and 512: the warps of a slice split S's k-steps (the last field, split_scores)
    (True,  "bf16", 256): (8, 32, 128, 16, 1, 1, 1, 32, 2, True, 77936, 544, 544, 128, False, 128, True, True, 75, 1, 2, 8, 64, 2,
                           0, True),
    (True,  "e4m3",  64): (8, 8, 128, 8, 1, 1, 2, 64, 4, True, 36976, 64, 80, 128, False, 128, True, True, 100, 1, 1, 8, 16, 8),
    (True,  "e4m3",  96): (8, 12, 192, 8, 1, 1, 2, 96, 2, True, 40048, 96, 112, 128, False, 128, True, True, 100, 1, 1, 8, 24, 5),
    (True,  "e4m3", 128): (8, 16, 128, 8, 1, 1, 2, 64, 2, True, 41072, 160, 160, 128, False, 128, True, True, 100, 1, 1, 8, 32, 4),
    (True,  "e4m3", 256): (8, 32, 64, 8, 1, 1, 2, 32, 3, True, 49264, 256, 256, 128, True, 128, True, True, 100, 1, 1, 8, 64, 2),
    (True,  "bf16", 512): (8, 64, 256, 16, 1, 1, 1, 32, 2, True, 151664, 1056, 1056, 128, False, 128, True, True, 75, 1, 4, 8, 128, 1,
                           0, True),
    (True,  "e4m3", 512): (8, 64, 256, 8, 1, 1, 2, 32, 3, True, 98416, 512, 512, 128, True, 128, True, True, 100, 1, 4, 8, 128, 1),
}
# sha256 of repr((spec's grid key, tiling as a tuple)) over every_spec(), in order.
# The automatic choice puts head_dim 96 and one-row specs (group 1, q_len 1) on tensor cores.
PINNED_GRID_DIGEST = "2c0d483fc798366043a42f0d49fabfdacbf45da77cc87dc225727d1669abcea8"


def every_spec():
    """Each head_dim, K/V dtype, kernel family and 256 group x query-length shapes (rows 1 to 1024)."""
    for head_dim, kv_dtype, group, q_len, tensor_cores in itertools.product(
            HEAD_DIMS, ("bf16", "f16", "e4m3", "e5m2"), range(1, 65), (1, 2, 3, 16), (None, False, True)):
        if (not tensor_cores or head_dim in TENSOR_CORE_HEAD_DIMS) and (tensor_cores is not False
                                                                        or head_dim in CUDA_CORE_HEAD_DIMS):
            yield DecodeSpec(head_dim=head_dim, dtype="f16", kv_dtype=kv_dtype, group_size=group, max_q_len=q_len,
                             tensor_cores=tensor_cores, arch="sm_90")


def test_the_table_gives_every_spec_its_pinned_tiling():
    """The table's values, read by decode_tiling, make the same tiling for every spec as the constants
    they were pinned from: field by field for each family, and by digest over the whole grid."""
    for (tensor_cores, kv_dtype, head_dim), fields in PINNED.items():
        spec = DecodeSpec(head_dim=head_dim, kv_dtype=kv_dtype, group_size=16, tensor_cores=tensor_cores, arch="sm_90")
        assert decode_tiling(spec) == DecodeTiling(*fields), (tensor_cores, kv_dtype, head_dim)
    digest = hashlib.sha256()
    for spec in every_spec():
        key = (spec.head_dim, spec.kv_dtype, spec.group_size, spec.max_q_len, spec.tensor_cores)
        tiling = decode_tiling(spec)
        # the last five fields, which only shared-prefix kernels set
        assert tiling.shared_row_warps == 1 and tiling.shared_step == 1 and not tiling.shared_wgmma
        assert tiling.own_head_pack == 1 and not tiling.waiting_merge
        digest.update(repr((key, dataclasses.astuple(tiling)[:-5])).encode())
    assert digest.hexdigest() == PINNED_GRID_DIGEST


@pytest.mark.parametrize("head_dim, group, q_len, arch, pack", [
    (64, 4, 1, "sm_90", 4), (128, 4, 1, "sm_90", 4), (128, 8, 2, "sm_80", 4), (128, 1, 1, "sm_90", 4),
    (128, 8, 4, "sm_90", 1), (96, 4, 1, "sm_90", 1), (256, 4, 1, "sm_90", 1), (512, 4, 1, "sm_90", 1)])
def test_short_own_items_take_a_head_per_warp_where_a_warp_copies_its_own_slice(head_dim, group, q_len, arch, pack):
    """A shared-prefix kernel's own item may take a KV head per warp where a warp holds all of O for
    its rows, those rows (group x query tokens) fit one 16-row tile, and each warp's threads copy
    exactly the 16 keys of its slice (not at head_dim 96, whose copies cross the warps' slices);
    other kernels take one head a CTA."""
    spec = DecodeSpec(head_dim=head_dim, dtype="bf16", group_size=group, max_q_len=q_len, tensor_cores=True,
                      arch=arch, shared_prefix=True)
    tiling = decode_tiling(spec)
    assert tiling.own_head_pack == pack
    if pack > 1:
        assert pack == tiling.shared_row_warps == tiling.bdx // 32 and tiling.row_tiles == 1
    # the kernel merges one-wave plans where each request's rows fit one row tile
    assert tiling.waiting_merge == (tiling.row_tiles == 1)
    assert decode_tiling(dataclasses.replace(spec, shared_prefix=False)).own_head_pack == 1


@pytest.mark.parametrize("head_dim, row_warps, step, wgmma", [(64, 4, 2, True), (96, 6, 1, False), (128, 4, 4, True),
                                                           (256, 1, 1, False), (512, 1, 1, False)])
def test_a_shared_prefix_record_holds_a_row_tile_per_warp_where_a_warp_keeps_all_of_o(head_dim, row_warps, step, wgmma):
    """Shared-prefix kernels give each warp 16 rows of its own, except where warps split O's columns
    (head_dim 256, 512), and attend `step` slices of a stage at once (a whole number of steps a
    stage); on Hopper, where a CTA is one warpgroup of 64 rows over whole swizzled blocks, the records
    run on wgmma (sm_90a, the ring on a swizzle atom); nothing else of the tiling changes."""
    plain = DecodeSpec(head_dim=head_dim, dtype="bf16", group_size=4, tensor_cores=True, arch="sm_90")
    shared = dataclasses.replace(plain, shared_prefix=True)
    tiling, plain_tiling = decode_tiling(shared), decode_tiling(plain)
    assert tiling.shared_row_warps == row_warps and tiling.shared_step == step
    if row_warps > 1:
        assert row_warps == tiling.bdx // 32 and tiling.col_split == 1 and row_warps % step == 0
    assert tiling.shared_wgmma == wgmma and shared.compile_arch == ("sm_90a" if wgmma else "sm_90")
    assert tiling.ring_align == (1024 if wgmma else plain_tiling.ring_align)
    assert tiling.smem_bytes == plain_tiling.smem_bytes + tiling.ring_align - plain_tiling.ring_align
    assert plain.compile_arch == "sm_90"
    for arch in ("sm_80", "sm_100"):  # no warpgroup MMAs there
        assert not decode_tiling(dataclasses.replace(shared, arch=arch)).shared_wgmma
    assert tiling.waiting_merge and not tiling.fused_merge  # one-wave plans merge in the kernel, others launch it
    assert dataclasses.replace(tiling, shared_row_warps=1, shared_step=1, shared_wgmma=False, own_head_pack=1,
                               fused_merge=True, waiting_merge=False,
                               ring_align=plain_tiling.ring_align, smem_bytes=plain_tiling.smem_bytes,
                               static_share=plain_tiling.static_share) == plain_tiling


def test_the_table_has_one_row_per_tensor_core_kernel_and_is_frozen():
    keys = [row.key for row in TUNING.tensor_cores]
    assert sorted(keys) == sorted(itertools.product((None,), (False, True), TENSOR_CORE_HEAD_DIMS))
    assert TUNING.row(True, 128).key == (None, True, 128) and TUNING.row(True, 128, "sm_90").key == (None, True, 128)
    with pytest.raises(KeyError, match="head_dim 32"):
        TUNING.row(False, 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TUNING.fused_merge = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TUNING.tensor_cores[0].stages = 3  # type: ignore[misc]
    assert hash(TUNING) == hash(TUNING.replace())


def test_a_passed_table_changes_the_tiling_and_leaves_the_default_alone():
    """What a sweep does: the kernel of one row under other warps and stages, the grid order and the
    prefetch hint changed, each from a table handed to decode_tiling."""
    spec = DecodeSpec(head_dim=128, kv_dtype="e4m3", group_size=8, arch="sm_90")
    table = TUNING.with_rows(fp8=True, head_dim=128, warps=2, stages=4, min_ctas=5).replace(
        l2_prefetch=256, heads_first=False)
    tuned, default = decode_tiling(spec, table), decode_tiling(spec)
    assert (tuned.bdx, tuned.stages, tuned.min_ctas, tuned.tile_tokens) == (64, 4, 5, 32)
    assert (tuned.l2_prefetch, tuned.heads_first) == (256, False)
    assert default == decode_tiling(spec, TUNING)
    assert (default.bdx, default.stages, default.l2_prefetch) == (128, 2, 128)
    # only the named row changes
    assert [row for row in table.tensor_cores if row.key != (None, True, 128)] == [
        row for row in TUNING.tensor_cores if row.key != (None, True, 128)]
    assert all(row.static_share == 50 for row in TUNING.with_rows(static_share=50).tensor_cores)


def test_a_row_tuned_for_one_arch_serves_that_arch_only():
    """A new GPU's constants are data: a row keyed by its arch, which its specs take and no other arch does."""
    tuned = dataclasses.replace(TUNING.row(False, 128), arch="sm_100", stages=3)
    table = dataclasses.replace(TUNING, tensor_cores=TUNING.tensor_cores + (tuned,))
    assert table.row(False, 128, "sm_100") is tuned and table.row(False, 128, "sm_90") is TUNING.row(False, 128)
    spec = DecodeSpec(128, group_size=4, arch="sm_100")
    assert decode_tiling(spec, table).stages == 3 and decode_tiling(spec).stages == 2
    assert decode_tiling(spec.replace(arch="sm_90"), table) == decode_tiling(spec.replace(arch="sm_90"))
    assert [row.stages for row in TUNING.with_rows(fp8=False, stages=5).tensor_cores] == [5, 5, 5, 5, 5, 4, 2, 2, 3, 3]


def swizzled_chunk(row: int, chunk: int, row_chunks: int) -> int:
    """worklist/kernel_core.cuh swizzled_chunk: whole 128-byte blocks XOR row % 8; the last half block of a
    row of 8n + 4 chunks XORs (row / 2) % 4."""
    if row_chunks % 8 == 4 and chunk >= row_chunks - 4:
        return chunk ^ (row // 2 % 4)
    return chunk ^ row % 8


def ldmatrix_extra_wavefronts(pitch: int, swizzle: bool, chunk: int) -> int:
    """Extra wavefronts of one ldmatrix phase: rows 0..7 of one 16-byte column (rows from a multiple of 8)."""
    banks = {}
    for row in range(8, 16):
        address = row * pitch + 16 * (swizzled_chunk(row, chunk, pitch // 16) if swizzle else chunk)
        for word in range(address // 4, address // 4 + 4):
            banks.setdefault(word % 32, set()).add(word)
    return max(len(words) for words in banks.values()) - 1


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_16bit_rows_keep_sectors_whole_and_ldmatrix_at_most_two_way(head_dim):
    t = decode_tiling(DecodeSpec(head_dim=head_dim, dtype="bf16", kv_dtype="bf16", group_size=4, arch="sm_90",
                                 tensor_cores=True))
    assert t.ring_align % 32 == 0 and t.k_pitch == t.v_pitch
    # whole sectors: every 32-byte piece of a cache row starts 32-byte aligned in the ring
    assert t.k_pitch % 32 == 0
    extra = [ldmatrix_extra_wavefronts(t.k_pitch, t.swizzle, chunk) for chunk in range(head_dim * 2 // 16)]
    assert max(extra) <= (0 if t.swizzle else 1)
    # 16 bytes of padding would be conflict-free but split sectors: the trade the table makes
    assert TUNING.row(False, head_dim).k_pad % 32 == 0 or t.swizzle
    if t.swizzle:  # the swizzle keeps chunks 2m and 2m + 1 in one aligned 32 bytes (whole sectors)
        chunks = t.k_pitch // 16
        assert all(swizzled_chunk(row, 2 * m, chunks) // 2 == swizzled_chunk(row, 2 * m + 1, chunks) // 2 < chunks // 2
                   for row in range(16) for m in range(chunks // 2))


def test_the_half_block_swizzle_of_head_dim_96_is_what_makes_it_conflict_free():
    """192-byte rows start 64 bytes into a 128-byte block on odd rows: XORing the last half block
    with row % 8 (as whole blocks are) would conflict, and so would unswizzled rows."""
    assert max(ldmatrix_extra_wavefronts(192, True, chunk) for chunk in range(12)) == 0
    assert max(ldmatrix_extra_wavefronts(192, False, chunk) for chunk in range(12)) > 0
    banks = {}
    for row in range(8):  # the plain XOR on the last half block: rows r and r + 4 share banks
        address = row * 192 + 16 * (8 + ((0 ^ row % 8) % 4))
        banks.setdefault(address // 4 % 32, set()).add(address // 4)
    assert max(len(words) for words in banks.values()) > 1


@pytest.mark.parametrize("group", range(1, 17))
@pytest.mark.parametrize("kv_dtype", ["bf16", "f16", "e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_every_head_configuration_runs_on_tensor_cores(head_dim, kv_dtype, group):
    """Groups 1-16 at every head_dim (MHA and head_dim 96 included), any page size: the automatic
    choice is the tensor-core kernel, whose rows fill the MMA from one query row."""
    for page_size in (1, 16, 64, 256):
        spec = DecodeSpec(head_dim=head_dim, kv_dtype=kv_dtype, group_size=group, page_size=page_size, arch="sm_90")
        assert spec.tensor_cores, spec.name
        tiling = decode_tiling(spec)
        assert tiling.tensor_cores and tiling.row_tiles == -(-group // tiling.rows)
        assert tiling.smem_bytes <= 227 * 1024 and tiling.threads % 32 == 0


@pytest.mark.parametrize("kv_dtype", ["bf16", "e4m3"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tiles_are_shared_only_where_the_fused_merge_resets_the_claims(kv_dtype, head_dim):
    """static_share comes from tiling's table for tensor-core kernels; the CUDA-core kernels, and any
    kernel without the fused merge (whose last CTA sets the claim counter back to 0), never share."""
    tuned = TUNING.row(kv_dtype == "e4m3", head_dim).static_share

    def share(tuning=None, **kwargs):
        spec = DecodeSpec(head_dim=head_dim, kv_dtype=kv_dtype, arch="sm_90", **kwargs)
        return decode_tiling(spec, tuning).static_share

    assert share(group_size=4, tensor_cores=True) == tuned
    assert share(group_size=4, tensor_cores=False) == 100
    unfused = TUNING.replace(fused_merge=False)
    assert share(unfused, group_size=4, tensor_cores=True) == 100


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_16bit_ldmatrix_addresses_find_the_chunks_the_loader_swizzled(head_dim):
    """decode/tc.cuh's ldmatrix addresses (a 128-byte block plus a chunk XORed in it) land where
    PagedKVStage copied each row's chunk (swizzled_chunk), for every lane, k-step and n-tile pair,
    the half block of head_dim 96 included."""
    pitch, row_chunks, ksteps, ntiles = head_dim * 2, head_dim * 2 // 16, head_dim // 16, head_dim // 8
    half_block = head_dim * 2 % 128 == 64
    for slice_, lane in itertools.product(range(4), range(32)):
        mat, mrow = lane // 8, lane % 8
        k_chunk, v_chunk = (mat & 1) ^ mrow, (mat >> 1) ^ mrow
        k_half, v_half = (mat & 1) ^ (mrow // 2 % 4), (mat >> 1) ^ (mrow // 2 % 4)
        k_row, v_row = slice_ * 16 + mrow + (mat >> 1) * 8, slice_ * 16 + mrow + (mat & 1) * 8
        for k in range(ksteps):
            kc = k_half if half_block and k >= ksteps - 2 else k_chunk
            kernel = k_row * pitch + (k // 4) * 128 + ((2 * k % 8) ^ kc) * 16
            assert kernel == k_row * pitch + 16 * swizzled_chunk(k_row, 2 * k + (mat & 1), row_chunks), (k, lane)
        for n in range(0, ntiles, 2):
            vc = v_half if half_block and n >= ntiles - 4 else v_chunk
            kernel = v_row * pitch + (n // 8) * 128 + ((n % 8) ^ vc) * 16
            assert kernel == v_row * pitch + 16 * swizzled_chunk(v_row, n + (mat >> 1), row_chunks), (n, lane)


@pytest.mark.parametrize("head_dim, change, split", [(512, {}, True), (256, {}, True), (128, {"split_scores": True}, False),
                                                     (512, {"q_in_smem": True}, False)])
def test_split_scores_take_col_split_warps_and_q_in_registers(head_dim, change, split):
    """Split scores need warps that share a slice (col_split > 1) and Q in registers; where they
    apply, each slice's two rounds of partial S tiles (16 x 16 fp32 per warp) join shared memory."""
    table = TUNING.with_rows(fp8=False, head_dim=head_dim, **change)
    spec = DecodeSpec(head_dim=head_dim, dtype="bf16", group_size=4, tensor_cores=True, arch="sm_90")
    tiling = decode_tiling(spec, table)
    assert tiling.split_scores is split
    if split:
        unsplit = decode_tiling(spec, table.with_rows(fp8=False, head_dim=head_dim, split_scores=False))
        slices = tiling.bdx // 32 // tiling.col_split
        assert tiling.smem_bytes - unsplit.smem_bytes == slices * 2 * tiling.col_split * 16 * 16 * 4
    fp8 = dataclasses.replace(spec, kv_dtype="e4m3")
    assert not decode_tiling(fp8, TUNING.with_rows(head_dim=head_dim, split_scores=True)).split_scores
