"""flashjit.compat.flashinfer on the CPU: FlashInfer's arguments mapped onto BatchDecode, the
conventions converted (base-2 LSE, pages to tokens, window_left=-1, q_scale), the CUDA-graph
wrappers' in-place page ids, and the refusals naming what flashjit lacks.

The wrappers' BatchDecode is tests/cpu_decoders.py's CPU decoder (an injected arch, kernels 'loaded'
without a GPU); run()'s launches are recorded instead of made, so a given lse buffer keeps the
values the test wrote and shows the conversion run() applies to it.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from flashjit.compat import flashinfer
from flashjit.compat.flashinfer import arguments, decode
from flashjit.serving.plan_setup import LOG2E

from cpu_decoders import cpu_decoder, tables

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 16
KV_LENS = [40, 5000, 700]
WORKSPACE = torch.zeros(16, dtype=torch.uint8)  # FlashInfer's float workspace: accepted, unused


@pytest.fixture
def cpu_wrappers(planner, monkeypatch):
    """The wrappers build CPU decoders over the test engine."""
    monkeypatch.setattr(decode, "_decoder", lambda device, **options: cpu_decoder(planner, current_stream=lambda index: 0x77, **options))
    return planner


def batch(kv_lens=KV_LENS, seed=0):
    return tables(kv_lens, PAGE, np.random.default_rng(seed))


def planned(kv_layout="NHD", kv_lens=KV_LENS, **plan_options):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, kv_layout)
    indptr, indices, last = batch(kv_lens)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **plan_options)
    return wrapper, indices


def cache(indices, kv_layout="NHD", dtype=torch.float16, page_size=PAGE):
    pages = int(indices.max()) + 1
    shape = (pages, page_size, KV_HEADS, DIM) if kv_layout == "NHD" else (pages, KV_HEADS, page_size, DIM)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def query(rows=len(KV_LENS), dtype=torch.float16):
    return torch.randn(rows, HEADS, DIM).to(dtype)


# ---- plan: the arguments as BatchDecode's -----------------------------------------------------------

def test_the_defaults_plan_fp16_without_a_mask(cpu_wrappers):
    wrapper, _ = planned()
    spec = wrapper.flashjit_decoder.spec
    assert (spec.dtype, spec.kv_dtype, spec.mask, spec.kv_layout) == ("float16", "float16", "none", "NHD")
    assert wrapper.flashjit_decoder.current_plan.setup.sm_scale_log2 == pytest.approx(LOG2E / math.sqrt(DIM))
    assert not wrapper.is_cuda_graph_enabled and not wrapper.use_tensor_cores


@pytest.mark.parametrize("given, expected", [
    (dict(data_type=torch.bfloat16, q_data_type=None), ("bfloat16", "bfloat16")),
    (dict(data_type=torch.float8_e4m3fn, q_data_type=torch.bfloat16), ("bfloat16", "float8_e4m3fn")),
    (dict(q_data_type="bfloat16", kv_data_type="float8_e5m2"), ("bfloat16", "float8_e5m2")),
    (dict(q_data_type=torch.bfloat16, o_data_type=torch.bfloat16), ("bfloat16", "bfloat16")),
])
def test_dtypes_resolve_as_flashinfer_resolves_them(cpu_wrappers, given, expected):
    wrapper, _ = planned(**given)
    assert (wrapper.flashjit_decoder.spec.dtype, wrapper.flashjit_decoder.spec.kv_dtype) == expected


def test_data_type_fills_only_the_dtypes_left_none():
    # plan()'s q_data_type defaults to "float16", so data_type alone sets the cache's dtype only
    assert arguments.plan_dtypes("float16", None, torch.bfloat16) == (torch.float16, torch.bfloat16, torch.float16)
    assert arguments.plan_dtypes(None, None, "bfloat16") == (torch.bfloat16, torch.bfloat16, torch.bfloat16)


def test_e4m3_queries_plan_the_fp8_query_kernel_with_a_16_bit_output(cpu_wrappers):
    """As vLLM hands queries over for an e4m3 cache: o_data_type names the output, and a
    fast_decode_plan after it keeps that output dtype, as FlashInfer's run() does."""
    wrapper, indices = planned(q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn,
                               o_data_type=torch.bfloat16)
    spec = wrapper.flashjit_decoder.spec
    assert (spec.q_dtype, spec.dtype, spec.kv_dtype) == ("float8_e4m3fn", "bfloat16", "float8_e4m3fn")
    assert wrapper.flashjit_decoder.query_form() == (torch.float8_e4m3fn, HEADS, DIM, torch.bfloat16)
    indptr, _, last = batch()
    flashinfer.fast_decode_plan(wrapper, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE,
                                q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)
    assert wrapper.flashjit_decoder.query_form()[3] == torch.bfloat16
    with pytest.raises(NotImplementedError, match="o_data_type=None"):
        fresh = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
        flashinfer.fast_decode_plan(fresh, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE,
                                    q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn)


@pytest.mark.parametrize("window_left, mask, params", [(-1, "none", {}), (0, "sliding_window", {"window_left": 0}),
                                                        (1023, "sliding_window", {"window_left": 1023})])
def test_window_left_minus_one_is_no_window(cpu_wrappers, window_left, mask, params):
    wrapper, _ = planned(window_left=window_left)
    assert wrapper.flashjit_decoder.spec.mask == mask
    assert wrapper.flashjit_decoder.current_plan.setup.params == params


def test_sm_scale_is_planned(cpu_wrappers):
    wrapper, _ = planned(sm_scale=0.125)
    assert wrapper.flashjit_decoder.current_plan.setup.sm_scale_log2 == pytest.approx(0.125 * LOG2E)


def direct_work(planner, **plan_options):
    decoder = cpu_decoder(planner)
    indptr, indices, last = batch()
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_dtype="float16", **plan_options)
    return decoder.work


@pytest.mark.parametrize("split, direct", [
    (dict(fixed_split_size=8), dict(chunk_tokens=8 * PAGE)),  # FlashInfer counts pages, flashjit tokens
    (dict(fixed_split_size=-1), {}),                          # vLLM's "no fixed split"
    (dict(fixed_split_size=0), {}),
    (dict(disable_split_kv=True), dict(disable_split_kv=True)),
    (dict(disable_split_kv=True, fixed_split_size=8), dict(disable_split_kv=True)),  # disabling wins, as in FlashInfer
])
def test_split_arguments_map_to_chunk_tokens(cpu_wrappers, split, direct):
    wrapper, _ = planned(**split)
    work, expected = wrapper.flashjit_decoder.work, direct_work(cpu_wrappers, **direct)
    assert work.chunk_tokens == expected.chunk_tokens
    assert np.array_equal(work.req_work_indptr, expected.req_work_indptr)
    if split.get("disable_split_kv"):
        assert work.num_work == len(KV_LENS)  # one work item per request
    if "chunk_tokens" in direct:
        assert work.num_work > len(KV_LENS)  # the 5000-token request is split


def test_page_ids_not_on_the_device_or_not_int32_are_moved_there(cpu_wrappers):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    indptr, indices, last = batch()
    wrapper.plan(indptr, indices.long(), last, HEADS, KV_HEADS, DIM, PAGE)
    page_ids = wrapper.flashjit_decoder.current_plan.page_ids
    assert page_ids.dtype == torch.int32 and torch.equal(page_ids, indices)


def test_a_request_without_pages_attends_to_nothing(cpu_wrappers):
    # vLLM pads a CUDA-graph batch with requests of no pages and last_page_len 1
    indptr, indices, _ = batch([40, 0, 90])
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    wrapper.plan(indptr, indices, torch.tensor([8, 1, 10], dtype=torch.int32), HEADS, KV_HEADS, DIM, PAGE)
    assert list(wrapper.flashjit_decoder.current_plan.tables.kv_lens) == [40, 0, 90]


# ---- plan: refusals ------------------------------------------------------------------------------

NOT_IMPLEMENTED = [
    (dict(pos_encoding_mode="ROPE_LLAMA"), "pos_encoding_mode='ROPE_LLAMA'"),
    (dict(pos_encoding_mode="ALIBI"), "pos_encoding_mode='ALIBI'"),
    (dict(rope_scale=8.0), "rope_scale=8.0"),
    (dict(rope_theta=5e5), "rope_theta=500000.0"),
    (dict(q_data_type=torch.float8_e4m3fn), "o_data_type=None"),
    (dict(q_data_type=torch.float8_e4m3fn, o_data_type=torch.float8_e4m3fn), "o_data_type=torch.float8_e4m3fn"),
    (dict(q_data_type=torch.float8_e4m3fn, kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16),
     "q_data_type=torch.float8_e4m3fn"),
    (dict(q_data_type=torch.float8_e5m2, o_data_type=torch.bfloat16), "q_data_type=torch.float8_e5m2"),
    (dict(o_data_type=torch.bfloat16), "o_data_type=torch.bfloat16"),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), "block_tables="),
    (dict(seq_lens=torch.tensor(KV_LENS, dtype=torch.int32)), "seq_lens="),
]
BAD_VALUES = [
    (dict(pos_encoding_mode="ROPE"), "pos_encoding_mode"),
    (dict(window_left=-2), "window_left"),
    (dict(window_left=True), "window_left"),
    (dict(fixed_split_size=2.5), "fixed_split_size"),
    (dict(disable_split_kv=1), "disable_split_kv"),
    (dict(q_data_type="float17"), "q_data_type"),
    (dict(kv_data_type=3), "kv_data_type"),
    (dict(logits_soft_cap="big"), "logits_soft_cap"),
]


@pytest.mark.parametrize("options, message, error", [case + (NotImplementedError,) for case in NOT_IMPLEMENTED]
                         + [case + (ValueError,) for case in BAD_VALUES])
def test_refused_plans_name_the_argument_and_leave_the_plan_in_place(cpu_wrappers, options, message, error):
    wrapper, _ = planned()
    before = wrapper.flashjit_decoder.current_plan
    indptr, indices, last = batch([30, 60, 90], seed=1)
    with pytest.raises(error, match=message):
        wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **options)
    assert wrapper.flashjit_decoder.current_plan is before


def test_off_values_of_flashinfer_features_are_accepted(cpu_wrappers):
    wrapper, _ = planned(pos_encoding_mode="NONE", logits_soft_cap=0.0, non_blocking=False)
    assert wrapper.flashjit_decoder.spec.mask == "none"


@pytest.mark.parametrize("options, error, message", [
    (dict(kv_layout="NDH"), NotImplementedError, "kv_layout='NDH'"),
    (dict(backend="trtllm-gen"), NotImplementedError, "backend='trtllm-gen'"),
    (dict(backend="cudnn"), ValueError, "backend"),
    (dict(jit_args=["module", "source"]), NotImplementedError, "jit_args"),
])
def test_wrapper_options_flashjit_lacks_are_refused(cpu_wrappers, options, error, message):
    with pytest.raises(error, match=message):
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, **options)


@pytest.mark.parametrize("backend", ["auto", "fa2", "fa3"])
def test_flashinfer_backends_are_served_by_flashjit(cpu_wrappers, backend):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "HND", use_tensor_cores=True, backend=backend)
    assert wrapper.use_tensor_cores


# ---- run -----------------------------------------------------------------------------------------

def test_run_returns_the_base_2_lse_in_the_given_buffer(cpu_wrappers, launches):
    wrapper, indices = planned()
    natural = torch.tensor([[0.0, 1.0, -2.0, math.log(7.0)] * 2] * len(KV_LENS))
    lse, out = natural.clone(), torch.empty(len(KV_LENS), HEADS, DIM, dtype=torch.float16)
    result = wrapper.run(query(), cache(indices), out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse  # the launch is recorded, not made: lse holds what was there
    assert torch.allclose(lse, natural * LOG2E) and lse[0, 3].item() == pytest.approx(math.log2(7.0))
    assert len(launches) == 1


def test_a_given_lse_is_written_without_return_lse_too(cpu_wrappers, launches):
    wrapper, indices = planned()
    lse = torch.ones(len(KV_LENS), HEADS)
    out = wrapper.run(query(), cache(indices), lse=lse)
    assert torch.is_tensor(out) and out.shape == (len(KV_LENS), HEADS, DIM)
    assert torch.allclose(lse, torch.full_like(lse, LOG2E))


def test_run_return_lse_and_allocated_outputs(cpu_wrappers, launches):
    wrapper, indices = planned()
    out, lse = wrapper.run_return_lse(query(), cache(indices))
    assert out.dtype == torch.float16 and lse.shape == (len(KV_LENS), HEADS) and lse.dtype == torch.float32
    assert torch.is_tensor(wrapper.run(query(), cache(indices)))


@pytest.mark.parametrize("scales, expected", [
    ({}, (1.0, 1.0)),
    (dict(k_scale=0.5, v_scale=4.0), (0.5, 4.0)),
    (dict(q_scale=2.0, k_scale=0.25, v_scale=3.0), (0.5, 3.0)),  # q_scale joins k_scale in the softmax scale
    (dict(q_scale=2.0), (2.0, 1.0)),
])
def test_scales_fold_as_flashinfer_applies_them(cpu_wrappers, launches, scales, expected):
    wrapper, indices = planned(kv_data_type=torch.float8_e4m3fn)
    wrapper.run(query(), cache(indices, dtype=torch.float8_e4m3fn), **scales)
    a = wrapper.flashjit_decoder.current_plan.decode_args
    assert (a.k_scale, a.v_scale) == pytest.approx(expected)


def test_tensor_scales_are_read_by_the_kernel(cpu_wrappers, launches, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # no value check on the CPU
    wrapper, indices = planned(kv_data_type=torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.25, 0.75])
    fp8 = cache(indices, dtype=torch.float8_e4m3fn)
    wrapper.run(query(), fp8, k_scale=k_scale, v_scale=v_scale)
    a = wrapper.flashjit_decoder.current_plan.decode_args
    assert (a.k_scale_ptr, a.v_scale_ptr, a.v_scale_stride) == (k_scale.data_ptr(), v_scale.data_ptr(), 1)
    wrapper.run(query(), fp8, q_scale=4.0, k_scale=k_scale, v_scale=v_scale)
    # the kernel reads k_scale x q_scale, a tensor of its own (the wrapper keeps it alive until the next run)
    assert a.k_scale_ptr != k_scale.data_ptr() and ctypes.c_float.from_address(a.k_scale_ptr).value == 2.0


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_tuple_and_stacked_caches_point_at_k_and_v(cpu_wrappers, launches, kv_layout):
    wrapper, indices = planned(kv_layout)
    k, v = cache(indices, kv_layout)
    stacked = torch.stack([k, v], dim=1)
    for kv_cache, (k_ptr, v_ptr) in (((k, v), (k.data_ptr(), v.data_ptr())),
                                     (stacked, (stacked.data_ptr(), stacked[:, 1].data_ptr()))):
        wrapper.run(query(), kv_cache)
        a = wrapper.flashjit_decoder.current_plan.decode_args
        assert (a.k, a.v) == (k_ptr, v_ptr)
        assert a.slot_stride == (KV_HEADS * DIM if kv_layout == "NHD" else DIM)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_page_size_one_caches_may_leave_out_the_page_dimension(cpu_wrappers, launches, kv_layout):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, kv_layout)
    indptr, indices, last = tables([3, 7], 1, np.random.default_rng(2))
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, 1)
    k = torch.zeros(int(indices.max()) + 1, KV_HEADS, DIM, dtype=torch.float16)
    v = torch.zeros_like(k)
    for kv_cache in ((k, v), torch.stack([k, v], dim=1)):
        wrapper.run(query(2), kv_cache)
        a = wrapper.flashjit_decoder.current_plan.decode_args
        assert (a.page_stride, a.head_stride) == (KV_HEADS * DIM * (1 if isinstance(kv_cache, tuple) else 2), DIM)


@pytest.mark.parametrize("extra, message", [
    (dict(skip_softmax_threshold_scale_factor=0.1), "skip_softmax_threshold_scale_factor=0.1"),
    (dict(kv_cache_sf=torch.ones(3)), "kv_cache_sf="),
])
def test_run_refuses_other_kernels_arguments(cpu_wrappers, launches, extra, message):
    wrapper, indices = planned()
    with pytest.raises(NotImplementedError, match=message):
        wrapper.run(query(), cache(indices), **extra)
    with pytest.raises(NotImplementedError, match=r"\*args"):
        wrapper.run(query(), cache(indices), torch.ones(1))
    assert launches == []


def test_run_checks_window_left_against_the_plan(cpu_wrappers, launches):
    wrapper, indices = planned(window_left=255)
    for accepted in (None, 255):
        wrapper.run(query(), cache(indices), window_left=accepted, enable_pdl=True, q_len_per_req=None)
    with pytest.raises(ValueError, match="window_left: expected plan\\(\\)'s window_left=255"):
        wrapper.run(query(), cache(indices), window_left=-1)


@pytest.mark.parametrize("bad, message", [(dict(q_scale=-1.0), "q_scale"), (dict(q_scale=torch.ones(1)), "q_scale"),
                                          (dict(v_scale=0.0), "v_scale")])
def test_bad_scales_are_refused_naming_them(cpu_wrappers, launches, bad, message):
    wrapper, indices = planned()
    with pytest.raises(ValueError, match=message):
        wrapper.run(query(), cache(indices), **bad)


def test_run_before_plan_is_an_error(cpu_wrappers):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    with pytest.raises(RuntimeError, match="before plan"):
        wrapper.run(query(), (torch.zeros(1), torch.zeros(1)))


def test_the_deprecated_names_plan_and_run(cpu_wrappers, launches):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    indptr, indices, last = batch()
    wrapper.begin_forward(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, window_left=99, sm_scale=0.1)
    assert wrapper.flashjit_decoder.spec.mask == "sliding_window"
    assert torch.is_tensor(wrapper.forward(query(), cache(indices), window_left=99, sm_scale=0.1))
    assert len(wrapper.forward_return_lse(query(), cache(indices), window_left=99, sm_scale=0.1)) == 2
    for other in (dict(window_left=-1, sm_scale=0.1), dict(window_left=99)):
        with pytest.raises(NotImplementedError, match="repeat plan"):
            wrapper.forward(query(), cache(indices), **other)
    wrapper.end_forward()


# ---- CUDA-graph mode -----------------------------------------------------------------------------

def graph_buffers(batch_size=len(KV_LENS), pages=512):
    return (torch.zeros(batch_size + 1, dtype=torch.int32), torch.full((pages,), -7, dtype=torch.int32),
            torch.zeros(batch_size, dtype=torch.int32))


def test_graph_wrapper_reads_page_ids_written_into_its_buffer_in_place(cpu_wrappers, launches):
    indptr_buf, ids_buf, last_buf = graph_buffers()
    wrapper = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WORKSPACE, indptr_buf, ids_buf, last_buf)
    assert wrapper.is_cuda_graph_enabled
    indptr, indices, last = batch()
    n = len(indices)
    ids_buf[:n] = indices  # the caller's own kernel writes the ids, then plans over a prefix view
    wrapper.plan(indptr, ids_buf[:n], last, HEADS, KV_HEADS, DIM, PAGE)
    plan = wrapper.flashjit_decoder.current_plan
    assert plan.page_ids is ids_buf and plan.decode_args.page_indices == ids_buf.data_ptr()
    assert int(ids_buf[n]) == -7  # nothing written past the plan's ids
    assert torch.equal(indptr_buf, indptr) and torch.equal(last_buf, last)  # the buffers hold the table
    wrapper.run(query(), cache(indices))

    indptr2, indices2, last2 = batch(seed=5)
    wrapper.plan(indptr2, indices2, last2, HEADS, KV_HEADS, DIM, PAGE)  # other ids are copied into the buffer
    assert torch.equal(ids_buf[:len(indices2)], indices2) and wrapper.flashjit_decoder.current_plan.page_ids is ids_buf


def test_the_flag_form_of_the_graph_wrapper_is_the_same(cpu_wrappers):
    indptr_buf, ids_buf, last_buf = graph_buffers()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        WORKSPACE, "HND", use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=ids_buf,
        paged_kv_last_page_len_buffer=last_buf)
    assert wrapper.flashjit_decoder.graph_page_ids is ids_buf and wrapper.flashjit_decoder.use_cuda_graph


@pytest.mark.parametrize("change, message", [
    (dict(paged_kv_indptr_buffer=None), "paged_kv_indptr_buffer: expected a torch.Tensor"),
    (dict(paged_kv_last_page_len_buffer=[0, 0]), "paged_kv_last_page_len_buffer"),
    (dict(paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32)), "paged_kv_indptr_buffer: expected batch_size \\+ 1 = 4"),
    (dict(paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int64)), "paged_kv_indices_buffer"),
    (dict(paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int32)[::2]), "paged_kv_indices_buffer"),
])
def test_bad_graph_buffers_are_refused_naming_them(cpu_wrappers, change, message):
    indptr_buf, ids_buf, last_buf = graph_buffers()
    buffers = dict(paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=ids_buf,
                   paged_kv_last_page_len_buffer=last_buf)
    buffers.update(change)
    with pytest.raises(ValueError, match=message):
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, use_cuda_graph=True, **buffers)


def test_graph_plans_keep_the_batch_size_and_the_buffers_length(cpu_wrappers):
    wrapper = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WORKSPACE, *graph_buffers(pages=8))
    indptr, indices, last = batch([40, 90])
    with pytest.raises(ValueError, match="batch size 3 .* got batch size 2"):
        wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)
    indptr, indices, last = batch()
    with pytest.raises(ValueError, match="indices: expected at most len\\(paged_kv_indices_buffer\\) = 8"):
        wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)


# ---- fast_decode_plan ----------------------------------------------------------------------------

def test_fast_plan_reads_the_graph_buffers_as_the_caller_wrote_them(cpu_wrappers, launches):
    indptr_buf, ids_buf, last_buf = graph_buffers()
    wrapper = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WORKSPACE, indptr_buf, ids_buf, last_buf)
    indptr, indices, last = batch()
    ids_buf[:len(indices)] = indices
    wrapper.plan(indptr, ids_buf[:len(indices)], last, HEADS, KV_HEADS, DIM, PAGE)
    ids_buf[0] = -3  # unchecked: fast_decode_plan does not read the ids back (no synchronization)
    stale = torch.zeros_like(indices)
    flashinfer.fast_decode_plan(wrapper, indptr, stale, last, HEADS, KV_HEADS, DIM, PAGE)
    plan = wrapper.flashjit_decoder.current_plan
    assert plan.page_ids is ids_buf and int(ids_buf[0]) == -3 and int(ids_buf[len(indices)]) == -7
    assert torch.equal(indptr_buf, indptr)  # from plan(); fast_decode_plan copies nothing
    with pytest.raises(ValueError, match="indices: expected page ids >= 0"):
        wrapper.plan(indptr, ids_buf[:len(indices)], last, HEADS, KV_HEADS, DIM, PAGE)


def test_fast_plan_takes_the_host_indptr_override_and_skips_last_page_len_at_page_size_1(cpu_wrappers):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    indptr, indices, last = tables([3, 7, 2], 1, np.random.default_rng(4))
    unreadable = torch.full((3,), 99, dtype=torch.int32)  # a page_size-1 plan does not read last_page_len
    flashinfer.fast_decode_plan(wrapper, torch.zeros(4, dtype=torch.int32), indices, unreadable, HEADS, KV_HEADS,
                                DIM, 1, global_override_indptr_cpu=indptr, data_type=torch.bfloat16)
    plan = wrapper.flashjit_decoder.current_plan
    assert list(plan.tables.kv_lens) == [3, 7, 2] and plan.page_ids is indices
    assert (plan.spec.dtype, plan.spec.kv_dtype) == ("bfloat16", "bfloat16")


def test_fast_plan_defaults_to_fp16_and_splits_as_plan_does(cpu_wrappers):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    indptr, indices, last = batch()
    flashinfer.fast_decode_plan(wrapper, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, fixed_split_size=8,
                                window_left=500)
    decoder = wrapper.flashjit_decoder
    assert decoder.spec.dtype == "float16" and decoder.spec.mask == "sliding_window"
    assert decoder.work.chunk_tokens == direct_work(cpu_wrappers, chunk_tokens=8 * PAGE, mask="sliding_window",
                                                    window_left=500).chunk_tokens


def test_fast_plan_needs_a_flashjit_wrapper(cpu_wrappers):
    indptr, indices, last = batch()
    with pytest.raises(ValueError, match="fast_decode_plan's wrapper"):
        flashinfer.fast_decode_plan(object(), indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)


def test_the_module_path_of_flashinfer_decode_works():
    from flashjit.compat.flashinfer.decode import fast_decode_plan

    assert fast_decode_plan is flashinfer.fast_decode_plan
