"""The decode kernels' argument structs as the host fills them (decode::Args, merge::Args in
templates/decode/), and the ABI checks their sources carry (jit/abi_checks.py)."""

from __future__ import annotations

import ctypes

from ...jit.abi_checks import param_asserts, source_checks
from ...worklist.record import PlanArgs


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


def abi_checks(mask_params, merge: bool, variant_params=()) -> str:
    """The ABI checks of one decode source: decode::Args, plan::Args, merge::Args when the source has
    flashjit_merge (merge), and the mask's and the variant's runtime parameters (MaskParams and
    VariantParams fields, of the types of the kernel parameters that fill them)."""
    structs = (DecodeArgs, PlanArgs) + ((MergeArgs,) if merge else ())
    return source_checks(structs, param_asserts("MaskParams", mask_params) + param_asserts("VariantParams",
                                                                                           variant_params))
