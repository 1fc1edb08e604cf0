"""flashjit.parallel in one process: layouts, the shard masks, and every shard decoded one after another
(SequentialContextParallelDecode over ReferenceDecoder) against the float32 reference of the whole cache.
tests/test_parallel_gloo.py runs the same over gloo process groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashjit.masks.key_range import key_range_params, kv_span
from flashjit.masks.registry import masks
from flashjit.parallel import (Contiguous, Interleaved, ReferenceDecoder, SequentialContextParallelDecode, Shard,
                               split_page_table)
from flashjit.parallel.shard_mask import shard_mask
from flashjit.serving.reference import decode_reference

import parallel_cases as cases


def sequential(b, world, layout, mask, window_left, **options):
    decoder = SequentialContextParallelDecode(world, device="cpu", decoder=ReferenceDecoder)
    shards = [Shard.from_split(s, "cpu") for s in cases.splits(b, world, layout)]
    decoder.plan(shards, b.kv_lens, cases.HEADS, cases.KV_HEADS, cases.HEAD_DIM, b.page_size, qo_indptr=b.qo_indptr,
                 mask=mask, window_left=window_left, **options)
    return decoder, decoder.run(b.q, (b.k_cache, b.v_cache), return_lse=True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", cases.LAYOUTS, ids=lambda l: f"{l.kind}{l.block_pages}{'-uneven' if l.uneven else ''}")
@pytest.mark.parametrize("mask, window_left", cases.MASKS, ids=lambda v: str(v))
def test_sequential_shards_merge_to_the_single_decode(world, layout, mask, window_left):
    b = cases.batch()
    _, (out, lse) = sequential(b, world, layout, mask, window_left)
    ref, ref_lse = cases.reference(b, mask, window_left)
    cases.assert_matches(out, lse, ref, ref_lse, what=f"{world} {layout} {mask}")


def test_a_wholly_visible_shard_runs_without_a_mask():
    """One query token, causal: every local key is before it, on every shard."""
    b = cases.batch(q_lens=1)
    decoder, _ = sequential(b, 3, cases.Layout("interleaved"), "causal", None)
    assert [s.mask.mask for s in decoder._shards] == ["none"] * 3
    decoder, _ = sequential(b, 3, cases.Layout("interleaved"), "sliding_window", 3)
    assert {s.mask.mask for s in decoder._shards} == {"key_range"}


# ---- layouts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, block_pages, page_size", [(1, 1, 4), (2, 1, 4), (3, 2, 4), (4, 3, 1), (4, 1, 16)])
def test_interleaved_counts_match_the_positions_the_split_deals_out(world, block_pages, page_size):
    global_lens = np.array([0, 1, page_size, 5 * page_size + 3, 97])
    indptr = np.concatenate([[0], np.cumsum(-(-global_lens // page_size))])
    last = np.where(global_lens > 0, global_lens - (np.diff(indptr) - 1) * page_size, 0)
    shards = split_page_table(indptr, np.arange(indptr[-1]), last, page_size, world, layout="interleaved",
                              block_pages=block_pages)
    owner = {}  # global page id -> rank, from the split
    for r, s in enumerate(shards):
        layout = s["layout"]
        local = np.where(np.diff(s["indptr"]) > 0, (np.diff(s["indptr"]) - 1) * page_size + s["last_page_len"], 0)
        assert np.array_equal(layout.local_len(global_lens, page_size), local)
        layout.check(local, global_lens, page_size)
        owner.update({int(p): r for p in s["indices"]})
        for b, n in enumerate(global_lens):  # count_below against a count over the positions themselves
            positions = np.array([g for g in range(n) if ((g // page_size) // block_pages) % world == r])
            xs = np.arange(-2, n + 2)
            got = layout.count_below(xs, np.full(len(xs), b), local, page_size)
            want = np.array([(positions < x).sum() for x in xs])
            assert np.array_equal(got, np.minimum(want, local[b])), (r, b)
    assert sorted(owner) == list(range(indptr[-1]))


def test_contiguous_counts_and_checks():
    layout = Contiguous((0, 10, 3))
    local, global_lens = np.array([5, 4, 0]), np.array([5, 20, 3])
    layout.check(local, global_lens, 4)
    got = layout.count_below(np.array([0, 3, 9, 12, 100, 3]), np.array([0, 0, 1, 1, 1, 2]), local, 4)
    assert got.tolist() == [0, 3, 0, 2, 4, 0]
    with pytest.raises(ValueError, match="request 1: offset 10 \\+ 4 local keys <= 13"):
        layout.check(local, np.array([5, 13, 3]), 4)


def test_shard_mask_ranges_by_hand():
    """Interleaved pages of 2 over 2 ranks, 9 keys: rank 1 holds global 2,3,6,7 as local 0..3."""
    layout = Interleaved(1, 2)
    local_lens, global_lens, qo = np.array([4]), np.array([9]), np.array([0, 3])  # queries at 6, 7, 8
    causal = shard_mask(layout, local_lens, global_lens, qo, 2, "causal", None)
    assert causal.mask == "key_range" and causal.begin.tolist() == [0, 0, 0] and causal.end.tolist() == [3, 4, 4]
    window = shard_mask(layout, local_lens, global_lens, qo, 2, "sliding_window", 1)  # keys q-1 .. q
    assert window.begin.tolist() == [2, 2, 3] and window.end.tolist() == [3, 4, 4]
    assert shard_mask(layout, local_lens, global_lens, qo, 2, "none", None).mask == "none"


# ---- refusals ------------------------------------------------------------------------------------

def planned(b, world=2, **changes):
    args = dict(shards=[Shard.from_split(s, "cpu") for s in cases.splits(b, world, cases.Layout("contiguous"))],
                global_kv_lens=b.kv_lens, num_qo_heads=cases.HEADS, num_kv_heads=cases.KV_HEADS,
                head_dim=cases.HEAD_DIM, page_size=b.page_size, qo_indptr=b.qo_indptr)
    args.update(changes)
    decoder = SequentialContextParallelDecode(world, device="cpu", decoder=ReferenceDecoder)
    return decoder.plan(args.pop("shards"), args.pop("global_kv_lens"), *[args.pop(k) for k in (
        "num_qo_heads", "num_kv_heads", "head_dim", "page_size")], **args)


@pytest.mark.parametrize("changes, message", [
    ({"mask": "tree"}, "mask: expected one of none, causal, sliding_window"),
    ({"mask": "sliding_window"}, "window_left: expected an int >= 0 with mask='sliding_window'"),
    ({"mask": "causal", "window_left": 4}, "window_left: expected None with mask='causal'"),
    ({"global_kv_lens": [37, 0, 16, 101, 2, 10]}, "local key counts that add up to global_kv_lens"),
    ({"global_kv_lens": [37, 0, 16, 101, 2]}, "qo_indptr: expected 6 increasing offsets"),
    ({"global_kv_lens": [37, 0, 16, 101, 2, -9]}, "global_kv_lens: expected key counts >= 0"),
    ({"shards": []}, "shards: expected 2 shards"),
])
def test_bad_plans_are_refused(changes, message):
    with pytest.raises(ValueError) as info:
        planned(cases.batch(), **changes)
    assert message in str(info.value)


def test_a_shard_that_does_not_fit_its_layout_is_refused():
    b = cases.batch()
    split = cases.splits(b, 2, cases.Layout("interleaved"))
    split[0]["layout"] = Interleaved(1, 2)  # rank 0's pages labelled as rank 1's
    with pytest.raises(ValueError, match="the keys an interleaved layout gives rank 1 of 2"):
        SequentialContextParallelDecode(2, device="cpu", decoder=ReferenceDecoder).plan(
            [Shard.from_split(s, "cpu") for s in split], b.kv_lens, 4, 2, 16, b.page_size, qo_indptr=b.qo_indptr)
    with pytest.raises(ValueError, match="layout: expected flashjit.parallel.Contiguous"):
        Shard(split[0]["indptr"], split[0]["indices"], split[0]["last_page_len"], "contiguous")
    with pytest.raises(ValueError, match="Interleaved.rank: expected an int in 0..1"):
        Interleaved(2, 2)


def test_run_refuses_a_query_of_another_shape():
    b = cases.batch()
    decoder = planned(b)
    with pytest.raises(ValueError, match=r"q: expected a tensor \(14, 4, 16\)"):
        decoder.run(b.q[:3], (b.k_cache, b.v_cache))


# ---- the key_range mask --------------------------------------------------------------------------

def test_key_range_span_reference_and_refusals():
    params = key_range_params([0, 2, 2, 3], [1, 4, 0], [3, 9, 5], device="cpu")
    begin, end = kv_span(np.array([8, 5, 4]), np.array([2, 0, 1]), params)
    assert begin.tolist() == [1, 0, 0] and end.tolist() == [8, 0, 4]  # clipped to kv_len
    visible = masks.get("key_range").reference(torch.arange(6, 8)[:, None], torch.arange(8)[None, :], 0, params)
    assert visible.int().tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="range_qo_indptr: expected the plan's qo_indptr"):
        kv_span(np.array([8, 5, 4]), np.array([1, 1, 1]), params)


def test_key_range_on_the_reference_decode_equals_explicit_ranges():
    b = cases.batch()
    rng = np.random.default_rng(0)
    tokens = int(b.qo_indptr[-1])
    request = np.repeat(np.arange(len(b.kv_lens)), np.diff(b.qo_indptr.numpy()))
    lens = np.array(b.kv_lens)[request]
    begin = (rng.random(tokens) * (lens + 1)).astype(int)
    end = np.minimum(begin + (rng.random(tokens) * 10).astype(int), lens)
    params = key_range_params(b.qo_indptr.numpy(), begin, end, device="cpu")
    out, lse = decode_reference(b.q, b.k_cache, b.v_cache, b.indptr, b.indices, b.last_page_len,
                                qo_indptr=b.qo_indptr, mask="key_range", mask_params=params)
    assert torch.equal(lse == float("-inf"), torch.from_numpy(end <= begin)[:, None].expand_as(lse))
    assert not torch.isnan(out).any()


@pytest.mark.skipif(not __import__("flashjit.deploy.mask_check", fromlist=["x"]).host_compiler(),
                    reason="no host C++ compiler for the mask's host replay")
def test_key_range_hooks_pass_the_host_replay():
    from flashjit.deploy import mask_check

    result = mask_check.check_on_host("key_range")
    assert result.requests > 20 and not result.skipped and result.passed, "\n".join(result.failures)


def test_key_range_compiles(tmp_path):
    from flashjit import DecodeSpec, Engine

    engine = Engine(cache_dir=tmp_path)
    for tc in (False, True):
        spec = DecodeSpec(128, mask="key_range", group_size=4, max_q_len=4, arch="sm_90", tensor_cores=tc)
        assert "__ldg(params.range_begin + t)" in engine.source(spec)
    # one compile is enough here: the GPU tests run both kernels
    assert engine.get_kernel(spec).cubin[:4] == b"\x7fELF"

