"""Input checks: each failure is a ValueError naming the tensor, what was expected and what came."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashjit.checks import host_int_array, indptr_array, rows_16b_aligned, tensor


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
