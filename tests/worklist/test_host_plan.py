"""host_planner: the C planner gives exactly the numpy planner's tables, work and staging contents.

The numpy side (validation.page_table, validation.query_indptr, split_plan.plan_work) is the
reference, itself held to planner_oracle's plain forms by tests/test_plan.py. Needs a C compiler
(as plan() does for its fast path); skipped without one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashjit.serving.host_plan import load_host_plan
from flashjit.serving.buffers import Capacity, PlanBuffers
from flashjit.worklist.host import HostPlanner, NativeTables, NumpyTables
from flashjit.worklist.split import WorkPlan

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    from flashjit.jit.cache import KernelCache

    lib = load_host_plan(KernelCache(tmp_path_factory.mktemp("host-cache")))
    if lib is None:
        pytest.skip("no C compiler: plan() uses the numpy planner here")
    return lib


def i32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32)


def page_table(kv_lens, page_size):
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = np.concatenate([[0], np.cumsum(pages, dtype=np.int64)])
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)]
    return i32(indptr), i32(last)


def random_case(rng):
    batch = int(rng.integers(0, 48))
    page_size = int(rng.choice([1, 8, 16, 64]))
    kv_lens = np.where(rng.random(batch) < 0.1, 0, np.exp(rng.uniform(0, np.log(40000), batch)).astype(np.int64))
    indptr, last = page_table(kv_lens.tolist(), page_size)
    if rng.random() < 0.5:
        qo_indptr, q_len = None, (None if rng.random() < 0.5 else int(rng.integers(1, 5)))
    else:
        qo_indptr, q_len = i32(np.concatenate([[0], np.cumsum(rng.integers(0, 5, batch))])), None
    spans = (None, None)
    if rng.random() < 0.4:  # a mask's kv_span: some inverted, sometimes starting at 0
        begin = rng.integers(0, 5000, batch)
        spans = (None if rng.random() < 0.3 else begin, np.minimum(kv_lens, rng.integers(0, 40000, batch)))
    chunk_tokens = None if rng.random() < 0.8 else int(rng.integers(1, 5000))
    options = dict(ctas_per_item=int(rng.choice([1, 8, 16, 32])), max_ctas=int(rng.choice([16, 264, 528])),
                   granularity=int(rng.choice([16, 32, 64])), chunk_tokens=chunk_tokens,
                   max_items=None if rng.random() < 0.7 else int(rng.integers(max(batch, 1), 200)),
                   fixed_split=chunk_tokens is not None and rng.random() < 0.5)
    return (indptr, last, page_size, qo_indptr, q_len), spans, options


def staged(tables, work) -> tuple[list, WorkPlan]:
    """The staging buffer's contents after tables.write, and the work plan read back from it."""
    buffers = PlanBuffers(Capacity(tables.batch, tables.num_tokens, work.num_work), partial_rows=1, head_dim=1,
                          merge_groups=1, device=CPU)
    buffers.write(tables)
    return buffers.host.tolist(), tables.work_plan(buffers.host, buffers.starts)


@pytest.mark.parametrize("seed", range(300))
def test_native_tables_match_numpy_on_random_batches(library, seed):
    rng = np.random.default_rng(seed)
    inputs, spans, options = random_case(rng)
    native, reference = HostPlanner(library).read(*inputs), HostPlanner(None).read(*inputs)
    assert isinstance(native, NativeTables) and isinstance(reference, NumpyTables)
    for field in ("batch", "num_tokens", "max_q_len", "num_page_ids"):
        assert getattr(native, field) == getattr(reference, field), field
    assert np.array_equal(native.kv_lens, reference.kv_lens) and np.array_equal(native.q_lens, reference.q_lens)

    work, expected = native.plan(*spans, **options), reference.plan(*spans, **options)
    assert (work.chunk_tokens, work.num_work, work.needs_merge) == (
        expected.chunk_tokens, expected.num_work, expected.needs_merge)
    assert native.fixed_split == expected.fixed_split == options["fixed_split"]
    (contents, work_plan), (expected_contents, _) = staged(native, work), staged(reference, expected)
    assert contents == expected_contents
    for field in ("work_request", "work_begin", "work_end", "req_work_indptr", "req_qo_indptr", "token_request"):
        assert np.array_equal(getattr(work_plan, field), getattr(expected, field)), field
    assert work_plan.max_splits == expected.max_splits and work_plan.fixed_split == expected.fixed_split


def test_one_item_per_request_when_splitting_is_off(library):
    indptr, last = page_table([5000, 0, 130], 16)
    native, reference = (HostPlanner(lib).read(indptr, last, 16) for lib in (library, None))
    options = dict(ctas_per_item=8, max_ctas=264, granularity=16)
    assert native.plan(None, None, chunk_tokens=5000, **options).num_work == 3
    assert staged(native, native)[0] == staged(reference, reference.plan(None, None, chunk_tokens=5000, **options))[0]


BAD_TABLES = {
    "indptr not from 0": ([1, 3, 5], [2, 2], None),
    "indptr decreasing": ([0, 4, 3], [2, 2], None),
    "last_page_len 0 with pages": ([0, 2, 4], [0, 3], None),
    "last_page_len over page_size": ([0, 2, 4], [3, 17], None),
    "last_page_len negative": ([0, 0, 4], [-1, 3], None),
    "qo_indptr not from 0": ([0, 2, 4], [3, 3], [1, 2, 3]),
    "qo_indptr decreasing": ([0, 2, 4], [3, 3], [0, 2, 1]),
}


@pytest.mark.parametrize("case", BAD_TABLES)
def test_a_refused_table_raises_the_numpy_checks_error(library, case):
    indptr, last, qo = BAD_TABLES[case]
    args = (i32(indptr), i32(last), 16, None if qo is None else i32(qo))
    with pytest.raises(ValueError) as expected:
        HostPlanner(None).read(*args)
    with pytest.raises(ValueError) as got:
        HostPlanner(library).read(*args)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("form", ["list", "numpy", "int64 tensor", "strided tensor", "short last_page_len",
                                  "bool q_len"])
def test_other_input_forms_go_through_numpy(library, form):
    indptr, last, q_len = [0, 2, 5], [3, 16], None
    if form == "list":
        args = (indptr, last)
    elif form == "numpy":
        args = (np.array(indptr, dtype=np.int32), np.array(last, dtype=np.int32))
    elif form == "int64 tensor":
        args = (torch.tensor(indptr), torch.tensor(last))
    elif form == "strided tensor":
        args = (i32([0, 9, 2, 9, 5])[::2], i32(last))
    elif form == "short last_page_len":
        args = (i32(indptr), i32(last[:1]))
    else:
        args, q_len = (i32(indptr), i32(last)), True
    planner = HostPlanner(library)
    if form in ("short last_page_len", "bool q_len"):  # refused with the numpy checks' message
        with pytest.raises(ValueError, match="last_page_len|q_len"):
            planner.read(*args, 16, None, q_len)
        return
    tables = planner.read(*args, 16, None, q_len)
    assert isinstance(tables, NumpyTables) and tables.kv_lens.tolist() == [19, 48]


@pytest.mark.parametrize("seed", range(20))
def test_the_chunk_search_is_exact_for_spans_near_int32_max(library, seed):
    """The C chunk search divides in doubles: spans up to INT32_MAX, and granularities that make
    quotients fall just beside whole numbers and halves, give numpy's chunk and items."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 24))
    inputs = (*page_table([1] * batch, 1), 1)
    top = 2 ** 31 - 1
    end = np.where(rng.random(batch) < 0.5, top - rng.integers(0, 1000, batch), rng.integers(0, top, batch))
    begin = np.where(rng.random(batch) < 0.5, 0, rng.integers(0, 1000, batch))
    options = dict(ctas_per_item=int(rng.choice([1, 8, 32])), max_ctas=int(rng.choice([16, 264, 4096])),
                   granularity=int(rng.choice([16, 127, 2 ** 20 - 1, 2 ** 24 + 1])))
    native, reference = HostPlanner(library).read(*inputs), HostPlanner(None).read(*inputs)
    work, expected = native.plan(begin, end, **options), reference.plan(begin, end, **options)
    assert (work.chunk_tokens, work.num_work) == (expected.chunk_tokens, expected.num_work)
