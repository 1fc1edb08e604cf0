"""BatchDecode.plan() end to end on the CPU: the work list, the staging copy, the launch arguments, the errors.

`cpu_decoder` (tests/cpu_decoders.py) builds a BatchDecode on the CPU device with the
collaborators a GPU would provide injected: the arch, and a kernel loader that reports a fixed
occupancy (132 SMs x 2 CTAs, an H200's) instead of loading anything. NVRTC is faked: the kernels'
code does not matter here. Expected values come from planner_oracle, a plain reference of plan()'s
host path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
import torch

from flashjit import DecodeSpec
from flashjit.deploy import mask_check as cm
from flashjit.serving.batch_decode import BatchDecode
from flashjit.serving.buffers import Capacity, PageIdRange, PlanBuffers
from flashjit.serving.graph_mode import SPLIT_WAVES
from flashjit.serving.plan_setup import LOG2E, output_dtype
from flashjit.worklist.host import HostPlanner, item_records
from flashjit.kernels.worklist_kernel import LoadedKernel
from flashjit.masks.registry import masks, register_mask
from flashjit.kernels.decode import tiling as tiling_module
from flashjit.kernels.decode.tiling import decode_tiling

from built_ins import BUILT_IN_MASKS
from cpu_decoders import (CPU, CTAS_PER_SM, DECODE_FN, MERGE_FN, NUM_SMS, cpu_decoder, fake_loaded,
                          launch_of, native_library, tables)
from planner_oracle import reference_page_table, reference_plan_work


def expected_work(indptr, last, page_size, q_lens, mask, params, num_qo_heads, num_kv_heads, head_dim,
                  chunk_tokens=None, max_items=None):
    """The work plan of the oracle host path, and the kv_lens and indptr it packs beside it."""
    indptr_h, kv_lens = reference_page_table(indptr, last, page_size)
    q_lens = np.asarray(q_lens, dtype=np.int64)
    spec = DecodeSpec(head_dim, mask=mask, page_size=page_size, group_size=num_qo_heads // num_kv_heads,
                      max_q_len=max(1, int(q_lens.max(initial=1))), arch="sm_90")
    tiling, mask_def = decode_tiling(spec), masks.get(mask)
    begin, end = np.zeros_like(kv_lens), kv_lens
    if mask_def.kv_span is not None:
        begin, end = mask_def.kv_span(kv_lens, q_lens, params)
        end = np.minimum(end, np.iinfo(np.int32).max)
    work = reference_plan_work(begin, end, np.concatenate([[0], np.cumsum(q_lens)]),
                               ctas_per_item=num_kv_heads * tiling.row_tiles, max_ctas=NUM_SMS * CTAS_PER_SM,
                               granularity=tiling.tile_tokens, chunk_tokens=chunk_tokens, max_items=max_items)
    return work, kv_lens, indptr_h, tiling


WORK_FIELDS = ("work_request", "work_begin", "work_end", "req_work_indptr", "req_qo_indptr", "token_request")


def assert_planned(decoder, work, kv_lens, indptr_h, tiling, indices, num_qo_heads, num_kv_heads, sm_scale_log2):
    """decoder holds `work`, its GPU copy holds the packed work list, and the arguments point at it."""
    for field in WORK_FIELDS:
        assert np.array_equal(getattr(decoder.work, field), getattr(work, field)), field
    assert decoder.work.chunk_tokens == work.chunk_tokens
    plan = decoder.current_plan
    buffers = plan.buffers
    device, off = buffers.device_buffer.numpy(), buffers.offsets
    assert device[off["num_tokens"]] == work.num_tokens
    r, w = work.work_request, work.num_work
    records = item_records(device, buffers.starts)
    q_lens, splits = np.diff(work.req_qo_indptr), np.diff(work.req_work_indptr)
    if work.fixed_split:  # each item its own tile-sharing group
        index, span_begin, span_end, sharers = np.zeros(w), work.work_begin, work.work_end, np.ones(w)
    else:  # the request's items share its span
        index = [list(r[:i]).count(r[i]) for i in range(w)]  # among the request's items
        span_begin = [work.work_begin[r == r[i]].min() for i in range(w)]
        span_end = [work.work_end[r == r[i]].max() for i in range(w)]
        sharers = splits[r]
    expected = np.stack([r, work.work_begin, work.work_end, kv_lens[r], indptr_h[r], work.req_qo_indptr[r],
                         q_lens[r], splits[r], index, span_begin, span_end, sharers], axis=1)
    assert np.array_equal(records[:w], expected) and (records[w:, 0] == -1).all()  # the rest: padding
    packed = {"req_qo_indptr": work.req_qo_indptr, "req_work_indptr": work.req_work_indptr,
              "token_request": work.token_request}
    for name, values in packed.items():
        assert np.array_equal(device[off[name]:off[name] + len(values)], values), name

    a, m, p = plan.decode_args, plan.merge_args, buffers.pointers
    for name in ("work_items", "req_qo_indptr", "req_work_indptr"):
        assert getattr(a, name) == p[name], name
    assert (m.token_request, m.req_qo_indptr, m.req_work_indptr, m.num_tokens) == (
        p["token_request"], p["req_qo_indptr"], p["req_work_indptr"], p["num_tokens"])
    assert a.page_indices == (plan.page_ids if decoder.use_cuda_graph else indices).data_ptr()
    assert a.num_page_ids == indptr_h[-1]  # the page ids a shared-prefix kernel prefetches
    assert (a.tmp_o, a.tmp_lse) == (m.tmp_o, m.tmp_lse) == (buffers.tmp_o.data_ptr(), buffers.tmp_lse.data_ptr())
    assert a.merge_counters == buffers.merge_counters.data_ptr() and a.tile_counters == buffers.tile_counters.data_ptr()
    groups = buffers.capacity.batch * num_kv_heads * tiling.row_tiles  # (request, KV head, row tile)
    for counters in (buffers.merge_counters, buffers.tile_counters):
        assert counters.numel() >= groups and not counters.any()  # zero at rest
    assert a.num_qo_heads == m.num_qo_heads == num_qo_heads
    assert a.sm_scale_log2 == ctypes.c_float(sm_scale_log2).value
    graph = decoder.use_cuda_graph
    cap = buffers.capacity
    decode, merge = plan.decode_launch, plan.merge_launch
    assert decode.grid == tiling.grid(cap.work if graph else work.num_work, num_kv_heads)
    assert decode.function == DECODE_FN and decode.block == tiling.block and decode.smem == tiling.smem_bytes
    if tiling.fused_merge:
        assert merge is None  # the decode kernel merges split requests itself
    elif graph or work.num_work > len(kv_lens):
        assert merge.function == MERGE_FN and merge.grid == (cap.tokens if graph else work.num_tokens, num_qo_heads, 1)
    else:
        assert merge is None
    assert plan.max_page == (int(indices[: int(indptr_h[-1])].max()) if indptr_h[-1] else -1)


def test_plans_random_batches_as_the_old_host_path_did(planner):
    """Every built-in mask in turn, its parameters sampled for the batch (MaskDef.sample_params)."""
    rng = np.random.default_rng(11)
    decoder = cpu_decoder(planner)
    for step in range(40):
        batch = int(rng.integers(1, 70))
        kv_lens = (rng.integers(0, 9000, size=batch) * (rng.random(batch) > 0.1)).tolist()
        page_size = int(rng.choice([1, 16]))
        num_kv_heads, group = int(rng.choice([1, 8])), int(rng.choice([1, 4]))
        head_dim, q_len = int(rng.choice([64, 128])), int(rng.choice([1, 2]))
        mask = BUILT_IN_MASKS[step % len(BUILT_IN_MASKS)]
        params = cm.sample_params(masks.get(mask), random.Random(step), kv_lens, [q_len] * batch, page_size, CPU)
        chunk_tokens = None if rng.random() < 0.8 else int(rng.integers(16, 4000))
        indptr, indices, last = tables(kv_lens, page_size, rng)
        decoder.plan(indptr, indices, last, num_kv_heads * group, num_kv_heads, head_dim, page_size, q_len=q_len,
                     mask=mask, mask_params=params, chunk_tokens=chunk_tokens)
        expected = expected_work(indptr, last, page_size, [q_len] * batch, mask, params, num_kv_heads * group,
                                 num_kv_heads, head_dim, chunk_tokens)
        assert_planned(decoder, *expected, indices, num_kv_heads * group, num_kv_heads, LOG2E / math.sqrt(head_dim))


def test_plans_the_benchmark_batch(planner):
    """`benchmarks/decode.py compile`'s plan(): 64 requests of 128 + 6i tokens, 32/8 heads, head_dim 128."""
    kv_lens = [128 + 6 * i for i in range(64)]
    indptr, indices, last = tables(kv_lens, 16, np.random.default_rng(0))
    decoder = cpu_decoder(planner)
    for _ in range(3):  # the same spec and buffers again
        decoder.plan(indptr, indices, last, 32, 8, 128, 16)
        expected = expected_work(indptr, last, 16, [1] * 64, "none", {}, 32, 8, 128)
        assert_planned(decoder, *expected, indices, 32, 8, LOG2E / math.sqrt(128))
    assert decoder.work.num_work > 64  # split: the merge runs


def test_plans_a_separate_merge_launch_when_not_fused(planner, monkeypatch):
    monkeypatch.setattr(tiling_module, "TUNING", tiling_module.TUNING.replace(fused_merge=False))
    kv_lens = [128 + 6 * i for i in range(64)]
    indptr, indices, last = tables(kv_lens, 16, np.random.default_rng(0))
    decoder = cpu_decoder(planner)
    decoder.plan(indptr, indices, last, 32, 8, 128, 16)
    assert not decoder.kernel.tiling.fused_merge and decoder.current_plan.merge_launch is not None
    assert_planned(decoder, *expected_work(indptr, last, 16, [1] * 64, "none", {}, 32, 8, 128), indices, 32, 8,
                   LOG2E / math.sqrt(128))


def test_qo_indptr_and_sm_scale(planner):
    rng = np.random.default_rng(3)
    kv_lens, q_lens = [40, 5000, 0, 700], [1, 3, 2, 4]
    indptr, indices, last = tables(kv_lens, 16, rng)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    decoder = cpu_decoder(planner)
    decoder.plan(indptr, indices, last, 8, 2, 64, 16, qo_indptr=qo_indptr, mask="causal", sm_scale=0.25)
    expected = expected_work(indptr, last, 16, q_lens, "causal", {}, 8, 2, 64)
    assert_planned(decoder, *expected, indices, 8, 2, 0.25 * LOG2E)
    assert decoder.spec.max_q_len == 4 and decoder.num_tokens == sum(q_lens)


def test_cuda_graph_mode_reads_a_callers_page_id_buffer_in_place(planner):
    rng = np.random.default_rng(6)
    buffer = torch.full((64,), -7, dtype=torch.int32)
    decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=4, page_ids_buffer=buffer)
    assert decoder.graph_page_ids is buffer
    indptr, indices, last = tables([40, 3, 90], 16, rng)
    buffer[: len(indices)] = indices  # the caller writes its ids in place, then plans over the buffer
    decoder.plan(indptr, buffer, last, 8, 2, 64, 16)
    assert decoder.current_plan.page_ids is buffer
    assert decoder.current_plan.decode_args.page_indices == buffer.data_ptr()
    assert int(buffer[len(indices)]) == -7  # nothing copied over the rest
    decoder.plan(indptr, indices, last, 8, 2, 64, 16)  # other indices are copied into the caller's buffer
    assert torch.equal(buffer[: len(indices)], indices) and decoder.current_plan.page_ids is buffer


@pytest.mark.parametrize("options, message", [
    (dict(use_cuda_graph=False, page_ids_buffer=torch.zeros(8, dtype=torch.int32)), "page_ids_buffer"),
    (dict(use_cuda_graph=True, max_batch_size=2, page_ids_buffer=torch.zeros(8, dtype=torch.int64)), "page_ids_buffer"),
    (dict(use_cuda_graph=True, max_batch_size=2, page_ids_buffer=torch.zeros(8, dtype=torch.int32)[::2]),
     "page_ids_buffer"),
    (dict(use_cuda_graph=True, max_batch_size=2, max_num_pages=9, page_ids_buffer=torch.zeros(8, dtype=torch.int32)),
     "max_num_pages"),
])
def test_a_bad_page_id_buffer_is_refused_naming_it(planner, options, message):
    with pytest.raises(ValueError, match=message):
        cpu_decoder(planner, **options)


def test_cuda_graph_mode_plans_within_the_first_capacity(planner):
    rng = np.random.default_rng(5)
    decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=8, max_num_pages=4000)
    for kv_lens in ([100, 3000, 17], [5000, 1, 40, 900, 0, 20000, 16, 33], [1]):
        indptr, indices, last = tables(kv_lens, 16, rng)
        decoder.plan(indptr, indices, last, 32, 8, 128, 16, mask="sliding_window", window_left=700)
        cap = decoder.current_plan.capacity
        expected = expected_work(indptr, last, 16, [1] * len(kv_lens), "sliding_window", {"window_left": 700}, 32, 8,
                                 128, max_items=cap.work)
        assert_planned(decoder, *expected, indices, 32, 8, LOG2E / math.sqrt(128))
        page_ids = decoder.current_plan.page_ids  # the fixed buffer of max_num_pages ids
        assert page_ids.numel() == 4000 and torch.equal(page_ids[: len(indices)], indices)
    assert cap == decoder.current_plan.capacity and cap.batch == 8
    indptr, indices, last = tables([10], 16, rng)
    with pytest.raises(ValueError, match="the first plan's kernel"):
        decoder.plan(indptr, indices, last, 32, 8, 64, 16, mask="sliding_window", window_left=700)


def test_a_small_cuda_graph_batch_holds_a_wave_of_items_a_request_and_plans_as_eager_plans(planner):
    """No planned chunk cuts a request into more than one wave of items, so max_batch_size=2 holds
    two waves rather than 2 + SPLIT_WAVES of them (fewer padding CTAs a replay launches), and plans
    the chunks an eager plan does; a forced chunk keeps the SPLIT_WAVES room."""
    rng = np.random.default_rng(3)
    graph = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=2, max_num_pages=8000)
    eager = cpu_decoder(planner)
    split = False
    for kv_lens in ([60000, 100], [30000], [5, 7], [40000, 40000]):
        indptr, indices, last = tables(kv_lens, 16, rng)
        for decoder in (graph, eager):
            decoder.plan(indptr, indices, last, 32, 8, 128, 16)
        assert graph.work.chunk_tokens == eager.work.chunk_tokens and graph.work.num_work == eager.work.num_work
        split |= graph.work.max_splits > 1
    assert split  # a long request was cut into several items within the capacity
    tiling = graph.current_plan.setup.kernel.tiling
    wave = 132 * 2 // (8 * tiling.row_tiles)  # fake_loaded: 132 SMs, 2 CTAs each; 8 KV heads
    assert graph.current_plan.capacity.work == 2 * wave < 2 + SPLIT_WAVES * wave
    assert graph.current_plan.decode_launch.grid[0] * graph.current_plan.decode_launch.grid[1] == 2 * wave * 8
    forced = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=2, max_num_pages=8000)
    indptr, indices, last = tables([30000], 16, rng)
    forced.plan(indptr, indices, last, 32, 8, 128, 16, chunk_tokens=512)
    assert forced.current_plan.capacity.work == 2 + SPLIT_WAVES * wave >= forced.work.num_work == 59


PLAN_FN = 0xF0


def gpu_planned(kernel, device_index) -> LoadedKernel:
    """fake_loaded with a planner entry: CUDA-graph plans make their work list 'on the GPU'."""
    return dataclasses.replace(fake_loaded(kernel, device_index), plan=PLAN_FN)


@pytest.mark.parametrize("split", [{"chunk_tokens": 64}, {"fixed_split_tokens": 64}])
def test_a_forced_chunk_past_the_gpu_planners_capacity_is_refused_as_the_host_planners_is(planner, monkeypatch, split):
    """The GPU planner would fall back to one item per request where a forced chunk overflows the
    capacity; plan() refuses it first, counting items over the spans the mask reads (a narrower
    window makes the same chunk fit), and the plan before stays."""
    from flashjit.jit import launch as launcher

    launched = []
    monkeypatch.setattr(launcher, "_cu_launch", lambda *args: launched.append(launch_of(args)[0]) or 0)
    rng = np.random.default_rng(4)
    small = tables([300, 20], 16, rng)
    long = tables([30000, 30000], 16, rng)
    for name, load in (("gpu", gpu_planned), ("host", fake_loaded)):
        # A graph keeps its window: one decoder each for the wide window and the narrow one.
        wide, narrow = (cpu_decoder(planner, use_cuda_graph=True, max_batch_size=2, max_num_pages=4000,
                                    load_kernel=load, current_stream=lambda device_index: 0) for _ in range(2))
        wide.plan(*small, 32, 8, 128, 16, mask="sliding_window", window_left=40000)  # a planned chunk sizes the capacity
        before, capacity = wide.current_plan, wide.current_plan.capacity.work
        assert (wide.graph_page_table is not None) == (name == "gpu")
        with pytest.raises(ValueError, match=f"at most {capacity} work items .*938 items of 64 tokens"):
            wide.plan(*long, 32, 8, 128, 16, mask="sliding_window", window_left=40000, **split)
        assert wide.current_plan is before
        window = dict(mask="sliding_window", window_left=900)
        narrow.plan(*small, 32, 8, 128, 16, **window)
        assert narrow.current_plan.capacity.work == capacity
        narrow.plan(*long, 32, 8, 128, 16, **window, **split)  # 2 x 15 items of the 901-token windows
    assert PLAN_FN in launched


def test_a_batch_past_what_the_devices_shared_memory_holds_plans_on_the_host(planner, monkeypatch):
    """On a GPU of about 100 KB of shared memory a block the planner holds fewer requests
    (LoadedKernel.plan_max_batch): a larger max_batch_size plans on the host, a smaller one on the GPU."""
    from flashjit.jit import launch as launcher

    launched = []
    monkeypatch.setattr(launcher, "_cu_launch", lambda *args: launched.append(launch_of(args)[0]) or 0)

    def smaller_planner(kernel, device_index) -> LoadedKernel:
        return dataclasses.replace(gpu_planned(kernel, device_index), plan_max_batch=3)

    page_table = tables([300, 20, 4000], 16, np.random.default_rng(5))
    for max_batch_size, on_gpu in ((3, True), (4, False)):
        decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=max_batch_size, max_num_pages=400,
                              load_kernel=smaller_planner, current_stream=lambda device_index: 0)
        decoder.plan(*page_table, 32, 8, 128, 16)
        assert (decoder.graph_page_table is not None) == on_gpu
        assert (PLAN_FN in launched) == on_gpu
        launched.clear()
        if not on_gpu:
            with pytest.raises(RuntimeError, match="max_batch_size=4 is over the 3 requests the GPU planner's "
                                                   "shared memory holds on this device"):
                decoder.replan()


def test_replan_names_why_there_is_no_plan_on_the_gpu(planner):
    page_table = tables([300, 20, 4000], 16, np.random.default_rng(6))
    eager = cpu_decoder(planner)
    with pytest.raises(RuntimeError, match="replan.* there is no plan$"):
        eager.replan()
    eager.plan(*page_table, 32, 8, 128, 16)
    with pytest.raises(RuntimeError, match=r"no CUDA graph mode \(use_cuda_graph=True\)$"):
        eager.replan()
    graph = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=3, max_num_pages=400)  # no planner entry
    graph.plan(*page_table, 32, 8, 128, 16)
    with pytest.raises(RuntimeError, match=f"the module of {graph.spec.name} has no GPU planner$"):
        graph.replan()


# ---- the spec memo -----------------------------------------------------------------------------------------

def test_the_same_arguments_reuse_the_spec_and_others_change_it(planner):
    rng = np.random.default_rng(1)
    indptr, indices, last = tables([300, 20, 4000], 16, rng)
    decoder = cpu_decoder(planner)
    decoder.plan(indptr, indices, last, 32, 8, 128, 16)
    first = decoder.spec
    decoder.plan(indptr, indices, last, 32, 8, 128, 16)
    assert decoder.spec is first
    for changes, field, value in ((dict(head_dim=64), "head_dim", 64), (dict(q_dtype="fp16"), "dtype", "float16"),
                                  (dict(mask="causal"), "mask", "causal"), (dict(kv_layout="HND"), "kv_layout", "HND"),
                                  (dict(q_len=2), "max_q_len", 2), (dict(tensor_cores=False), "tensor_cores", False),
                                  (dict(num_kv_heads=4), "group_size", 8)):
        args = {**dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16), **changes}
        decoder.plan(indptr, indices, last, **args)
        assert getattr(decoder.spec, field) == value and decoder.spec != first
        assert decoder.kernel.spec == decoder.spec


def test_a_configuration_is_set_up_once_until_a_mask_is_registered(planner, monkeypatch, isolated_masks, mask_file,
                                                                    tmp_path):
    """plan() looks its spec and kernel up once per configuration; a mask registered since (which may
    replace the one planned) makes it look again."""
    looked_up = []
    get_kernel = planner.get_kernel
    monkeypatch.setattr(planner, "get_kernel", lambda spec: looked_up.append(spec.name) or get_kernel(spec))
    indptr, indices, last = tables([300, 20, 4000], 16, np.random.default_rng(13))
    decoder = cpu_decoder(planner)
    for _ in range(3):
        decoder.plan(indptr, indices, last, 32, 8, 128, 16, mask="causal")
    decoder.plan(indptr, indices, last, 32, 8, 128, 16, mask="causal", q_len=2)  # another kernel
    assert len(looked_up) == 2
    register_mask("causal", mask_file(tmp_path, "causal", "return true;"), replace=True)
    decoder.plan(indptr, indices, last, 32, 8, 128, 16, mask="causal")
    assert len(looked_up) == 3 and decoder.kernel.mask.template == str((tmp_path / "causal.cuh.j2").resolve())


@pytest.mark.parametrize("head_dim, message", [(128.0, r"head_dim.*128\.0"), ([128], r"head_dim.*\[128\]")])
def test_a_remembered_configuration_still_refuses_a_value_equal_to_its_own(planner, head_dim, message):
    """128.0 == 128, yet only the int is a head_dim: the memo of the valid plan must not answer for it."""
    indptr, indices, last = tables([300, 20], 16, np.random.default_rng(14))
    decoder = cpu_decoder(planner)
    decoder.plan(indptr, indices, last, 32, 8, 128, 16)
    with pytest.raises(ValueError, match=message):
        decoder.plan(indptr, indices, last, 32, 8, head_dim, 16)


def test_mask_tensors_given_anew_each_plan_are_pointed_at(planner):
    """Plans given mask_params (tensors a serving loop builds every step) set up each time: equal
    values in new tensors neither confuse the reuse of the launch arguments nor stay unpointed."""
    indptr, indices, last = tables([300, 200], 16, np.random.default_rng(15))
    decoder = cpu_decoder(planner)
    for _ in range(2):
        params = {"block_size": 16, "block_indptr": torch.tensor([0, 2, 3], dtype=torch.int32),
                  "block_indices": torch.tensor([0, 5, 1], dtype=torch.int32)}
        decoder.plan(indptr, indices, last, 8, 2, 128, 16, mask="block_sparse", mask_params=params)
        pointers = [ctypes.cast(decoder.current_plan.decode_launch.params[i], ctypes.POINTER(ctypes.c_void_p))[0]
                    for i in (2, 3)]  # after the Args struct and block_size
        assert pointers == [params["block_indptr"].data_ptr(), params["block_indices"].data_ptr()]


class _Copies:
    """A StreamCopies stand-in that records its waits."""

    def __init__(self, marked_stream):
        self.marked_stream, self.waits = marked_stream, 0

    def wait(self):
        self.waits += 1

    def copy(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("synced_stream, waits", [(None, 1), (7, 0), (8, 1)])
def test_the_staging_buffer_waits_unless_a_later_copy_on_its_stream_was_waited_for(synced_stream, waits):
    buffers = PlanBuffers(Capacity(2, 2, 4), 8, 128, 4, CPU)
    buffers.copies = _Copies(marked_stream=7)
    written = []
    buffers.write(type("Tables", (), {"write": lambda self, *args: written.append(args)})(), synced_stream)
    assert buffers.copies.waits == waits and len(written) == 1


# ---- the page-id range ---------------------------------------------------------------------------------------

def test_negative_page_id_names_the_smallest(planner):
    indptr, indices, last = tables([40, 90], 16, np.random.default_rng(1))
    with pytest.raises(ValueError, match=r"^indices: expected page ids >= 0, got -100$"):
        cpu_decoder(planner).plan(indptr, indices - 100, last, 8, 2, 128, 16)


def test_unchecked_page_ids_are_not_read_back(planner):
    """check_page_ids=False: no copy of the ids to the host (nothing to wait for), so a bad id goes
    unnoticed and run() cannot hold the cache's page count against the ids."""
    indptr, indices, last = tables([40, 90], 16, np.random.default_rng(1))
    reader = PageIdRange(CPU)
    decoder = cpu_decoder(planner, page_id_range=reader)
    decoder.plan(indptr, indices, last, 8, 2, 128, 16)
    assert decoder.current_plan.max_page == int(indices.max()) and reader.pending == len(indices)
    decoder.plan(indptr, indices - 100, last, 8, 2, 128, 16, check_page_ids=False)
    assert decoder.current_plan.max_page == -1 and reader.pending == 0
    with pytest.raises(ValueError, match=r"^check_page_ids: expected True or False, got 0$"):
        decoder.plan(indptr, indices, last, 8, 2, 128, 16, check_page_ids=0)


def test_negative_page_id_is_reported_before_later_argument_errors(planner):
    """As if the range were read before anything else: the page-id error, the later one as its context."""
    indptr, indices, last = tables([40, 90], 16, np.random.default_rng(1))
    with pytest.raises(ValueError, match="page ids >= 0") as info:
        cpu_decoder(planner).plan(indptr, indices - 100, last, 8, 2, 128, 16, mask_params={"window_left": 3})
    assert "mask_params" in str(info.value.__context__)
    with pytest.raises(ValueError, match="mask_params"):  # and that error alone with valid ids
        cpu_decoder(planner).plan(indptr, indices, last, 8, 2, 128, 16, mask_params={"window_left": 3})


def test_a_rejected_plan_leaves_the_previous_one_in_place(planner):
    rng = np.random.default_rng(2)
    decoder = cpu_decoder(planner)
    indptr, indices, last = tables([5000, 30, 700], 16, rng)
    decoder.plan(indptr, indices, last, 32, 8, 128, 16)
    work, args = decoder.work, bytes(decoder.current_plan.decode_args)
    device = decoder.current_plan.buffers.device_buffer.clone()
    other = tables([9000, 9000], 16, rng)
    with pytest.raises(ValueError, match="page ids >= 0"):
        decoder.plan(other[0], other[1] - 50, other[2], 32, 8, 128, 16)
    plan = decoder.current_plan
    assert decoder.work is work and bytes(plan.decode_args) == args
    assert torch.equal(plan.buffers.device_buffer, device) and plan.max_page == int(indices.max())


def test_a_plan_is_replaced_whole_and_never_changes(planner):
    """Each successful plan() makes a new Plan; a refused one keeps the current Plan object."""
    rng = np.random.default_rng(16)
    decoder = cpu_decoder(planner)
    assert decoder.current_plan is None and decoder.work is None
    indptr, indices, last = tables([300, 20], 16, rng)
    decoder.plan(indptr, indices, last, 8, 2, 128, 16)
    first = decoder.current_plan
    with pytest.raises(ValueError, match="chunk_tokens"):
        decoder.plan(indptr, indices, last, 8, 2, 128, 16, chunk_tokens=0)
    assert decoder.current_plan is first
    with pytest.raises(AttributeError):
        first.max_page = 0
    decoder.plan(indptr, indices, last, 8, 2, 128, 16)
    assert decoder.current_plan is not first and decoder.current_plan.setup is first.setup  # the setup memo
    assert (decoder.spec, decoder.batch_size, decoder.num_tokens) == (first.spec, 2, 2)


def test_a_cpu_device_needs_an_injected_arch(planner):
    """On the CPU (tests only) the arch cannot be asked of the device: without one it is refused."""
    with pytest.raises(ValueError, match=r"^device: expected a CUDA device, got cpu$"):
        BatchDecode(planner, CPU)
    with pytest.raises(AttributeError, match="no plan yet"):
        cpu_decoder(planner).spec


def test_no_pages_means_no_largest_page(planner):
    decoder = cpu_decoder(planner)
    decoder.plan(torch.tensor([0, 0, 0]), torch.zeros(0, dtype=torch.int32), torch.tensor([0, 0]), 8, 2, 128, 16)
    assert decoder.current_plan.max_page == -1 and decoder.work.num_work == 2


def test_many_page_ids_are_reduced_before_the_copy(planner, monkeypatch):
    monkeypatch.setattr(PageIdRange, "COPY_LIMIT", 16)
    rng = np.random.default_rng(4)
    indptr, indices, last = tables([300, 200], 8, rng)  # 38 + 25 page ids
    reader = PageIdRange(CPU)
    decoder = cpu_decoder(planner, page_id_range=reader)
    decoder.plan(indptr, indices, last, 8, 2, 128, 8)
    assert decoder.current_plan.max_page == int(indices.max()) and reader.host.numel() == 16
    bad = indices.clone()
    bad[20] = -7
    with pytest.raises(ValueError, match=r"got -7$"):
        decoder.plan(indptr, bad, last, 8, 2, 128, 8)


def test_strided_page_ids_are_refused(planner):
    """The kernel reads the page ids as one run: a view with gaps between them would be misread."""
    rng = np.random.default_rng(6)
    indptr, indices, last = tables([300, 200], 16, rng)
    strided = torch.stack([indices, torch.full_like(indices, -1)], dim=1).reshape(-1)[::2]
    with pytest.raises(ValueError, match=r"^indices: expected a contiguous tensor \(stride 1\), got stride 2$"):
        cpu_decoder(planner).plan(indptr, strided, last, 8, 2, 128, 16)


@pytest.mark.parametrize("late_error", ["mask tensor", "graph page ids"])
def test_late_errors_leave_the_previous_plan_in_place(planner, late_error):
    """Errors found late in plan() (a mask tensor, the CUDA-graph page-id capacity) are found before
    anything of the previous plan is overwritten."""
    rng = np.random.default_rng(7)
    graph = late_error == "graph page ids"
    decoder = cpu_decoder(planner, use_cuda_graph=graph, max_batch_size=4, max_num_pages=40)
    indptr, indices, last = tables([300, 200], 16, rng)
    mask = "block_sparse"
    params = {"block_size": 16, "block_indptr": torch.tensor([0, 1, 2], dtype=torch.int32),
              "block_indices": torch.tensor([0, 0], dtype=torch.int32)}
    decoder.plan(indptr, indices, last, 8, 2, 128, 16, mask=mask, mask_params=params)
    work, args = decoder.work, bytes(decoder.current_plan.decode_args)
    device = decoder.current_plan.buffers.device_buffer.clone()
    if graph:
        big = tables([400, 400], 16, rng)  # 50 page ids > max_num_pages
        with pytest.raises(ValueError, match=r"^indices: expected at most max_num_pages=40 page ids, got 50$"):
            decoder.plan(*big, 8, 2, 128, 16, mask=mask, mask_params=params)
    else:
        other = tables([5000, 17], 16, rng)  # a different work list, so an overwrite would show
        bad = dict(params, block_indices=params["block_indices"].long())
        with pytest.raises(ValueError, match=r"^mask param block_indices: expected dtype torch.int32"):
            decoder.plan(*other, 8, 2, 128, 16, mask=mask, mask_params=bad)
    assert decoder.work is work and bytes(decoder.current_plan.decode_args) == args
    assert torch.equal(decoder.current_plan.buffers.device_buffer, device)


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_page_id_range_reads_only_the_used_prefix(native):
    reader = PageIdRange(CPU)
    planner = HostPlanner(native_library() if native else None)
    ids = torch.tensor([4, 9, 2, -1, 50], dtype=torch.int32)
    reader.start(ids, 3)
    assert reader.wait() == 3 and reader.host[:3].tolist() == [4, 9, 2]
    assert planner.id_range(reader.host, 3) == (2, 9)
    reader.start(ids, 5)
    assert planner.id_range(reader.host, reader.wait()) == (-1, 50)
    reader.start(ids, 0)
    assert reader.wait() == 0


# ---- the staging copy ----------------------------------------------------------------------------------------

# The records of test_plan_buffers_pack_every_field_at_its_offset's plan after the first 8 ints of each
# (request, v_begin, v_end, kv_len, page_begin, q_begin, q_len, items of the request): the tile-sharing
# group (index in it, its span, its items), the request's items (planned split) or the item alone (fixed).
SHARING_GROUPS = {False: [(0, 0, 300, 3), (1, 0, 300, 3), (2, 0, 300, 3), (0, 0, 5, 1), (0, 0, 129, 2), (1, 0, 129, 2)],
                  True: [(0, 0, 128, 1), (0, 128, 256, 1), (0, 256, 300, 1), (0, 0, 5, 1), (0, 0, 128, 1),
                         (0, 128, 129, 1)]}


@pytest.mark.parametrize("fixed_split", [False, True], ids=["planned", "fixed"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_plan_buffers_pack_every_field_at_its_offset(native, fixed_split):
    if native and native_library() is None:
        pytest.skip("no C compiler: plan() uses the numpy planner here")

    buffers = PlanBuffers(Capacity(batch=4, tokens=6, work=9), partial_rows=10, head_dim=64, merge_groups=8,
                          device=CPU)
    offsets = list(buffers.offsets.values())
    assert offsets == [0, 108, 109, 114, 119]  # fields in FIELDS order, each at its capacity (12 ints per item)
    assert buffers.device_buffer.numel() == 119 + 6 and buffers.tmp_o.numel() == 640 and buffers.tmp_lse.numel() == 10
    planner = HostPlanner(native_library() if native else None)
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    tables = planner.read(i32([0, 19, 20, 29]), i32([12, 5, 1]), 16, i32([0, 2, 3, 5]))  # 300, 5, 129 tokens
    assert type(tables).__name__ == ("NativeTables" if native else "NumpyTables")
    tables.plan(None, None, ctas_per_item=4, max_ctas=8, granularity=16, chunk_tokens=128, fixed_split=fixed_split)
    buffers.write(tables)
    items = [(0, 0, 128, 300, 0, 0, 2, 3), (0, 128, 256, 300, 0, 0, 2, 3), (0, 256, 300, 300, 0, 0, 2, 3),
             (1, 0, 5, 5, 19, 2, 1, 1), (2, 0, 128, 129, 20, 3, 2, 2), (2, 128, 129, 129, 20, 3, 2, 2)]
    records = [value for item, group in zip(items, SHARING_GROUPS[fixed_split]) for value in item + group]
    assert buffers.device_buffer.tolist() == records + [
        -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # padding past the plan's 6 items
        -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        5,                               # num_tokens
        0, 2, 3, 5, 0,                   # req_qo_indptr
        0, 3, 4, 6, 0,                   # req_work_indptr
        0, 0, 1, 2, 2, 0]                # token_request
    base = buffers.device_buffer.data_ptr()
    assert buffers.pointers == {name: base + 4 * off for name, off in buffers.offsets.items()}
    assert buffers.fits(Capacity(4, 6, 9), 640, 8) and not buffers.fits(Capacity(5, 6, 9), 640, 8)
    assert not buffers.fits(Capacity(4, 6, 9), 640, 9)  # more merge counters (KV heads x row tiles) than it has
    assert buffers.merge_counters.tolist() == [0] * 8


def test_prepared_launch_passes_its_config_and_the_current_stream(monkeypatch):
    from flashjit.jit import launch as launcher

    calls = []
    monkeypatch.setattr(launcher, "_cu_launch", lambda *args: calls.append((launch_of(args), args)) or 0)
    params = (ctypes.c_void_p * 1)()
    launch = launcher.PreparedLaunch(0xD0, (7, 8, 1), (128, 1, 1), params, 4096)
    launch(0x5)
    launch(0x5)
    launch(0x9)
    assert [c[0] for c in calls] == [(0xD0, (7, 8, 1), (128, 1, 1), 4096, stream, False) for stream in (5, 5, 9)]
    assert all(args[2] is params and args[3] is None for _, args in calls)
    monkeypatch.setattr(launcher, "_cu_launch", lambda *args: 1)
    monkeypatch.setattr(launcher, "check", lambda status, what: (_ for _ in ()).throw(RuntimeError(f"{what} {status}")))
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx 1"):
        launch(0x9)


def test_launch_structs_have_the_driver_layout():
    """CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out on 64-bit hosts."""
    from flashjit.jit.launch import LaunchAttribute, LaunchConfig

    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.shared_mem_bytes.offset, LaunchConfig.stream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


def test_prepared_launch_passes_ctypes_objects_of_the_parameter_types(monkeypatch):
    """cuLaunchKernelEx is called without argtypes, so ctypes passes each argument as it comes: a Python
    int would go as a 32-bit C int. Every argument must be a ctypes object of the parameter's type."""
    from flashjit.jit import launch as launcher

    calls = []
    monkeypatch.setattr(launcher, "_cu_launch", lambda *args: calls.append(args) or 0)
    params = (ctypes.c_void_p * 1)()
    launch = launcher.PreparedLaunch.update(None, 0xD0, (7, 8, 1), (128, 1, 1), params, 4096)
    launch(0x5)
    launcher.PreparedLaunch.update(launch, 0xD0, (9, 8, 2), (128, 1, 1), params, 4096)(0x9)  # re-aimed grid, new stream
    for args in calls:
        assert isinstance(args[0]._obj, launcher.LaunchConfig) and type(args[1]) is ctypes.c_void_p
        assert args[2] is params and args[3] is None
    assert launch_of(calls[-1])[:5] == (0xD0, (9, 8, 2), (128, 1, 1), 4096, 9)


@pytest.mark.parametrize("arch, programmatic", [("sm_80", False), ("sm_86", False), ("sm_89", False), ("sm_90", True),
                                                ("sm_90a", True), ("sm_100", True), ("sm_120", True)])
def test_launches_are_programmatic_from_sm_90(monkeypatch, arch, programmatic):
    """From sm_90 every entry point waits for the previous kernel (griddepcontrol), so its launch lets
    it start while that kernel finishes; below, the launch keeps the stream's plain ordering."""
    from flashjit.jit import launch as launcher
    from flashjit.jit.arch import waits_for_previous_kernel

    calls = []
    monkeypatch.setattr(launcher, "_cu_launch", lambda *args: calls.append(launch_of(args)) or 0)
    assert waits_for_previous_kernel(arch) is programmatic
    params = (ctypes.c_void_p * 1)()
    launch = launcher.PreparedLaunch.update(None, 0xD0, (7, 8, 1), (128, 1, 1), params, 0, programmatic)
    launch(0x5)
    assert calls[-1][5] is programmatic
    other = launcher.PreparedLaunch.update(launch, 0xD0, (7, 8, 1), (128, 1, 1), params, 0, not programmatic)
    assert other is not launch and other.programmatic is not programmatic


def test_prepared_launch_is_kept_for_the_same_kernel_and_arguments(monkeypatch):
    """A new plan re-aims the launch at its grid; another function, block, smem or params array gets a new one."""
    from flashjit.jit import launch as launcher

    calls = []
    monkeypatch.setattr(launcher, "_cu_launch", lambda *args: calls.append(launch_of(args)) or 0)
    params = (ctypes.c_void_p * 1)()
    launch = launcher.PreparedLaunch.update(None, 0xD0, (7, 8, 1), (128, 1, 1), params, 4096)
    again = launcher.PreparedLaunch.update(launch, 0xD0, (9, 8, 2), (128, 1, 1), params, 4096)
    assert again is launch and launch.grid == (9, 8, 2)
    launch(0x5)
    assert calls[-1] == (0xD0, (9, 8, 2), (128, 1, 1), 4096, 5, False)
    others = ((0xD1, (9, 8, 2), (128, 1, 1), params, 4096), (0xD0, (9, 8, 2), (64, 1, 1), params, 4096),
              (0xD0, (9, 8, 2), (128, 1, 1), params, 0), (0xD0, (9, 8, 2), (128, 1, 1), (ctypes.c_void_p * 1)(), 4096))
    for other in others:
        fresh = launcher.PreparedLaunch.update(launch, *other)
        assert fresh is not launch and (fresh.function, fresh.grid, fresh.block, fresh.params, fresh.smem) == other
    assert launch.grid == (9, 8, 2)


def test_plans_keep_their_launches_and_mask_values_in_place(planner, monkeypatch):
    monkeypatch.setattr(tiling_module, "TUNING", tiling_module.TUNING.replace(fused_merge=False))  # the merge's launch is kept too
    rng = np.random.default_rng(12)
    decoder = cpu_decoder(planner)
    indptr, indices, last = tables([9000, 7000, 40, 8000], 16, rng)
    decoder.plan(indptr, indices, last, 8, 2, 128, 16, mask="sliding_window", window_left=4000)
    first = decoder.current_plan
    decode, merge, params = first.decode_launch, first.merge_launch, first.decode_launch.params
    indptr, indices, last = tables([300, 5000, 40], 16, rng)  # within the first plan's buffers
    decoder.plan(indptr, indices, last, 8, 2, 128, 16, mask="sliding_window", window_left=2000)
    plan = decoder.current_plan
    assert plan.decode_launch is decode and plan.merge_prepared is merge and decode.params is params
    assert ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int))[0] == 2000  # window_left, written in place
    assert decode.grid == decoder.kernel.tiling.grid(decoder.work.num_work, 2) and merge.grid[0] == decoder.num_tokens


def test_cuda_graph_plans_vary_query_tokens_up_to_max_q_len(planner):
    """One kernel for every replay: plans with fewer query tokens per request use the max_q_len kernel."""
    rng = np.random.default_rng(8)
    indptr, indices, last = tables([300, 200, 40], 16, rng)
    decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=4, max_num_pages=64, max_q_len=4)
    specs = []
    for q_len in (1, 4, 2):
        decoder.plan(indptr, indices, last, 8, 2, 128, 16, q_len=q_len)
        specs.append(decoder.spec)
        assert decoder.num_tokens == 3 * q_len
    assert specs[0] == specs[1] == specs[2] and specs[0].max_q_len == 4
    assert decoder.current_plan.capacity.tokens == 16  # max_batch_size x max_q_len
    with pytest.raises(ValueError, match=r"at most max_q_len=4 query tokens per request .*got 5$"):
        decoder.plan(indptr, indices, last, 8, 2, 128, 16, q_len=5)
    assert decoder.spec == specs[0] and decoder.num_tokens == 6  # the q_len=2 plan is still in place


def test_without_max_q_len_the_first_cuda_graph_plan_fixes_it(planner):
    rng = np.random.default_rng(9)
    indptr, indices, last = tables([300, 200], 16, rng)
    decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=4, max_num_pages=64)
    decoder.plan(indptr, indices, last, 8, 2, 128, 16, q_len=3)
    decoder.plan(indptr, indices, last, 8, 2, 128, 16, q_len=1)
    assert decoder.spec.max_q_len == 3 and decoder.num_tokens == 2
    with pytest.raises(ValueError, match="at most max_q_len=3"):
        decoder.plan(indptr, indices, last, 8, 2, 128, 16, q_len=4)
    other = cpu_decoder(planner)  # without graphs the kernel follows the batch
    other.plan(indptr, indices, last, 8, 2, 128, 16, q_len=3)
    other.plan(indptr, indices, last, 8, 2, 128, 16, q_len=1)
    assert other.spec.max_q_len == 1


@pytest.mark.parametrize("heads_first", [True, False])
def test_decode_grid_names_every_item_head_and_row_tile_once(heads_first):
    """The grid of tiling.grid, read back as CtaCoords (worklist/kernel_core.cuh) reads blockIdx."""
    spec = DecodeSpec(128, group_size=8, max_q_len=3, arch="sm_90")
    tiling = dataclasses.replace(decode_tiling(spec), heads_first=heads_first)
    items, heads = 5, 3
    grid = tiling.grid(items, heads)
    seen = []
    for x, y, z in itertools.product(*map(range, grid)):
        seen.append((x // heads, x % heads, y) if heads_first else (x, y, z))
    assert sorted(seen) == list(itertools.product(range(items), range(heads), range(tiling.row_tiles)))
    assert tiling.row_tiles == 2


def test_on_tensor_cores_sets_the_scalar_make_setup_reads(monkeypatch):
    from flashjit.serving import plan_setup

    seen = {}

    class Stop(Exception):
        pass

    def cached(*args):
        seen["tensor_cores"] = args[9]  # DecodeSpec.cached(..., arch, tensor_cores, variant, shared_prefix)
        raise Stop

    monkeypatch.setattr(plan_setup.DecodeSpec, "cached", staticmethod(cached))
    scalars = plan_setup.PlanScalars(32, 8, 128, 16, "causal", None, "bfloat16", None, "NHD", None, False, "none")
    for given, expected in ((scalars, False), (scalars.on_tensor_cores(), True)):
        with pytest.raises(Stop):
            plan_setup.make_setup(given, None, 1, engine=None, arch="sm_90", device=None, load_kernel=None)
        assert seen["tensor_cores"] is expected
    assert scalars.on_tensor_cores()._replace(tensor_cores=False) == scalars
    assert scalars.types()[0] is int and scalars._replace(head_dim=128.0).types()[2] is float  # the memo tells them apart


@pytest.mark.parametrize("q_dtype, out_dtype, expected", [
    ("bf16", None, ("bfloat16", False)), ("float16", "fp16", ("float16", False)),
    (torch.float8_e4m3fn, torch.bfloat16, ("bfloat16", True)), ("e4m3", "float16", ("float16", True)),
])
def test_the_output_dtype_is_the_queries_or_given_for_e4m3_queries(q_dtype, out_dtype, expected):
    assert output_dtype(q_dtype, out_dtype) == expected


@pytest.mark.parametrize("q_dtype, out_dtype, message", [
    ("e4m3", None, "out_dtype: expected float16 or bfloat16 with e4m3 queries, got None"),
    ("bf16", "float16", r"out_dtype: expected None or q_dtype \(bfloat16\) with 16-bit queries, got float16"),
    ("e5m2", "bf16", "q_dtype"), ("e4m3", "e4m3", "out_dtype"),
])
def test_bad_query_and_output_dtypes_are_named(q_dtype, out_dtype, message):
    with pytest.raises(ValueError, match=message):
        output_dtype(q_dtype, out_dtype)
