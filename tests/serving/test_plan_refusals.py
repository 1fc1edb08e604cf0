"""plan() refuses every value the kernel would take wrongly, before anything of the current plan changes.

Each refusal case is planned on a CPU decoder (tests/cpu_decoders.py's) over both host planners, the C
one and the numpy one: it must raise a ValueError naming the bad value and what is accepted, and
leave the decoder's current plan exactly as it was: the same Plan, work list, staging and device
buffers, launch arguments and host tables, and a run() of the previous plan's queries still
launching the previous plan's grid. Then the values at the edges that are accepted, and the empty
batch, which plans and runs without a launch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from flashjit import validation
from flashjit.masks.registry import register_mask
from flashjit.worklist.host import HostPlanner

from cpu_decoders import cpu_decoder, native_library, tables

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 128, 16
INT32_MAX = 2**31 - 1
PREVIOUS_LENS = [9000, 7000, 40, 8000]  # the plan in place: larger, so a refused plan would fit its buffers
REFUSED_LENS = [300, 200, 40]           # 19, 13 and 3 blocks of 16 tokens


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def block_sparse(**changes) -> dict:
    params = {"block_size": 16, "block_indptr": [0, 2, 3, 4], "block_indices": [0, 5, 1, 2], **changes}
    return {"mask": "block_sparse", "mask_params": {name: i32(v) if isinstance(v, list) else v
                                                    for name, v in params.items()}}


def scaled(value) -> dict:
    return {"mask": "scaled", "mask_params": {"scale": value}}


# (id, plan() keywords, tables (indptr, indices, last_page_len, page_size) or None for REFUSED_LENS', message)
REFUSALS = [
    # block_sparse's tensors against the batch and its block count per request
    ("block_indptr short", block_sparse(block_indptr=[0, 2]), None,
     r"^mask param block_indptr: expected batch_size \+ 1 = 4 entries, got 2$"),
    ("block_indptr long", block_sparse(block_indptr=[0, 2, 3, 4, 4]), None,
     r"^mask param block_indptr: expected batch_size \+ 1 = 4 entries, got 5$"),
    ("block_indptr not from 0", block_sparse(block_indptr=[1, 2, 3, 4]), None,
     r"^mask param block_indptr: expected to start at 0, got 1$"),
    ("block_indptr decreasing", block_sparse(block_indptr=[0, 3, 2, 4]), None,
     r"^mask param block_indptr: expected non-decreasing values, got .*\[1\]=3 > .*\[2\]=2$"),
    ("block_indices short", block_sparse(block_indptr=[0, 2, 3, 5]), None,
     r"^mask param block_indices: expected at least block_indptr\[-1\]=5 block ids, got 4$"),
    ("block id negative", block_sparse(block_indices=[-1, 5, 1, 2]), None,
     r"^mask param block_indices: expected .*0\.\.ceil\(kv_len / block_size\) - 1.*, got block_indices\[0\]=-1 "
     r"of request 0 \(kv_len 300: 19 blocks of 16\)$"),
    ("block id past kv_len", block_sparse(block_indices=[0, 19, 1, 2]), None,
     r"got block_indices\[1\]=19 of request 0 \(kv_len 300: 19 blocks of 16\)$"),
    ("block id past a short request", block_sparse(block_indices=[0, 5, 1, 3]), None,
     r"got block_indices\[3\]=3 of request 2 \(kv_len 40: 3 blocks of 16\)$"),
    ("block id huge", block_sparse(block_indices=[0, INT32_MAX, 1, 2]), None,
     r"got block_indices\[1\]=2147483647 "),
    ("block ids repeated", block_sparse(block_indices=[5, 5, 1, 2]), None,
     r"^mask param block_indices: expected each request's block ids in increasing order \(each once\), "
     r"got block_indices\[1\]=5 after 5 in request 0$"),
    ("block ids unsorted", block_sparse(block_indices=[5, 0, 1, 2]), None,
     r"got block_indices\[1\]=0 after 5 in request 0$"),
    ("block_size 0", block_sparse(block_size=0), None, r"^mask param block_size: expected a positive int, got 0$"),
    ("block_size bool", block_sparse(block_size=True), None,
     r"^mask param block_size: expected an int in 0\.\.2147483647"),
    ("block_size 2**31", block_sparse(block_size=2**31), None,
     r"^mask param block_size: expected an int in 0\.\.2147483647"),
    # sm_scale: finite, positive, a normal float32 once multiplied by log2(e)
    *[(f"sm_scale {value!r:.24}", {"sm_scale": value}, None,
       rf"^sm_scale: expected a finite float > 0 .*, got {pattern}$")
      for value, pattern in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"), (-0.125, "-0.125"),
                             (0.0, "0.0"), (True, "True"), (1e300, "1e\\+300"), (1e-45, "1e-45"), ("0.1", "'0.1'"),
                             (10**400, "1" + "0" * 400))],
    # int mask parameters: what the kernel's int holds (bool is not an int here)
    *[(f"window_left {value!r}", {"mask": "sliding_window", "window_left": value}, None,
       rf"^mask param window_left: expected an int in 0\.\.2147483647 \(int32; a bool is not an int here\), "
       rf"got {pattern}$")
      for value, pattern in ((2**31, "2147483648"), (2**32, "4294967296"), (-1, "-1"), (True, "True"),
                             (np.int64(2**31), r"np\.int64\(2147483648\)"), (300.0, "300.0"))],
    # float mask parameters: finite float32 values
    *[(f"float param {value!r:.24}", scaled(value), None,
       rf"^mask param scale: expected a finite float \(float32: magnitude at most 3\.4e\+38\), got {pattern}$")
      for value, pattern in ((float("nan"), "nan"), (float("inf"), "inf"), (True, "True"), ("x", "'x'"),
                             (1e39, "1e\\+39"), (10**400, "1" + "0" * 400))],
    # lengths the kernel's int32 fields hold
    *[(f"chunk_tokens {value!r}", {"chunk_tokens": value}, None,
       rf"^chunk_tokens: expected a positive int up to 2147483647 \(a bool is not an int here\), got {pattern}$")
      for value, pattern in ((2**64, "18446744073709551616"), (2**31, "2147483648"), (True, "True"), (0, "0"))],
    ("request past int32", {}, (i32([0, 2**27 + 1]), i32([0]), i32([16]), 16),
     r"^kv_len: expected at most 2147483647 tokens per request \(int32\), got request 0 of 2147483664 tokens$"),
    ("page ids past int32", {}, (np.array([0, 2**30, 2**31, 3 * 2**30 - 1]), i32([0]), i32([1, 1, 1]), 1),
     r"^indptr: expected at most 2147483647 page ids in all \(int32\), got 3221225471$"),
    ("query tokens past int32", {"qo_indptr": np.array([0, 1, 2, 2**31 + 3])}, None,
     r"^qo_indptr: expected at most 2147483647 query tokens in all \(int32\), got 2147483651$"),
    ("q_len past int32", {"q_len": 2**30 + 1}, None,
     r"^q_len: expected at most 2147483647 query tokens in all \(int32\), got 3 requests of 1073741825$"),
]
IDS = [case[0] for case in REFUSALS]


@pytest.fixture
def scaled_mask(isolated_masks, mask_file, tmp_path):
    """A mask with a float parameter, 'scaled'."""
    register_mask("scaled", template=mask_file(tmp_path, "scaled", "return kv_pos <= q_pos;"),
                  params={"scale": "float"})


@pytest.fixture(params=["native", "numpy"])
def host_planner(request):
    if request.param == "native" and native_library() is None:
        pytest.skip("no C compiler: plan() uses the numpy planner here")
    return HostPlanner(native_library() if request.param == "native" else None)


def refused_plan(decoder, keywords, tables_or_none):
    indptr, indices, last, page_size = tables_or_none or (*tables(REFUSED_LENS, PAGE, np.random.default_rng(3)), PAGE)
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, page_size, **keywords)


@pytest.mark.parametrize("name, keywords, tables_or_none, message", REFUSALS, ids=IDS)
def test_plan_refuses_what_the_kernel_would_take_wrongly(planner, scaled_mask, host_planner, name, keywords,
                                                         tables_or_none, message):
    decoder = cpu_decoder(planner, host_planner=host_planner)
    with pytest.raises(ValueError, match=message):
        refused_plan(decoder, keywords, tables_or_none)
    assert decoder.current_plan is None


@pytest.mark.parametrize("name, keywords, tables_or_none, message", REFUSALS, ids=IDS)
def test_a_refused_plan_leaves_the_current_one_intact(planner, scaled_mask, host_planner, launches, name, keywords,
                                                      tables_or_none, message):
    decoder = cpu_decoder(planner, host_planner=host_planner, current_stream=lambda index: 0x77)
    indptr, indices, last = tables(PREVIOUS_LENS, PAGE, np.random.default_rng(2))
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)
    plan = decoder.current_plan
    work = {field: np.copy(getattr(plan.work, field)) for field in
            ("work_request", "work_begin", "work_end", "req_work_indptr", "req_qo_indptr", "token_request")}
    kept = (np.copy(plan.tables.kv_lens), np.copy(plan.buffers.host), plan.buffers.device_buffer.clone(),
            bytes(plan.decode_args), plan.decode_launch.grid)
    with pytest.raises(ValueError, match=message):
        refused_plan(decoder, keywords, tables_or_none)

    assert decoder.current_plan is plan and (decoder.batch_size, decoder.num_tokens) == (4, 4)
    for field, values in work.items():
        assert np.array_equal(getattr(decoder.work, field), values), field
    kv_lens, host, device, args, grid = kept
    assert np.array_equal(plan.tables.kv_lens, kv_lens) and np.array_equal(plan.buffers.host, host)
    assert torch.equal(plan.buffers.device_buffer, device) and bytes(plan.decode_args) == args
    q = torch.randn(4, HEADS, DIM, dtype=torch.bfloat16)  # the previous plan's queries, its cache
    k, v = (torch.zeros(int(indices.max()) + 1, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16) for _ in range(2))
    decoder.run(q, (k, v))
    assert launches[0] == (plan.decode_launch.function, grid, 0x77)


def test_a_kv_span_of_another_length_than_the_batch_is_refused(planner, host_planner, isolated_masks, mask_file,
                                                                tmp_path):
    """The planners read one span per request: a user mask's kv_span must give as many."""
    register_mask("short_span", template=mask_file(tmp_path, "short_span", "return true;"),
                  kv_span=lambda kv_lens, q_lens, params: (None, kv_lens[:1]))
    decoder = cpu_decoder(planner, host_planner=host_planner)
    with pytest.raises(ValueError, match=r"^mask 'short_span''s kv_span: expected 3 span ends, one per request, "
                                         r"got shape \(1,\)$"):
        refused_plan(decoder, {"mask": "short_span"}, None)


# ---- what is accepted -------------------------------------------------------------------------------------

def test_values_at_the_edges_are_accepted(planner, scaled_mask):
    decoder = cpu_decoder(planner)
    indptr, indices, last = tables(REFUSED_LENS, PAGE, np.random.default_rng(3))
    plan = lambda **keywords: decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **keywords)  # noqa: E731
    plan(mask="sliding_window", window_left=INT32_MAX)
    assert ctypes.cast(decoder.current_plan.decode_launch.params[1], ctypes.POINTER(ctypes.c_int))[0] == INT32_MAX
    plan(mask="sliding_window", window_left=np.int32(7))
    for value in (-0.5, 2, np.float32(1.5)):  # any finite real, negative too
        plan(**scaled(value))
        assert ctypes.cast(decoder.current_plan.decode_launch.params[1], ctypes.POINTER(ctypes.c_float))[0] == value
    plan(sm_scale=1e-3)
    # a block size other than a multiple of the page size: increasing ids keep the walked keys increasing
    plan(**block_sparse(block_size=7, block_indptr=[0, 3, 3, 6], block_indices=[0, 20, 42, 0, 2, 5]))
    assert decoder.work.work_end.tolist() == [21, 0, 21]  # 3 blocks of 7 in request 0 and 2
    plan(**block_sparse(block_size=1024, block_indptr=[0, 1, 2, 3], block_indices=[0, 0, 0, 9]))  # spare ids unread


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_request_lengths_up_to_int32_are_read(native):
    if native and native_library() is None:
        pytest.skip("no C compiler: plan() uses the numpy planner here")
    planner = HostPlanner(native_library() if native else None)
    read = planner.read(i32([0, 2**27]), i32([15]), 16)
    assert type(read).__name__ == ("NativeTables" if native else "NumpyTables")
    assert read.kv_lens.tolist() == [INT32_MAX]
    with pytest.raises(ValueError, match=r"^kv_len: expected at most 2147483647 tokens per request \(int32\), "
                                         r"got request 1 of 2147483648 tokens$"):
        planner.read(i32([0, 1, 2**27 + 1]), i32([1, 16]), 16)
    with pytest.raises(ValueError, match=r"^q_len: expected at most 2147483647 query tokens in all"):
        planner.read(i32([0, 1, 2]), i32([1, 1]), 16, q_len=2**30)


def test_host_tables_of_the_current_plan_survive_the_next_read():
    """The C planner's kv_lens live in scratch memory: a read keeping the current tables writes elsewhere."""
    if native_library() is None:
        pytest.skip("no C compiler: plan() uses the numpy planner here")
    planner = HostPlanner(native_library())
    current = planner.read(i32([0, 2, 3]), i32([5, 9]), 16)
    for pages, last in ((1, 3), (4, 1)):  # two reads, say a refused plan and the next
        later = planner.read(i32([0, pages]), i32([last]), 16, keep=current)
        assert later.kv_lens.tolist() == [(pages - 1) * 16 + last] and current.kv_lens.tolist() == [21, 9]


def test_sm_scale_and_float_checks_name_the_value():
    assert validation.positive_float32("sm_scale", 0.5) == 0.5
    with pytest.raises(ValueError, match=r"^s: expected a finite float > 0"):
        validation.positive_float32("s", float("nan"))
    assert validation.float32_param("f", -3) == -3.0 and validation.int32_param("i", np.int16(4)) == 4


# ---- an empty batch ---------------------------------------------------------------------------------------

def test_an_empty_batch_plans_and_runs_without_a_launch(planner, launches):
    """A step with no requests (a data-parallel rank without decodes): plan() accepts it and run()
    returns the empty output without launching a grid of no blocks."""
    decoder = cpu_decoder(planner, current_stream=lambda index: 0x77)
    decoder.plan(i32([0]), i32([]), i32([]), HEADS, KV_HEADS, DIM, PAGE)
    assert (decoder.batch_size, decoder.num_tokens, decoder.work.num_work) == (0, 0, 0)
    q = torch.empty(0, HEADS, DIM, dtype=torch.bfloat16)
    k, v = (torch.zeros(1, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16) for _ in range(2))
    out, lse = decoder.run(q, (k, v), return_lse=True)
    assert out.shape == (0, HEADS, DIM) and lse.shape == (0, HEADS) and launches == []
    given = torch.empty_like(q)
    assert decoder.run(q, (k, v), out=given) is given and launches == []
    with pytest.raises(ValueError, match=r"^q: expected shape \(0, 8, 128\), got shape \(1, 8, 128\)$"):
        decoder.run(torch.zeros(1, HEADS, DIM, dtype=torch.bfloat16), (k, v))
    indptr, indices, last = tables([300], PAGE, np.random.default_rng(0))  # and the next batch plans and launches
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)
    decoder.run(torch.zeros(1, HEADS, DIM, dtype=torch.bfloat16), (torch.zeros(30, PAGE, KV_HEADS, DIM,
                                                                               dtype=torch.bfloat16),) * 2)
    assert len(launches) == 1


def test_an_empty_cuda_graph_plan_still_launches_its_fixed_grid(planner, launches):
    """A captured run() replays after later plans: its launch must be captured even with no requests."""
    decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=4, max_num_pages=64,
                          current_stream=lambda index: 0x77)
    decoder.plan(i32([0]), i32([]), i32([]), HEADS, KV_HEADS, DIM, PAGE)
    q = torch.empty(0, HEADS, DIM, dtype=torch.bfloat16)
    decoder.run(q, (torch.zeros(1, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16),) * 2)
    plan = decoder.current_plan
    assert [grid for _, grid, _ in launches] == [plan.decode_launch.grid] and plan.decode_launch.grid[0] > 0
