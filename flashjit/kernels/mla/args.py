"""The MLA kernel's argument struct as the host fills it (mla::Args, templates/mla/), and the ABI
checks its sources carry (jit/abi_checks.py)."""

from __future__ import annotations

import ctypes

from ...jit.abi_checks import source_checks
from ...worklist.record import PlanArgs


class MLAArgs(ctypes.Structure):
    """mla::Args, the MLA decode kernel's parameter."""

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


def abi_checks() -> str:
    """The ABI checks of an MLA source: mla::Args and plan::Args field by field."""
    return source_checks((MLAArgs, PlanArgs))
