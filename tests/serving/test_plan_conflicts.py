"""plan() refuses what it cannot honour rather than resolving it silently.

CUDA-graph mode: a captured run() replays the kernel, grid and argument values it was captured
with, so a later plan() changing the head counts (same group size, so the same kernel), sm_scale or
a mask's or variant's parameter would be ignored by every replay: each is refused, naming it, and
the plan in place stays. Arguments that say one thing twice (window_left= and mask_params'
window_left, qo_indptr and q_len) are refused naming both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_decoders import cpu_decoder, cpu_mla, native_library, page_table, tables

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 128, 16


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def batch(seed=0):
    return tables([300, 200, 40], PAGE, np.random.default_rng(seed))


BLOCK_SPARSE = dict(mask="block_sparse", mask_params={"block_size": 16, "block_indptr": i32([0, 2, 3, 4]),
                                                      "block_indices": i32([0, 5, 1, 2])})
SINKS = torch.zeros(HEADS, dtype=torch.float32)

# (id, the first plan's keywords, a later plan's keywords, the field named, heads of the later plan)
CHANGES = [
    ("heads", {}, {}, "num_qo_heads", (2 * HEADS, 2 * KV_HEADS)),
    ("sm_scale", {}, {"sm_scale": 0.5}, "sm_scale", None),
    ("sm_scale given then default", {"sm_scale": 0.5}, {}, "sm_scale", None),
    ("window_left", {"mask": "sliding_window", "window_left": 100}, {"mask": "sliding_window", "window_left": 200},
     "mask param window_left", None),
    ("mask tensor", BLOCK_SPARSE, {**BLOCK_SPARSE, "mask_params": {**BLOCK_SPARSE["mask_params"],
                                                                   "block_indices": i32([0, 5, 1, 2])}},
     "mask param block_indices", None),
    ("soft cap", {"logits_soft_cap": 30.0}, {"logits_soft_cap": 50.0}, "variant param logits_soft_cap", None),
    ("sinks tensor", {"sinks": SINKS}, {"sinks": SINKS.clone()}, "variant param sinks", None),
]


@pytest.mark.parametrize("name, first, later, field, heads", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_cuda_graph_plan_refuses_what_a_replay_would_not_see(planner, name, first, later, field, heads):
    decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=4, max_num_pages=64)
    indptr, indices, last = batch()
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **first)
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **first)  # the same values plan again
    in_place = decoder.current_plan
    qo_heads, kv_heads = heads or (HEADS, KV_HEADS)
    with pytest.raises(ValueError, match=rf"^plan\(\) with use_cuda_graph=True: {field}: expected the first plan's "
                                         rf".*a captured graph replays it.*, got "):
        decoder.plan(indptr, indices, last, qo_heads, kv_heads, DIM, PAGE, **later)
    assert decoder.current_plan is in_place


def test_a_mask_tensor_rewritten_in_place_plans_again(planner):
    """The way to change a mask tensor under a graph: new values in the same tensor."""
    decoder = cpu_decoder(planner, use_cuda_graph=True, max_batch_size=4, max_num_pages=64)
    indptr, indices, last = batch()
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **BLOCK_SPARSE)
    BLOCK_SPARSE["mask_params"]["block_indices"].copy_(i32([1, 4, 0, 2]))
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **BLOCK_SPARSE)


def test_eager_plans_change_heads_and_scales_freely(planner):
    decoder = cpu_decoder(planner)
    indptr, indices, last = batch()
    for qo_heads, kv_heads, sm_scale in ((HEADS, KV_HEADS, None), (2 * HEADS, 2 * KV_HEADS, 0.5)):
        decoder.plan(indptr, indices, last, qo_heads, kv_heads, DIM, PAGE, sm_scale=sm_scale)
        assert decoder.num_qo_heads == qo_heads


def test_a_cuda_graph_mla_plan_refuses_a_new_sm_scale(engine, fake_nvrtc):
    decoder = cpu_mla(engine, use_cuda_graph=True, max_batch_size=8, max_num_pages=128)
    indptr, indices, last = page_table([100, 300], 16)
    decoder.plan(indptr, indices, last, 32, 16, sm_scale=0.1)
    in_place = decoder.current_plan
    with pytest.raises(ValueError, match=r"^plan\(\) with use_cuda_graph=True: sm_scale: expected the first plan's "
                                         r"0\.1.*, got 0\.2"):
        decoder.plan(indptr, indices, last, 32, 16, sm_scale=0.2)
    assert decoder.current_plan is in_place


# ---- the same thing said twice --------------------------------------------------------------

def test_window_left_given_twice_is_refused_naming_both(planner):
    decoder = cpu_decoder(planner)
    indptr, indices, last = batch()
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, mask="sliding_window", window_left=100)
    in_place = decoder.current_plan
    for given in (200, 100):  # refused even where the two agree: one place says it
        with pytest.raises(ValueError, match=r"^window_left= and mask_params\['window_left'\]: expected one of them"
                                             rf".*, got both \(window_left={given}, mask_params\['window_left'\]=300\)$"):
            decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, mask="sliding_window", window_left=given,
                         mask_params={"window_left": 300})
    assert decoder.current_plan is in_place
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, mask="sliding_window",
                 mask_params={"window_left": 300})  # either place alone plans
    assert decoder.current_plan.setup.params == {"window_left": 300}


@pytest.mark.parametrize("host_planner", ["native", "numpy"])
def test_qo_indptr_and_q_len_together_are_refused_naming_both(planner, host_planner):
    from flashjit.worklist.host import HostPlanner

    if host_planner == "native" and native_library() is None:
        pytest.skip("no C compiler: plan() uses the numpy planner here")
    decoder = cpu_decoder(planner, host_planner=HostPlanner(native_library() if host_planner == "native" else None))
    indptr, indices, last = batch()
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_len=2)
    in_place = decoder.current_plan
    with pytest.raises(ValueError, match=r"^qo_indptr and q_len: expected one of them .*, got both \(q_len=1\)$"):
        decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, qo_indptr=i32([0, 1, 2, 3]), q_len=1)
    assert decoder.current_plan is in_place


def test_mla_refuses_qo_indptr_and_q_len_together(engine, fake_nvrtc):
    decoder = cpu_mla(engine)
    indptr, indices, last = page_table([100, 300], 16)
    with pytest.raises(ValueError, match=r"^qo_indptr and q_len: expected one of them"):
        decoder.plan(indptr, indices, last, 32, 16, sm_scale=0.1, qo_indptr=i32([0, 2, 4]), q_len=2)
