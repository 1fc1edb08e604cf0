"""Input checks for plan() and run(): each failure is a ValueError naming the tensor, what was
expected and what came. Kept apart so the launch path reads as a straight line."""

from __future__ import annotations

import math
import numbers

import numpy as np

from .small_arrays import largest, smallest


INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_MIN_NORMAL = float(np.finfo(np.float32).tiny)


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def did_you_mean(value, names) -> str:
    """"; did you mean 'causal'?" where value is a string close to one of names (a typo), else ""."""
    import difflib

    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(n) for n in names], n=2, cutoff=0.6)
    return "; did you mean " + " or ".join(map(repr, close)) + "?" if close else ""


# Scalars reach the kernel as C int and float values, which ctypes fills by wrapping and rounding
# silently (2**32 becomes 0): each is checked to survive the conversion. A bool is refused where an
# int or a float is meant: True as a window or a scale is a mistake, not a 1.

def int32_param(name: str, value) -> int:
    """An int mask parameter: an int (or numpy integer) in 0..2**31-1."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value <= INT32_MAX:
        return int(value)
    fail(name, f"an int in 0..{INT32_MAX} (int32; a bool is not an int here)", repr(value))


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


# The range checks compare the value itself, before any float(): NaN fails every comparison, and an
# int too large for a double compares exactly instead of raising OverflowError.

def float32_param(name: str, value) -> float:
    """A float mask parameter: a real number (not a bool) that is a finite float32."""
    if _real(value) and -FLOAT32_MAX <= value <= FLOAT32_MAX:
        return float(value)
    fail(name, f"a finite float (float32: magnitude at most {FLOAT32_MAX:.2g})", repr(value))


def positive_float32(name: str, value, factor: float = 1.0) -> float:
    """A real number > 0 whose product with factor is a normal float32 (the kernel's value, e.g.
    sm_scale * log2(e)): neither infinite nor flushed to 0."""
    low, high = FLOAT32_MIN_NORMAL / factor, FLOAT32_MAX / factor
    if _real(value) and low <= value <= high:
        return float(value)
    kernel_value = "a normal float32" if factor == 1.0 else f"times {factor:.6g} a normal float32"
    fail(name, f"a finite float > 0 in {low:.3g}..{high:.3g} ({kernel_value})", repr(value))


def require_cuda(torch, device, who: str, instead: str) -> None:
    """Raises RuntimeError("no CUDA device: <who> needs one (why); <instead>") where device is a
    CUDA device torch cannot use: torch built without CUDA, no GPU found, or no device of that index."""
    if device.type != "cuda":
        return
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is built without CUDA"
    elif not torch.cuda.is_available():
        why = "torch finds no CUDA GPU: check the driver and CUDA_VISIBLE_DEVICES"
    elif device.index is not None and device.index >= torch.cuda.device_count():
        why = f"{device} does not exist: torch finds {torch.cuda.device_count()} CUDA devices"
    else:
        return
    raise RuntimeError(f"no CUDA device: {who} needs one ({why}); {instead}")


def host_int_array(name: str, value, length: int | None = None) -> np.ndarray:
    """A 1-D integer array on the host (a CPU tensor, list or numpy array; a GPU tensor is copied)."""
    if hasattr(value, "detach"):
        if value.dtype.is_floating_point or value.dtype.is_complex:
            fail(name, "an integer tensor", value.dtype)
        value = (value if value.is_cpu else value.cpu()).numpy()  # an integer tensor never requires grad
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "ium"):  # numpy's integer kinds, timedelta too
        fail(name, "a 1-D integer array", f"shape {array.shape}, dtype {array.dtype}")
    if length is not None and len(array) != length:
        fail(name, f"length {length}", len(array))
    return array.astype(np.int64)


def indptr_array(name: str, value, *, length: int | None = None) -> np.ndarray:
    return _indptr_and_steps(name, value, length)[0]


def _indptr_and_steps(name: str, value, length: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """A validated CSR offset array, its steps (the entries of each row) and the smallest step."""
    array = host_int_array(name, value, length)
    if len(array) < 1:
        fail(name, "at least one entry (batch_size + 1)", "an empty array")
    if array[0] != 0:
        fail(name, "to start at 0", int(array[0]))
    steps = array[1:] - array[:-1]
    fewest = smallest(steps)
    if fewest < 0:
        at = int(np.argmax(steps < 0))
        fail(name, "non-decreasing values", f"{name}[{at}]={array[at]} > {name}[{at + 1}]={array[at + 1]}")
    return array, steps, fewest


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


def strides_fit_int32(name: str, strides: tuple[int, ...]) -> None:
    """The kernel multiplies page, slot and head strides in 32 bits (the products are 64-bit)."""
    if max(strides) > INT32_MAX:
        fail(name, "page, slot and head strides below 2**31 elements", f"strides {strides}")


def head_counts(num_qo_heads, num_kv_heads, page_size) -> None:
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            fail(name, "a positive int", value)
        if value > INT32_MAX:
            fail(name, f"at most {INT32_MAX} (int32)", value)
    if num_qo_heads % num_kv_heads:
        fail("num_qo_heads", f"a multiple of num_kv_heads={num_kv_heads}", num_qo_heads)


def page_table(indptr, last_page_len, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, kv_lens) on the host from a CSR page table and each request's last-page fill."""
    indptr_h, pages, fewest_pages = _indptr_and_steps("indptr", indptr, None)
    last = host_int_array("last_page_len", last_page_len, len(pages))
    if smallest(last, 1) < 1 or largest(last) > page_size:  # else every value is valid: skip the details
        bad = (last > page_size) | (last < 0) | ((last < 1) & (pages > 0))
        if np.any(bad):
            at = int(np.argmax(bad))
            fail("last_page_len", f"values in 1..page_size={page_size} (0 only for requests with no pages)",
                 f"last_page_len[{at}]={last[at]}")
    kv_lens = (pages - 1) * page_size + last
    if fewest_pages == 0:  # a request without pages has no tokens (its last <= page_size: clamp at 0)
        np.maximum(kv_lens, 0, out=kv_lens)
    longest = largest(kv_lens)
    if longest > INT32_MAX:  # the kernel's positions, and the work list's fields, are int32
        at = int(np.argmax(kv_lens))
        fail("kv_len", f"at most {INT32_MAX} tokens per request (int32)", f"request {at} of {longest} tokens")
    if indptr_h[-1] > INT32_MAX:
        fail("indptr", f"at most {INT32_MAX} page ids in all (int32)", int(indptr_h[-1]))
    return indptr_h, kv_lens


def query_indptr(qo_indptr, q_len, batch: int) -> np.ndarray:
    """Query-token offsets per request: qo_indptr as given, or q_len tokens each (default 1)."""
    if qo_indptr is not None:
        offsets = indptr_array("qo_indptr", qo_indptr, length=batch + 1)
        if offsets[-1] > INT32_MAX:
            fail("qo_indptr", f"at most {INT32_MAX} query tokens in all (int32)", int(offsets[-1]))
        return offsets
    n = 1 if q_len is None else q_len
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        fail("q_len", "a positive int", q_len)
    if max(batch, 1) * n > INT32_MAX:
        fail("q_len", f"at most {INT32_MAX} query tokens in all (int32)", f"{batch} requests of {n}")
    return np.arange(batch + 1, dtype=np.int64) * n


SCALE_FORMS = "a positive float, or a float32 tensor of 1 or num_kv_heads values on the cache's device"


def kv_scale(name: str, value, *, num_kv_heads: int, device, required: bool) -> tuple[float, int, int]:
    """(host factor, device pointer or 0, per-head stride) of run()'s k_scale or v_scale.

    A tensor is read by the kernel at launch, so its values may change between CUDA-graph replays;
    its values are checked by tensor_scale_values (a synchronization), not here."""
    import torch

    if value is None:
        if required:
            fail(name, f"a scale for the fp8 cache: {SCALE_FORMS}", None)
        return 1.0, 0, 0
    if isinstance(value, torch.Tensor):
        tensor(name, value, dtype=torch.float32, device=device)
        if value.numel() not in (1, num_kv_heads) or not value.is_contiguous():
            fail(name, f"1 or num_kv_heads={num_kv_heads} contiguous values", f"shape {tuple(value.shape)}")
        return 1.0, value.data_ptr(), 0 if value.numel() == 1 else 1
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        fail(name, SCALE_FORMS, repr(value))
    return float(value), 0, 0


def tensor_scale_values(name: str, t) -> None:
    """Every value of a scale tensor positive and finite (one device synchronization)."""
    import torch

    if not bool(((t > 0) & torch.isfinite(t)).all()):
        fail(name, "positive finite values", t.flatten()[:8].tolist())


def largest_page_id(low: int, high: int) -> int:
    """The largest of a plan's page ids, given their smallest and largest; a negative id fails."""
    if low < 0:
        fail("indices", "page ids >= 0", low)
    return high
