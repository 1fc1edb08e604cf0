"""flashjit.compat.flashinfer on the CPU with FlashInfer 0.7's decode API: the signatures (checked
against 0.7's parameter lists, as read from its decode.py), plan()'s q_len_per_req / is_causal /
window_right, 0.6's positional options, logits_soft_cap and run()'s sinks served, kv_cache_sf and
use_token_head_sf refused by name."""

from __future__ import annotations

import ctypes
import inspect

import pytest
import torch

from flashjit.compat import flashinfer

from test_compat_flashinfer import DIM, HEADS, KV_HEADS, PAGE, WORKSPACE, batch, cache, cpu_wrappers, planned, query  # noqa: F401

# FlashInfer 0.7.4, flashinfer/decode.py: _BATCH_DECODE_PLAN_LEGACY_POS_ARGS (plan()'s options after
# page_size, still accepted positionally in this order) and the keyword-only ones of _plan_impl.
PLAN_POSITIONAL_07 = ("pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                      "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
                      "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req")
PLAN_KEYWORD_ONLY_07 = {"window_right": 0, "is_causal": None, "use_token_head_sf": False}
RUN_KEYWORDS_07 = {"q_scale": None, "k_scale": None, "v_scale": None, "out": None, "lse": None, "return_lse": False,
                   "enable_pdl": None, "window_left": None, "sinks": None, "q_len_per_req": None,
                   "skip_softmax_threshold_scale_factor": None, "kv_cache_sf": None}
FAST_PLAN_TAIL_07 = ("fixed_split_size", "disable_split_kv", "q_len_per_req", "global_override_indptr_cpu")


def parameters(fn) -> dict:
    return dict(inspect.signature(fn).parameters)


def test_plan_takes_0_7s_options_in_its_legacy_order_and_keywords():
    params = parameters(flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan)
    names = list(params)
    assert names[8:8 + len(PLAN_POSITIONAL_07)] == list(PLAN_POSITIONAL_07)  # after self and the 7 table arguments
    assert all(params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for n in PLAN_POSITIONAL_07)
    for name, default in PLAN_KEYWORD_ONLY_07.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == default


def test_run_and_fast_decode_plan_take_0_7s_keywords():
    params = parameters(flashinfer.BatchDecodeWithPagedKVCacheWrapper.run)
    assert {name: params[name].default for name in RUN_KEYWORDS_07} == RUN_KEYWORDS_07
    assert "jit_kwargs" in parameters(flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__)
    assert list(parameters(flashinfer.fast_decode_plan))[-len(FAST_PLAN_TAIL_07):] == list(FAST_PLAN_TAIL_07)


@pytest.mark.parametrize("options, mask, q_len", [
    (dict(q_len_per_req=2), "causal", 2),                      # several query tokens: causal, as in FlashInfer
    (dict(q_len_per_req=3, is_causal=False), "none", 3),
    (dict(q_len_per_req=2, window_right=-1), "none", 2),       # no right bound: every key
    (dict(q_len_per_req=2, window_left=100), "sliding_window", 2),
    (dict(is_causal=True), "causal", 1),
    (dict(q_len_per_req=1, window_right=0, is_causal=None), "none", 1),
])
def test_plan_keywords_of_0_7_choose_the_query_mask(cpu_wrappers, options, mask, q_len):
    wrapper, _ = planned(**options)
    decoder = wrapper.flashjit_decoder
    assert decoder.spec.mask == mask and decoder.spec.max_q_len == q_len
    assert decoder.num_tokens == q_len * 3


def test_0_6_positional_options_still_plan(cpu_wrappers):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    indptr, indices, last = batch()
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, "NONE", 99, None, torch.bfloat16)
    spec = wrapper.flashjit_decoder.spec
    assert (spec.mask, spec.dtype) == ("sliding_window", "bfloat16")
    assert wrapper.flashjit_decoder.current_plan.setup.params == {"window_left": 99}


def test_logits_soft_cap_plans_the_soft_cap_variant(cpu_wrappers, launches):
    wrapper, indices = planned(logits_soft_cap=30.0)
    setup = wrapper.flashjit_decoder.current_plan.setup
    assert wrapper.flashjit_decoder.spec.variant == "soft_cap" and setup.variant_params == {"logits_soft_cap": 30.0}
    assert torch.is_tensor(wrapper.forward(query(), cache(indices), logits_soft_cap=30.0))
    with pytest.raises(NotImplementedError, match="logits_soft_cap=20.0 .*repeat plan"):
        wrapper.forward(query(), cache(indices), logits_soft_cap=20.0)
    for off in (None, 0.0, -1.0):  # FlashInfer caps only for a cap > 0
        wrapper, _ = planned(logits_soft_cap=off)
        assert wrapper.flashjit_decoder.spec.variant == "none"


def sinks_pointer(decoder) -> int:
    """The sinks pointer the decode launch passes (the last of its parameter values)."""
    params = decoder.current_plan.decode_launch.params
    return ctypes.c_void_p.from_address(params[len(params) - 1]).value


def test_run_sinks_plan_once_then_point_the_kernel_at_each_layers(cpu_wrappers, launches):
    wrapper, indices = planned()
    decoder = wrapper.flashjit_decoder
    kv, layer_sinks = cache(indices), [torch.randn(HEADS) for _ in range(3)]
    wrapper.run(query(), kv, sinks=layer_sinks[0])  # a plan without sinks: planned again, with them
    plan = decoder.current_plan
    assert decoder.spec.variant == "sinks" and sinks_pointer(decoder) == layer_sinks[0].data_ptr()
    for sinks in layer_sinks[1:]:  # each layer's own: the same plan, re-pointed
        wrapper.run(query(), kv, sinks=sinks)
        assert decoder.current_plan is plan and sinks_pointer(decoder) == sinks.data_ptr()
    indptr, indices2, last = batch(seed=3)
    wrapper.plan(indptr, indices2, last, HEADS, KV_HEADS, DIM, PAGE)  # the next step plans for sinks at once
    assert decoder.spec.variant == "sinks"
    wrapper.run(query(), cache(indices2))  # no sinks: planned again without
    assert decoder.spec.variant == "none" and len(launches) == 4


def test_sinks_unlike_the_planned_ones_are_refused_naming_them(cpu_wrappers, launches):
    wrapper, indices = planned()
    wrapper.run(query(), cache(indices), sinks=torch.zeros(HEADS))
    plan = wrapper.flashjit_decoder.current_plan
    for bad in (torch.zeros(HEADS + 1), torch.zeros(HEADS, dtype=torch.float16), torch.zeros(2 * HEADS)[::2]):
        with pytest.raises(ValueError, match="sinks: expected a contiguous torch.float32 tensor"):
            wrapper.run(query(), cache(indices), sinks=bad)
    assert wrapper.flashjit_decoder.current_plan is plan


@pytest.mark.parametrize("options, error, message", [
    (dict(window_right=5), NotImplementedError, "window_right=5"),
    (dict(window_right=-1, is_causal=True), ValueError, "window_right"),
    (dict(q_len_per_req=2, is_causal=False, window_left=10), NotImplementedError, "is_causal=False"),
    (dict(q_len_per_req=0), ValueError, "q_len_per_req"),
    (dict(is_causal="yes"), ValueError, "is_causal"),
    (dict(use_token_head_sf=True), NotImplementedError, "use_token_head_sf=True"),
])
def test_0_7_plan_options_flashjit_lacks_are_refused_by_name(cpu_wrappers, options, error, message):
    wrapper, _ = planned()
    before = wrapper.flashjit_decoder.current_plan
    indptr, indices, last = batch(seed=2)
    with pytest.raises(error, match=message):
        wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **options)
    assert wrapper.flashjit_decoder.current_plan is before


def test_run_takes_q_len_per_req_only_as_planned(cpu_wrappers, launches):
    wrapper, indices = planned(q_len_per_req=2)
    for accepted in (None, 2):
        wrapper.run(query(6), cache(indices), q_len_per_req=accepted)
    with pytest.raises(ValueError, match="q_len_per_req: expected None or plan\\(\\)'s q_len_per_req=2"):
        wrapper.run(query(6), cache(indices), q_len_per_req=1)
    with pytest.raises(NotImplementedError, match="jit_kwargs"):
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, jit_kwargs={"x": 1})


def test_fast_decode_plan_takes_q_len_per_req(cpu_wrappers):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE)
    indptr, indices, last = batch()
    flashinfer.fast_decode_plan(wrapper, indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_len_per_req=4)
    assert wrapper.flashjit_decoder.spec.max_q_len == 4 and wrapper.flashjit_decoder.spec.mask == "causal"
