"""The one source of the Python<->CUDA ABI: the kernels' argument structs and the work-item record.

The host fills DecodeArgs, MergeArgs and PlanArgs (MergeStatesArgs: the merge_states kernel's)
and hands their addresses to cuLaunchKernel as the kernels' `decode::Args`, `merge::Args` and
`plan::Args` parameters (templates/include/decode_common.cuh, merge.cuh and device_plan.cuh;
merge_states.cuh); the planners (host and GPU) write ITEM_INTS int32 per work item, which
decode::WorkItem reads, and price the same SPLIT_CANDIDATES; the MLA kernel takes MLAArgs
(mla::Args, templates/include/mla.cuh) and reads the same records. The CUDA
side is written by hand, and these checks tie it to the definitions here:

* render() pastes source_checks() into every kernel source: static_asserts of each struct's size
  and of every field's offset, size and kind (pointer, integer, float), taken from ctypes, and of
  each mask parameter's size and kind (flashjit.masks.params). A field reordered, retyped, added
  or dropped on one side only fails the NVRTC compile with a message naming it.
* The entry template defines FJ_ITEM_INTS as ITEM_INTS, and WorkItem asserts the width it reads.
* host_library builds the C planner (serving/native/host_plan.c) with -DFJ_ITEM_INTS=ITEM_INTS;
  the file refuses to build without it, or with a width other than the one it writes.
"""

from __future__ import annotations

import ctypes

from ..masks.params import MASK_PARAM_CTYPES

# The int32 fields of one work-item record, in order: the item's span and its request's geometry
# (request -1: CUDA-graph padding), then its tile-sharing group: the item's index in it, the span its
# CTAs share and how many items share it. The group is the request's items, or for a fixed split
# (plan(fixed_split_tokens=...)) the item alone, which then reads exactly its own span.
WORK_ITEM_FIELDS = ("request", "v_begin", "v_end", "kv_len", "page_begin", "q_begin", "q_len", "splits",
                    "share", "share_begin", "share_end", "sharers")
ITEM_INTS = len(WORK_ITEM_FIELDS)
# A shared-prefix record's last field ("sharers") holds the KV heads one CTA of a short own item
# attends (RECORD_HEADS) and, where its plan merges in the decode kernel (decode_common.cuh's
# merge_when_written), the record's part in that merge: MERGE_COUNTS (its CTA counts its partials
# in) or MERGE_WAITS (its request's last own item: waits for the others' and combines them).
MERGE_COUNTS, MERGE_WAITS = 1 << 8, 1 << 9
RECORD_HEADS = MERGE_COUNTS - 1

# The GPU planner's shared memory: PLAN_SMEM_INTS int32 per request (plus one), for at most
# PLAN_MAX_BATCH requests, or fewer where a device's shared memory per block holds fewer beside the
# planner's static arrays (plan_batch_limit); a larger CUDA-graph batch plans on the host.
PLAN_SMEM_INTS, PLAN_MAX_BATCH = 7, 4096

# The 128-byte swizzle's repeat (8 rows of 128 bytes): a wgmma operand in shared memory starts on
# one (the MLA and shared-prefix warpgroup kernels' rings; wgmma.cuh.j2's WGMMA_SWIZZLE_ATOM).
SWIZZLE_ATOM = 1024


def plan_smem_bytes(batch: int) -> int:
    """The GPU planner's dynamic shared memory for a batch capacity of `batch` requests."""
    return 4 * PLAN_SMEM_INTS * (batch + 1)


def plan_batch_limit(block_smem_bytes: int, static_smem_bytes: int) -> int:
    """The most requests the GPU planner takes on a device whose blocks may have block_smem_bytes
    of shared memory (its opt-in limit), beside the planner's static_smem_bytes: PLAN_MAX_BATCH
    where it fits (an H100 or H200, an A100), fewer on GPUs of about 100 KB a block (sm_86, sm_89,
    sm_120), 0 if not even one."""
    fits = (block_smem_bytes - static_smem_bytes) // (4 * PLAN_SMEM_INTS) - 1
    return max(0, min(PLAN_MAX_BATCH, fits))

# The split counts both planners try for the longest span (the render defines FJ_SPLIT_CANDIDATES).
SPLIT_CANDIDATES = tuple(range(1, 25)) + (28, 32, 40, 48, 56, 64, 80, 96, 112, 128)


class DecodeArgs(ctypes.Structure):
    """decode::Args, the decode kernel's first parameter."""

    _c_name_ = "decode::Args"
    _fields_ = [
        ("q", ctypes.c_void_p), ("q_stride", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("page_stride", ctypes.c_int64), ("slot_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
        ("page_indices", ctypes.c_void_p),
        ("work_items", ctypes.c_void_p),
        ("req_qo_indptr", ctypes.c_void_p), ("req_work_indptr", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("out_stride", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("tmp_o", ctypes.c_void_p), ("tmp_lse", ctypes.c_void_p),
        ("merge_counters", ctypes.c_void_p), ("tile_counters", ctypes.c_void_p),
        ("num_qo_heads", ctypes.c_int), ("sm_scale_log2", ctypes.c_float),
        ("k_scale_ptr", ctypes.c_void_p), ("v_scale_ptr", ctypes.c_void_p),
        ("k_scale_stride", ctypes.c_int), ("v_scale_stride", ctypes.c_int),
        ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
        ("num_page_ids", ctypes.c_int), ("packed_from", ctypes.c_int),
    ]


class MergeArgs(ctypes.Structure):
    """merge::Args, flashjit_merge's parameter."""

    _c_name_ = "merge::Args"
    _fields_ = [
        ("tmp_o", ctypes.c_void_p), ("tmp_lse", ctypes.c_void_p),
        ("token_request", ctypes.c_void_p), ("req_qo_indptr", ctypes.c_void_p),
        ("req_work_indptr", ctypes.c_void_p), ("num_tokens", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("out_stride", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("num_qo_heads", ctypes.c_int),
    ]


class MLAArgs(ctypes.Structure):
    """mla::Args, the MLA decode kernel's parameter (templates/include/mla.cuh)."""

    _c_name_ = "mla::Args"
    _fields_ = [
        ("q_nope", ctypes.c_void_p), ("q_nope_stride", ctypes.c_int64), ("q_nope_head_stride", ctypes.c_int64),
        ("q_pe", ctypes.c_void_p), ("q_pe_stride", ctypes.c_int64), ("q_pe_head_stride", ctypes.c_int64),
        ("ckv", ctypes.c_void_p), ("ckv_page_stride", ctypes.c_int64), ("ckv_slot_stride", ctypes.c_int64),
        ("kpe", ctypes.c_void_p), ("kpe_page_stride", ctypes.c_int64), ("kpe_slot_stride", ctypes.c_int64),
        ("page_indices", ctypes.c_void_p),
        ("work_items", ctypes.c_void_p), ("req_work_indptr", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("out_stride", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("tmp_o", ctypes.c_void_p), ("tmp_lse", ctypes.c_void_p),
        ("merge_counters", ctypes.c_void_p), ("tile_counters", ctypes.c_void_p),
        ("num_heads", ctypes.c_int), ("sm_scale_log2", ctypes.c_float),
        ("ckv_scale_ptr", ctypes.c_void_p), ("kpe_scale_ptr", ctypes.c_void_p),
        ("ckv_scale", ctypes.c_float), ("kpe_scale", ctypes.c_float),
    ]


class PlanArgs(ctypes.Structure):
    """plan::Args, flashjit_plan's first parameter (the GPU planner)."""

    _c_name_ = "plan::Args"
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "batch", "indptr", "last_page_len", "qo_indptr", "work_items", "num_tokens", "req_qo_indptr",
        "req_work_indptr", "token_request", "chunk_out", "num_work_out")] + [(name, ctypes.c_int) for name in (
            "page_size", "batch_capacity", "work_capacity", "token_capacity", "ctas_per_item", "max_ctas",
            "granularity", "min_chunk", "chunk_tokens", "fixed_split", "item_overhead", "merge_cost")]


class MergeStatesArgs(ctypes.Structure):
    """merge_states::Args, flashjit_merge_states's parameter (templates/include/merge_states.cuh)."""

    _c_name_ = "merge_states::Args"
    _fields_ = [
        ("o", ctypes.c_void_p), ("lse", ctypes.c_void_p), ("out", ctypes.c_void_p), ("out_lse", ctypes.c_void_p),
        ("o_state", ctypes.c_int64), ("o_token", ctypes.c_int64), ("o_head", ctypes.c_int64),
        ("lse_state", ctypes.c_int64), ("lse_token", ctypes.c_int64), ("lse_head", ctypes.c_int64),
        ("out_token", ctypes.c_int64), ("out_head", ctypes.c_int64),
        ("out_lse_token", ctypes.c_int64), ("out_lse_head", ctypes.c_int64),
        ("num_states", ctypes.c_int), ("num_tokens", ctypes.c_int), ("num_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
    ]


# What a ctypes field type is on the CUDA side: fj_abi::kind<T>::value of the C type.
_KINDS = {ctypes.c_void_p: ("p", "pointer"), ctypes.c_int: ("i", "integer"), ctypes.c_int64: ("i", "integer"),
          ctypes.c_float: ("f", "float")}

# FJ_OFFSETOF(T, field): offsetof without <cstddef> (the prelude includes no headers); NVRTC
# before 13.4 has no __builtin_offsetof but folds EDG's __INTADDR__ to a constant.
# fj_abi::kind<T>::value: 'p' for a pointer (restrict-qualified or not), 'i' for int and long
# long, 'f' for float, '?' for anything else. Enums, not variables: the checks leave nothing in
# the cubin.
_PREAMBLE = """\
#ifdef __has_builtin
#if __has_builtin(__builtin_offsetof)
#define FJ_OFFSETOF(T, field) __builtin_offsetof(T, field)
#endif
#endif
#ifndef FJ_OFFSETOF
#define FJ_OFFSETOF(T, field) __INTADDR__(&((T*)0)->field)
#endif
namespace fj_abi {
template <class T> struct kind { enum { value = '?' }; };
template <class T> struct kind<T*> { enum { value = 'p' }; };
template <class T> struct kind<T* __restrict__> { enum { value = 'p' }; };
template <> struct kind<int> { enum { value = 'i' }; };
template <> struct kind<long long> { enum { value = 'i' }; };
template <> struct kind<float> { enum { value = 'f' }; };
}  // namespace fj_abi"""


def _field_assert(c_struct: str, name: str, offset: int | None, ctype, origin: str) -> str:
    letter, kind = _KINDS[ctype]
    size = ctypes.sizeof(ctype)
    member = f"{c_struct}::{name}"
    conditions = ([f"FJ_OFFSETOF({c_struct}, {name}) == {offset}"] if offset is not None else []) + [
        f"sizeof({member}) == {size}", f"fj_abi::kind<decltype({member})>::value == '{letter}'"]
    where = f"offset {offset}, " if offset is not None else ""
    return (f'static_assert({" && ".join(conditions)}, '
            f'"ABI: {member} is not {origin} ({where}{size} bytes, {kind})");')


def struct_asserts(struct: type[ctypes.Structure]) -> list[str]:
    """static_asserts that the CUDA struct struct._c_name_ has struct's size and, field by field,
    its offsets, sizes and kinds."""
    c_struct, origin = struct._c_name_, f"flashjit.jit.abi.{struct.__name__}"
    size = ctypes.sizeof(struct)
    checks = [f'static_assert(sizeof({c_struct}) == {size}, "ABI: {c_struct} is not {size} bytes ({origin})");']
    for name, ctype in struct._fields_:
        checks.append(_field_assert(c_struct, name, getattr(struct, name).offset, ctype, f"{origin}.{name}"))
    return checks


def source_checks(mask_params, merge: bool, variant_params=()) -> str:
    """The ABI checks of one kernel source: decode::Args, merge::Args when the source has
    flashjit_merge (merge), and the mask's and the variant's runtime parameters (MaskParams and
    VariantParams fields, of the types of the kernel parameters that fill them)."""
    checks = ["// The host's argument layouts (flashjit.jit.abi), checked field by field.", _PREAMBLE,
              *struct_asserts(DecodeArgs), *struct_asserts(PlanArgs)]
    if merge:
        checks += struct_asserts(MergeArgs)
    for p in mask_params:
        checks.append(_field_assert("MaskParams", p.name, None, MASK_PARAM_CTYPES[p.kind],
                                    f"flashjit.masks.params.PARAM_KINDS['{p.kind}']"))
    for p in variant_params:
        checks.append(_field_assert("VariantParams", p.name, None, MASK_PARAM_CTYPES[p.kind],
                                    f"flashjit.masks.params.PARAM_KINDS['{p.kind}']"))
    return "\n".join(checks)


def mla_source_checks() -> str:
    """The ABI checks of an MLA kernel source: mla::Args and plan::Args field by field."""
    return "\n".join(["// The host's argument layouts (flashjit.jit.abi), checked field by field.", _PREAMBLE,
                      *struct_asserts(MLAArgs), *struct_asserts(PlanArgs)])


def merge_states_checks() -> str:
    """The ABI checks of the merge_states kernel source: merge_states::Args."""
    return "\n".join(["// The host's argument layout (flashjit.jit.abi), checked field by field.", _PREAMBLE,
                      *struct_asserts(MergeStatesArgs)])
