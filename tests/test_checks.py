"""Input checks: each failure is a ValueError naming the tensor, what was expected and what came."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from flashjit import validation as checks
from flashjit.validation import host_int_array, indptr_array, rows_16b_aligned, tensor
from planner_oracle import reference_page_table


@pytest.mark.parametrize("value", [[0, 3, 5], np.array([0, 3, 5], dtype=np.int32), torch.tensor([0, 3, 5]),
                                   torch.tensor([0, 3, 5], dtype=torch.int32), (0, 3, 5)])
def test_indptr_accepts_host_integer_arrays(value):
    array = indptr_array("qo_indptr", value)
    assert array.dtype == np.int64 and list(array) == [0, 3, 5]


def test_indptr_allows_empty_requests():
    assert list(indptr_array("kv_indptr", [0, 0, 4, 4])) == [0, 0, 4, 4]


@pytest.mark.parametrize("value, expected, got", [
    ([0, 5, 3, 6], "non-decreasing", "qo_indptr[1]=5 > qo_indptr[2]=3"),
    ([1, 2, 3], "to start at 0", "got 1"),
    ([], "at least one entry", "an empty array"),
    (np.zeros((2, 3), dtype=np.int64), "a 1-D integer array", "shape (2, 3)"),
    (np.array([0.0, 1.0]), "a 1-D integer array", "dtype float64"),
    (torch.tensor([0.0, 1.0]), "an integer tensor", "torch.float32"),
    (torch.tensor([True, False]), "a 1-D integer array", "dtype bool"),
    (np.int64(3), "a 1-D integer array", "shape ()"),
])
def test_indptr_rejects(value, expected, got):
    with pytest.raises(ValueError) as info:
        indptr_array("qo_indptr", value)
    message = str(info.value)
    assert message.startswith("qo_indptr: expected ")
    assert expected in message and got in message


def test_host_int_array_length_mismatch():
    with pytest.raises(ValueError) as info:
        host_int_array("kv_lens", [1, 2, 3], length=4)
    assert str(info.value) == "kv_lens: expected length 4, got 3"
    assert list(host_int_array("kv_lens", [1, 2, 3, 4], length=4)) == [1, 2, 3, 4]


def test_indptr_length_mismatch():
    with pytest.raises(ValueError) as info:
        indptr_array("qo_indptr", [0, 1, 2], length=5)
    assert "qo_indptr" in str(info.value) and "length 5" in str(info.value) and "got 3" in str(info.value)


def test_host_int_array_copies_tensors_to_numpy():
    source = torch.tensor([4, 5, 6], dtype=torch.int32)
    array = host_int_array("lens", source)
    array[0] = 99
    assert source[0] == 4 and array.dtype == np.int64


def test_tensor_accepts_matching():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    tensor("q", t, dtype=torch.bfloat16, device=torch.device("cpu"), ndim=2, shape=(2, 3))
    tensor("q", t, ndim=(2, 3))


@pytest.mark.parametrize("kwargs, expected, got", [
    (dict(dtype=torch.float16), "dtype torch.float16", "torch.bfloat16"),
    (dict(device=torch.device("cuda", 0)), "a tensor on cuda:0", "cpu"),
    (dict(ndim=3), "3 dimensions", "shape (2, 3)"),
    (dict(ndim=(3, 4)), "(3, 4) dimensions", "shape (2, 3)"),
    (dict(shape=(2, 4)), "shape (2, 4)", "shape (2, 3)"),
])
def test_tensor_messages_name_tensor_expected_and_got(kwargs, expected, got):
    with pytest.raises(ValueError) as info:
        tensor("k_cache", torch.zeros(2, 3, dtype=torch.bfloat16), **kwargs)
    assert str(info.value) == f"k_cache: expected {expected}, got {got}"


def test_tensor_rejects_non_tensors():
    with pytest.raises(ValueError) as info:
        tensor("v_cache", np.zeros(3))
    assert str(info.value) == "v_cache: expected a torch.Tensor, got ndarray"


def test_rows_aligned_accepts_contiguous_rows():
    t = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    rows_16b_aligned("q", t, 128)
    rows_16b_aligned("q", t[1:], 128)  # starts one 256-byte row later: still aligned
    rows_16b_aligned("q", t.transpose(0, 1), 128)  # permuted leading dims: every stride still 16-byte


@pytest.mark.parametrize("make, expected", [
    (lambda: torch.zeros(128, 4, dtype=torch.float16).t(), "contiguous last dimension"),
    (lambda: torch.zeros(4, 256, dtype=torch.float16)[:, ::2], "contiguous last dimension"),
    (lambda: torch.zeros(4, 100, dtype=torch.float16), "16-byte aligned rows"),     # 200-byte row stride
    (lambda: torch.zeros(4, 136, dtype=torch.float16)[:, 1:129], "16-byte aligned rows"),  # data_ptr + 2
])
def test_rows_aligned_rejects(make, expected):
    t = make()
    with pytest.raises(ValueError) as info:
        rows_16b_aligned("k_cache", t, 128)
    message = str(info.value)
    assert message.startswith("k_cache: expected ") and expected in message
    assert str(t.stride()) in message


def test_rows_aligned_checks_row_length():
    with pytest.raises(ValueError) as info:
        rows_16b_aligned("q", torch.zeros(4, 128, dtype=torch.float16), 100)  # 200-byte rows
    assert "16-byte aligned rows" in str(info.value)


# ---- plan() arguments ---------------------------------------------------------------------------

def test_cache_strides_must_fit_the_kernels_32_bit_multiplies():
    checks.strides_fit_int32("k_cache", (2**31 - 1, 1024, 128))
    with pytest.raises(ValueError, match=re.escape("strides below 2**31 elements") + ".*strides \\(2147483648, 1024, 128\\)"):
        checks.strides_fit_int32("k_cache", (2**31, 1024, 128))


def test_page_table_gives_kv_lens():
    indptr_h, kv_lens = checks.page_table([0, 2, 2, 5], [7, 0, 16], 16)
    assert list(indptr_h) == [0, 2, 2, 5] and list(kv_lens) == [16 + 7, 0, 2 * 16 + 16]


@pytest.mark.parametrize("last, bad", [([17, 0, 1], "last_page_len[0]=17"), ([0, 0, 1], "last_page_len[0]=0"),
                                       ([3, -1, 1], "last_page_len[1]=-1")])
def test_page_table_rejects_last_page_len_out_of_range(last, bad):
    with pytest.raises(ValueError, match=r"last_page_len: expected values in 1..page_size=16 .* got " + re.escape(bad)):
        checks.page_table([0, 2, 2, 5], last, 16)


def test_page_table_rejects_a_length_mismatch():
    with pytest.raises(ValueError, match="last_page_len: expected length 3, got 2"):
        checks.page_table([0, 2, 2, 5], [1, 1], 16)


@pytest.mark.parametrize("args, message", [((0, 8, 16), "num_qo_heads: expected a positive int, got 0"),
                                           ((32, 8, 0), "page_size: expected a positive int, got 0"),
                                           ((32, 7, 16), "num_qo_heads: expected a multiple of num_kv_heads=7, got 32"),
                                           ((32.0, 8, 16), "num_qo_heads: expected a positive int, got 32.0")])
def test_head_counts(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        checks.head_counts(*args)


def test_query_indptr():
    assert list(checks.query_indptr(None, None, 3)) == [0, 1, 2, 3]
    assert list(checks.query_indptr(None, 4, 2)) == [0, 4, 8]
    assert list(checks.query_indptr([0, 1, 5], None, 2)) == [0, 1, 5]
    with pytest.raises(ValueError, match="q_len: expected a positive int, got 0"):
        checks.query_indptr(None, 0, 2)
    with pytest.raises(ValueError, match="qo_indptr: expected length 3, got 2"):
        checks.query_indptr([0, 1], None, 2)


def outcome(fn, *args):
    try:
        return fn(*args)
    except ValueError as error:
        return str(error)


def test_page_table_matches_the_reference_on_random_tables():
    rng = np.random.default_rng(5)
    for _ in range(2000):
        batch, page_size = int(rng.integers(0, 40)), int(rng.choice([1, 2, 16, 64, 256]))
        pages = rng.integers(0, 20, size=batch) * (rng.random(batch) > 0.2)
        indptr = np.concatenate([[0], np.cumsum(pages)])
        if batch and rng.random() < 0.1:
            indptr[rng.integers(1, batch + 1)] -= 30  # decreasing somewhere
        last = np.where(pages > 0, rng.integers(1, page_size + 1, size=batch),
                        rng.integers(0, page_size + 1, size=batch))
        if batch and rng.random() < 0.3:
            last[rng.integers(batch)] = rng.choice([-1, 0, page_size + 1])
        as_input = rng.choice([list, np.asarray, torch.tensor])
        new = outcome(checks.page_table, as_input(indptr.tolist()), as_input(last.tolist()), page_size)
        old = outcome(reference_page_table, as_input(indptr.tolist()), as_input(last.tolist()), page_size)
        if isinstance(old, str):
            assert new == old
        else:
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(new, old))
