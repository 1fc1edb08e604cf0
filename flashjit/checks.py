"""Input checks for plan() and run(): each failure is a ValueError naming the tensor, what was
expected and what came. Kept apart so the launch path reads as a straight line."""

from __future__ import annotations

import numpy as np


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def host_int_array(name: str, value, length: int | None = None) -> np.ndarray:
    """A 1-D integer array on the host (a CPU tensor, list or numpy array; a GPU tensor is copied)."""
    if hasattr(value, "detach"):
        if value.dtype.is_floating_point or value.dtype.is_complex:
            fail(name, "an integer tensor", value.dtype)
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        fail(name, "a 1-D integer array", f"shape {array.shape}, dtype {array.dtype}")
    if length is not None and len(array) != length:
        fail(name, f"length {length}", len(array))
    return array.astype(np.int64)


def indptr_array(name: str, value, *, length: int | None = None) -> np.ndarray:
    array = host_int_array(name, value, length)
    if len(array) < 1:
        fail(name, "at least one entry (batch_size + 1)", "an empty array")
    if array[0] != 0:
        fail(name, "to start at 0", int(array[0]))
    steps = np.diff(array)
    if np.any(steps < 0):
        at = int(np.argmax(steps < 0))
        fail(name, "non-decreasing values", f"{name}[{at}]={array[at]} > {name}[{at + 1}]={array[at + 1]}")
    return array


def tensor(name: str, t, *, dtype=None, device=None, ndim=None, shape=None) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if dtype is not None and t.dtype != dtype:
        fail(name, f"dtype {dtype}", t.dtype)
    if device is not None and t.device != device:
        fail(name, f"a tensor on {device}", t.device)
    if ndim is not None and t.dim() not in ((ndim,) if isinstance(ndim, int) else ndim):
        fail(name, f"{ndim} dimensions", f"shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)}", f"shape {tuple(t.shape)}")


def rows_16b_aligned(name: str, t, row: int) -> None:
    """The last dim contiguous and every row starting on a 16-byte boundary (vector loads)."""
    if t.stride(-1) != 1:
        fail(name, "a contiguous last dimension (stride 1)", f"strides {t.stride()}")
    elem = t.element_size()
    if t.data_ptr() % 16 or any((s * elem) % 16 for s in t.stride()[:-1]) or (row * elem) % 16:
        fail(name, "16-byte aligned rows (data_ptr and strides multiples of 16 bytes)",
             f"data_ptr % 16 = {t.data_ptr() % 16}, strides {t.stride()}")
