"""The merge_states kernel's argument struct as the host fills it (merge_states::Args,
templates/merge_states/), and the ABI checks its source carries (jit/abi_checks.py)."""

from __future__ import annotations

import ctypes

from ...jit.abi_checks import source_checks


class MergeStatesArgs(ctypes.Structure):
    """merge_states::Args, flashjit_merge_states's parameter."""

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


def abi_checks() -> str:
    """The ABI checks of the merge_states source: merge_states::Args field by field."""
    return source_checks((MergeStatesArgs,))
