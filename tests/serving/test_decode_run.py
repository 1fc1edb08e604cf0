"""BatchDecode.run() on the CPU: the arguments it writes, the launches, and the checks of its tensors.

The decoder is tests/cpu_decoders.py's CPU decoder, the launches are recorded instead of made. run()
recognises the common valid q/out/lse in a few attribute reads and sends anything else through
the full checks; `fast` runs each case both ways (a CPU tensor's get_device() is -1, the CPU
device's index None, so the quick path is taken only when get_device() is patched to match).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashjit.kernels.decode import tiling
from flashjit.serving.batch_decode import BatchDecode
from flashjit.worklist.host import HostPlanner

from cpu_decoders import cpu_decoder, fake_loaded, native_library, tables

HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 16


@pytest.fixture(params=[False, True], ids=["full checks", "quick path"])
def fast(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self: None)
    return request.param


def run_decoder(engine):
    """cpu_decoder, launching on the stream 0x77."""
    return cpu_decoder(engine, current_stream=lambda index: 0x77)


def planned(engine, kv_lens):
    decoder = run_decoder(engine)
    indptr, indices, last = tables(kv_lens, PAGE, np.random.default_rng(0))
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)
    pages = int(indices.max()) + 1
    q = torch.randn(len(kv_lens), HEADS, DIM, dtype=torch.bfloat16)
    k, v = (torch.zeros(pages, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16) for _ in range(2))
    return decoder, q, k, v


@pytest.mark.parametrize("fused_merge", [True, False])
def test_run_points_the_arguments_at_its_tensors(planner, launches, fast, fused_merge, monkeypatch):
    monkeypatch.setattr(tiling, "TUNING", tiling.TUNING.replace(fused_merge=fused_merge))
    decoder, q, k, v = planned(planner, [5000, 30, 700])  # split: the merge runs too (fused or launched)
    out, lse = torch.empty_like(q), torch.empty(3, HEADS)
    for _ in range(2):  # the second time every tensor is recognised
        assert decoder.run(q, (k, v), out=out, lse=lse, return_lse=True) == (out, lse)
        a, m = decoder.current_plan.decode_args, decoder.current_plan.merge_args
        assert (a.q, a.q_stride, a.out, a.out_stride, a.lse) == (q.data_ptr(), HEADS * DIM, out.data_ptr(),
                                                                 HEADS * DIM, lse.data_ptr())
        assert (a.k, a.v) == (k.data_ptr(), v.data_ptr())
        assert (a.page_stride, a.slot_stride, a.head_stride) == (PAGE * KV_HEADS * DIM, KV_HEADS * DIM, DIM)
        if not fused_merge:
            assert (m.out, m.out_stride, m.lse) == (a.out, a.out_stride, a.lse)
    decode, merge = decoder.current_plan.decode_launch, decoder.current_plan.merge_launch
    assert decode.programmatic and (fused_merge or merge.programmatic)  # sm_90: the kernels wait themselves
    if fused_merge:
        assert merge is None and launches == [(decode.function, decode.grid, 0x77)] * 2
    else:
        assert launches == [(decode.function, decode.grid, 0x77), (merge.function, merge.grid, 0x77)] * 2


def test_run_allocates_out_and_lse_when_not_given(planner, launches, fast):
    decoder, q, k, v = planned(planner, [40, 90])
    out, lse = decoder.run(q, (k, v), return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, HEADS) and lse.dtype == torch.float32
    a = decoder.current_plan.decode_args
    assert (a.out, a.lse) == (out.data_ptr(), lse.data_ptr())
    combined = torch.stack([k, v], dim=1)  # one [pages, 2, ...] tensor
    decoder.run(q, combined)
    assert a.k == combined.data_ptr() and a.v == combined.data_ptr() + combined.stride(1) * 2 and a.lse is None  # NULL


def _wider(q):
    """q's values in a [tokens, heads, 2 * head_dim] tensor: heads not packed densely."""
    return torch.zeros(q.shape[0], HEADS, 2 * DIM, dtype=q.dtype)[:, :, :DIM]


BAD_QUERIES = [
    (lambda q: q.float(), r"^q: expected dtype torch.bfloat16, got torch.float32$"),
    (lambda q: q[:1], r"^q: expected shape \(2, 8, 64\), got shape \(1, 8, 64\)$"),
    (lambda q: q[:, :4], r"^q: expected shape \(2, 8, 64\), got shape \(2, 4, 64\)$"),
    (lambda q: q.reshape(2, HEADS * DIM), r"^q: expected shape \(2, 8, 64\), got shape \(2, 512\)$"),
    (lambda q: q.transpose(1, 2).contiguous().transpose(1, 2), r"^q: expected a contiguous last dimension"),
    (_wider, r"^q: expected heads packed densely \(stride\(1\) == head_dim == 64\)"),
    (lambda q: torch.zeros(2 * HEADS * DIM + 1, dtype=q.dtype)[1:].view(2, HEADS, DIM),
     r"^q: expected 16-byte aligned rows"),
    (lambda q: q.float().numpy(), r"^q: expected a torch.Tensor, got ndarray$"),
]


@pytest.mark.parametrize("make, message", BAD_QUERIES)
def test_run_refuses_bad_queries_and_outputs(planner, launches, fast, make, message):
    decoder, q, k, v = planned(planner, [40, 90])
    with pytest.raises(ValueError, match=message):
        decoder.run(make(q), (k, v))
    with pytest.raises(ValueError, match=message.replace("^q:", "^out:")):
        decoder.run(q, (k, v), out=make(torch.empty_like(q)))
    assert launches == []


@pytest.mark.parametrize("make, message", [
    (lambda lse: lse.double(), r"^lse: expected dtype torch.float32, got torch.float64$"),
    (lambda lse: lse[:1], r"^lse: expected shape \(2, 8\), got shape \(1, 8\)$"),
    (lambda lse: lse.t().contiguous().t(), r"^lse: expected a contiguous tensor, got strides \(1, 2\)$"),
])
def test_run_refuses_a_bad_lse(planner, launches, fast, make, message):
    decoder, q, k, v = planned(planner, [40, 90])
    with pytest.raises(ValueError, match=message):
        decoder.run(q, (k, v), lse=make(torch.empty(2, HEADS)))
    assert launches == []


def test_a_recognised_cache_is_checked_again_once_re_pointed(planner, launches):
    decoder, q, k, v = planned(planner, [40, 90])
    decoder.run(q, (k, v))
    k.set_(torch.zeros(1, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16))  # too few pages for the plan's ids
    with pytest.raises(ValueError, match="k_cache: expected more than"):
        decoder.run(q, (k, v))


def test_run_points_at_each_layers_cache_in_turn(planner, launches):
    """Layers alternate caches (and a pair with one combined tensor): every call points at its own,
    though the previous call's cache is recognised without the checks."""
    decoder, q, k, v = planned(planner, [40, 90])
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    combined = torch.stack([k, v], dim=1)
    for kv_cache in [(k, v), (k, v), (k2, v2), [k, v], (k2, v2), combined, combined, (k, v)]:
        decoder.run(q, kv_cache)
        a = decoder.current_plan.decode_args
        if isinstance(kv_cache, torch.Tensor):
            assert (a.k, a.v) == (combined.data_ptr(), combined.data_ptr() + combined.stride(1) * 2)
            assert a.page_stride == combined.stride(0)
        else:
            assert (a.k, a.v, a.page_stride) == (kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), k.stride(0))


def test_a_refused_cache_leaves_the_previous_one_to_be_pointed_at_again(planner, launches):
    decoder, q, k, v = planned(planner, [40, 90])
    decoder.run(q, (k, v))
    k2 = torch.randn_like(k)
    with pytest.raises(ValueError, match="v_cache"):
        decoder.run(q, (k2, v.float()))  # K is set before V is refused
    decoder.run(q, (k, v))
    a = decoder.current_plan.decode_args
    assert (a.k, a.v) == (k.data_ptr(), v.data_ptr())


def test_the_previous_cache_is_checked_again_after_a_shape_change_or_a_new_plan(planner, launches):
    decoder, q, k, v = planned(planner, [40, 90])
    decoder.run(q, (k, v))
    k.resize_(1, PAGE, KV_HEADS, DIM)  # same storage and pointer, too few pages now
    with pytest.raises(ValueError, match="k_cache: expected more than"):
        decoder.run(q, (k, v))
    k2 = torch.zeros(3, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16)
    v2 = torch.zeros_like(k2)
    decoder.plan(*_tables_over(3), HEADS, KV_HEADS, DIM, PAGE)  # ids 0..2: the small cache fits
    decoder.run(q[:1], (k2, v2))
    decoder.plan(*_tables_over(9), HEADS, KV_HEADS, DIM, PAGE)  # ids up to 8: it no longer does
    with pytest.raises(ValueError, match="k_cache: expected more than 8 pages"):
        decoder.run(q[:1], (k2, v2))


def _tables_over(pages: int):
    """One request over page ids 0..pages-1."""
    return (torch.tensor([0, pages], dtype=torch.int32), torch.arange(pages, dtype=torch.int32),
            torch.tensor([PAGE], dtype=torch.int32))


def test_a_refused_scale_leaves_the_previous_scales_to_be_set_again(planner, launches):
    decoder = run_decoder(planner)
    indptr, indices, last = tables([40, 90], PAGE, np.random.default_rng(0))
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, kv_dtype="e4m3")
    q = torch.randn(2, HEADS, DIM, dtype=torch.bfloat16)
    k, v = (torch.zeros(int(indices.max()) + 1, PAGE, KV_HEADS, DIM, dtype=torch.float8_e4m3fn) for _ in range(2))
    decoder.run(q, (k, v), k_scale=2.0, v_scale=3.0)
    with pytest.raises(ValueError, match="v_scale"):
        decoder.run(q, (k, v), k_scale=5.0, v_scale=-1.0)  # k_scale is set before v_scale is refused
    decoder.run(q, (k, v), k_scale=2.0, v_scale=3.0)
    a = decoder.current_plan.decode_args
    assert (a.k_scale, a.v_scale) == (2.0, 3.0)


def test_an_sm_80_plan_launches_without_programmatic_serialization(planner):
    """Below sm_90 the kernels have no griddepcontrol wait, so their launches keep plain stream order."""
    decoder = BatchDecode(planner, torch.device("cpu"), arch="sm_80", load_kernel=fake_loaded,
                          host_planner=HostPlanner(native_library()))
    indptr, indices, last = tables([5000, 30], PAGE, np.random.default_rng(0))
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE)
    assert not decoder.current_plan.decode_launch.programmatic
