"""benchmarks/decode.py's pure parts on the CPU: its rows, their lengths and bytes, the CLI, the
measurement's checks and error policy (over fake steps and graphs), the peers' arguments (over
stand-ins with FlashInfer's and FA3's signatures, computing attention in torch), and the report."""

from __future__ import annotations

import math
import subprocess
import sys
import types

import pytest
import torch

from benchmarks import decode, peers, report
from benchmarks.cases import (BASE_FAMILY, CASES, Case, Spread, attended_bytes, attended_tokens, gb_per_s,
                              kv_lengths, select_cases)
from benchmarks.inputs import build_inputs, reference
from benchmarks.measure import build_and_measure, measure
from benchmarks.peers import Impl, Step
from benchmarks.timing import host_us

from repo_paths import ROOT

BY_NAME = {c.name: c for c in CASES}


# ---- rows -------------------------------------------------------------------------------------

def test_row_names_are_unique_and_the_quick_subset_stays_short():
    assert len(BY_NAME) == len(CASES)
    quick = select_cases(CASES, quick=True)
    assert 0 < len(quick) <= 11 and all(c.quick for c in quick)


@pytest.mark.parametrize("name, shape", [
    ("b8 L16384 MHA 32/32", dict(batch=8, kv_len=16384, heads_qo=32, heads_kv=32)),
    ("b16 L8192 g8 32/4", dict(batch=16, kv_len=8192, heads_qo=32, heads_kv=4)),
    ("b16 L8192 d96", dict(batch=16, kv_len=8192, head_dim=96)),
    ("b16 L8192 d96 e4m3", dict(batch=16, kv_len=8192, head_dim=96, kv_dtype="float8_e4m3fn")),
    ("b8 L8192 d96 MHA 32/32", dict(batch=8, kv_len=8192, head_dim=96, heads_qo=32, heads_kv=32)),
    ("b8 L16384 MHA 32/32 e4m3", dict(batch=8, kv_len=16384, heads_kv=32, kv_dtype="float8_e4m3fn")),
    ("b16 L8192 p1", dict(batch=16, kv_len=8192, page_size=1)),
    ("b16 L8192 p64", dict(batch=16, kv_len=8192, page_size=64)),
    ("b16 L8192 HND", dict(batch=16, kv_len=8192, kv_layout="HND")),
])
def test_the_head_and_page_rows_have_their_shapes(name, shape):
    case = BY_NAME[name]
    assert {key: getattr(case, key) for key in shape} == shape


def test_the_skewed_row_is_mostly_short_with_four_long_requests_at_seeded_places():
    case = BY_NAME["48 req skewed: 44 of 128..2048, 4 of 24k..64k"]
    lengths = kv_lengths(case)
    assert len(lengths) == 48 and lengths == kv_lengths(case)
    long = [i for i, n in enumerate(lengths) if n > 2048]
    assert len(long) == 4 and all(24576 <= lengths[i] <= 65536 for i in long)
    assert all(128 <= n <= 2048 for i, n in enumerate(lengths) if i not in long)
    assert long != [44, 45, 46, 47]  # shuffled among the short ones
    assert kv_lengths(case, seed=1) != lengths


def test_the_log_uniform_row_keeps_its_published_lengths():
    gen = torch.Generator().manual_seed(0)
    published = torch.exp(torch.empty(64).uniform_(math.log(128), math.log(32768), generator=gen)).long().tolist()
    assert kv_lengths(BY_NAME["64 req log-uniform 128..32768"]) == published


def test_a_case_takes_one_length_or_spreads_that_fill_its_batch():
    with pytest.raises(ValueError, match="not both or neither"):
        Case("x", 2)
    with pytest.raises(ValueError, match="not batch=3"):
        Case("x", 3, spreads=(Spread(2, 1, 4),))
    assert kv_lengths(Case("x", 3, 77)) == [77, 77, 77]


def test_select_cases_filters_by_quick_and_regular_expression():
    names = [c.name for c in select_cases(CASES, only="^b16 L8192( d96| p1)?$")]
    assert names == ["b16 L8192", "b16 L8192 d96", "b16 L8192 p1"]
    assert [c.name for c in select_cases(CASES, quick=True, only="skewed")] == [
        "48 req skewed: 44 of 128..2048, 4 of 24k..64k"]


def test_attended_bytes_count_the_kv_read_plus_q_and_out():
    case = Case("x", 2, 100, head_dim=64, heads_qo=8, heads_kv=2)
    q_out = 2 * 2 * 8 * 64 * 2
    assert attended_bytes(case, [100, 50]) == 2 * 150 * 2 * 64 * 2 + q_out
    fp8 = Case("x", 2, 100, head_dim=64, heads_qo=8, heads_kv=2, kv_dtype="float8_e4m3fn")
    assert attended_bytes(fp8, [100, 50]) == 2 * 150 * 2 * 64 + q_out


def test_a_window_counts_only_its_keys_and_sinks():
    window = Case("x", 2, 100, window=10)
    assert attended_tokens(window, [100, 5]) == 11 + 5
    sinks = Case("x", 2, 100, window=10, sinks=4)
    assert attended_tokens(sinks, [100, 5]) == 15 + 5


def test_gb_per_s():
    assert gb_per_s(4_000_000, 1.0) == 4000.0
    assert gb_per_s(1, None) is None


def test_the_default_shape_is_the_base_family():
    assert BY_NAME["b16 L8192"].family == BASE_FAMILY
    assert BY_NAME["b16 L8192 p64"].family != BASE_FAMILY and BY_NAME["b16 L8192 HND"].family != BASE_FAMILY


# ---- CLI --------------------------------------------------------------------------------------

def test_parser_defaults_time_both_columns():
    args = decode.build_parser().parse_args([])
    assert args.mode == "kernels" and args.graph and not args.quick and args.plot is None
    assert args.host_row == decode.HOST_ROW
    args = decode.build_parser().parse_args(["--no-graph", "--plot", "out.png", "--quick", "--only", "b1 "])
    assert not args.graph and args.plot == "out.png" and args.quick and args.only == "b1 "
    assert decode.build_parser().parse_args(["--graph"]).graph
    assert decode.build_parser().parse_args(["compile"]).mode == "compile"


def test_help_runs_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "--no-graph" in done.stdout and "--plot" in done.stdout


def test_host_row_is_the_first_match_else_the_first_row():
    cases = select_cases(CASES, quick=True)
    assert decode.host_row(cases, decode.HOST_ROW).name == "b16 L8192"
    assert decode.host_row(cases, "no such row") is cases[0]
    assert decode.host_row([], decode.HOST_ROW) is None


# ---- measurement ------------------------------------------------------------------------------

class FakeTimer:
    def __init__(self):
        self.timed = []

    def median_us(self, fn):
        fn()
        self.timed.append(fn)
        return 10.0 + len(self.timed)


class FakeGraph:
    """Replays a captured step into the output the capture returned, as a CUDA graph does."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        self.out.copy_(self.step())


def fake_capture(step):
    out = step().clone()
    return FakeGraph(step, out), out


def syncs():
    count = []
    return count, lambda: count.append(1)


REF = torch.randn(4, 2, 8)


def steady(out=REF):
    return Step(lambda: out.clone(), info=lambda: {"splits": 2, "work_items": 5})


def test_a_right_step_is_timed_eager_and_replayed():
    timer, (count, sync) = FakeTimer(), syncs()
    graph_step = Step(lambda: REF.clone(), before_replay=lambda: None, info=lambda: {"splits": 3, "work_items": 7})
    entry = measure(Impl(steady(), lambda: graph_step), REF, timer, sync=sync, capture=fake_capture)
    assert entry["us"] == 11.0 and entry["graph_us"] == 12.0
    assert entry["row_error"] == 0 and entry["graph_row_error"] == 0
    assert (entry["splits"], entry["work_items"], entry["graph_splits"], entry["graph_work_items"]) == (2, 5, 3, 7)
    assert count  # every output is synchronized before it is compared


def test_no_graph_column_without_graph_or_for_a_step_that_cannot_be_captured():
    for impl, graph in ((Impl(steady(), lambda: steady()), False), (Impl(steady(), None), True)):
        entry = measure(impl, REF, FakeTimer(), sync=lambda: None, capture=fake_capture, graph=graph)
        assert "us" in entry and not any(key.startswith("graph") for key in entry)


def used_up_after(calls: int, out=REF):
    """A step right for its first calls and wrong after: state its first runs consumed (a work
    counter left unreset) makes the later ones skip work."""
    count = []

    def call():
        count.append(1)
        return out.clone() if len(count) <= calls else out * 0

    return call


def test_a_graph_whose_timed_replays_used_up_its_state_is_reported_not_timed():
    # the check replay and the fake timer's call are right; the replay after timing is not
    graph_step = Step(used_up_after(3), before_replay=lambda: None)
    entry = measure(Impl(steady(), lambda: graph_step), REF, FakeTimer(), sync=lambda: None, capture=fake_capture)
    assert "graph_us" not in entry and entry["graph_error"].startswith("after the timed replays:")


def test_an_eager_call_wrong_after_its_timed_calls_is_reported():
    entry = measure(Impl(Step(used_up_after(2))), REF, FakeTimer(), sync=lambda: None, capture=fake_capture)
    assert entry == {"error": entry["error"]} and entry["error"].startswith("after the timed calls:")


def test_a_wrong_step_is_reported_not_timed():
    timer = FakeTimer()
    entry = measure(Impl(steady(REF + 1)), REF, timer, sync=lambda: None, capture=fake_capture)
    assert entry == {"error": entry["error"]} and "rows off the reference" in entry["error"] and not timer.timed


def test_one_wrong_row_of_a_long_request_is_reported_not_timed():
    """Rows judged one by one: a single (token, head) row 5% off fails, where one relative error over
    the batch (0.05 / sqrt(rows)) would pass; rounding as bf16 does passes."""
    ref = torch.randn(64, 8, 128)
    wrong = ref.clone()
    wrong[37, 5] *= 1.05
    from flashjit.deploy.random_batches import rel_error

    assert rel_error(wrong, ref) < 1e-2
    timer = FakeTimer()
    entry = measure(Impl(steady(wrong)), ref, timer, sync=lambda: None, capture=fake_capture, graph=False)
    assert "(token, head) (37, 5)" in entry["error"] and not timer.timed
    entry = measure(Impl(steady(ref.bfloat16())), ref, FakeTimer(), sync=lambda: None, capture=fake_capture,
                    graph=False)
    assert 0 < entry["row_error"] < 2 ** -8


def test_a_layers_rows_are_its_tokens():
    from benchmarks.measure import row_problem

    ref = torch.randn(16, 4096)
    wrong = ref.clone()
    wrong[3, :64] = 0  # one head's 64 columns of one token
    assert row_problem(ref, ref)[1] is None and "(token, head) (3, 0)" in row_problem(wrong, ref)[1]


def test_a_replay_must_rewrite_the_captured_output():
    """The graph's output is filled with NaN before the checked replay: a graph writing elsewhere fails."""
    stale = Step(lambda: REF.clone())
    entry = measure(Impl(steady(), lambda: stale), REF, FakeTimer(), sync=lambda: None,
                    capture=lambda step: (types.SimpleNamespace(replay=lambda: None), step()))
    assert entry["graph_error"].startswith("NaN in 8 output rows") and "us" in entry and "graph_us" not in entry


def test_the_plan_before_replay_runs_between_capture_and_replay():
    order = []

    def capture(step):
        order.append("capture")
        return fake_capture(step)

    step = Step(lambda: REF.clone(), before_replay=lambda: order.append("plan"))
    entry = measure(Impl(steady(), lambda: step), REF, FakeTimer(), sync=lambda: None, capture=capture)
    assert order == ["capture", "plan"] and "graph_us" in entry


def test_a_failing_step_is_reported_and_the_gpu_checked_after_it():
    def fails():
        raise RuntimeError("no kernel for this shape")

    count, sync = syncs()
    entry = measure(Impl(Step(fails)), REF, FakeTimer(), sync=sync, capture=fake_capture)
    assert entry == {"error": "RuntimeError: no kernel for this shape"} and count


def test_a_lost_gpu_stops_the_run():
    def fails():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def sync():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        measure(Impl(Step(fails)), REF, FakeTimer(), sync=sync, capture=fake_capture)


@pytest.mark.parametrize("error", [TypeError, AttributeError, NameError])
@pytest.mark.parametrize("where", ["build", "run", "graph"])
def test_an_api_that_differs_raises(error, where):
    def broken(*args):
        raise error("unexpected keyword argument 'page_table'")

    make = {"build": broken,
            "run": lambda: Impl(Step(broken)),
            "graph": lambda: Impl(steady(), broken)}[where]
    with pytest.raises(error, match="page_table") as raised:
        build_and_measure("fa3", make, "b1 L2048", REF, FakeTimer(), sync=lambda: None, capture=fake_capture)
    if hasattr(raised.value, "add_note"):
        assert "fa3 on row 'b1 L2048'" in " ".join(raised.value.__notes__)


def test_a_peer_that_fails_to_build_is_reported_under_its_name():
    def make():
        raise RuntimeError("unsupported head_dim")

    entry = build_and_measure("flashinfer", make, "x", REF, FakeTimer(), sync=lambda: None, capture=fake_capture)
    assert entry == {"error": "RuntimeError: unsupported head_dim"}


def test_host_times_are_measured_for_the_host_row_only():
    entry = measure(Impl(steady(), lambda: steady()), REF, FakeTimer(), sync=lambda: None, capture=fake_capture,
                    host=True)
    assert entry["host_us"] > 0 and entry["graph_host_us"] > 0
    entry = measure(Impl(steady(), lambda: steady()), REF, FakeTimer(), sync=lambda: None, capture=fake_capture)
    assert "host_us" not in entry and "graph_host_us" not in entry


def test_host_us_syncs_between_batches_of_calls_not_inside_them():
    calls, (count, sync) = [], syncs()
    us = host_us(lambda: calls.append(len(count)), sync, calls=64, sync_every=16)
    assert us >= 0 and len(calls) == 65 and len(count) == 1 + 4 + 1
    assert calls[1:17] == [1] * 16 and calls[17] == 2  # no sync inside a batch of 16 calls


# ---- peers, over stand-ins --------------------------------------------------------------------

def small(**shape):
    """A small row on the CPU: 3 requests of mixed lengths, 8 query / 2 KV heads, head_dim 64, pages of 16."""
    base = dict(name="small", batch=3, spreads=(Spread(3, 1, 90),), head_dim=64, heads_qo=8, heads_kv=2)
    base.update(shape)
    return Case(**base)


def attention(q, k, v, scale, window=None):
    """q [heads, dim]; k, v [keys, kv_heads, dim]: softmax attention in float32 (the newest window + 1 keys)."""
    if window is not None:
        k, v = k[max(0, len(k) - 1 - window):], v[max(0, len(v) - 1 - window):]
    group = q.shape[0] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("hd,khd->hk", q.float(), k) * scale, dim=-1)
    return torch.einsum("hk,khd->hd", probs, v)


class FlashInferWrapper:
    """BatchDecodeWithPagedKVCacheWrapper's signature (FlashInfer 0.6.6), attention in torch."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        self.layout, self.graph = kv_layout, use_cuda_graph
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False):
        if self.graph:  # the buffers keep the tables, as the captured launch reads them
            assert len(last_page_len) == len(self.buffers[2]) and len(indices) <= len(self.buffers[1])
            self.buffers[0].copy_(indptr)
            self.buffers[1][:len(indices)].copy_(indices)
            self.buffers[2].copy_(last_page_len)
            indptr, indices, last_page_len = self.buffers
        self.tables, self.window = (indptr, indices, last_page_len), window_left

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=1,
            skip_softmax_threshold_scale_factor=None):
        from flashjit.serving.reference import decode_reference

        k, v = paged_kv_cache
        if k.element_size() == 1:  # an fp8 cache holds K / k_scale and V / v_scale
            k, v = k.float() * k_scale, v.float() * v_scale
        params = {"window_left": self.window} if self.window >= 0 else {}
        result, _ = decode_reference(q, k, v, *self.tables, kv_layout=self.layout,
                                     mask="sliding_window" if params else "none", mask_params=params)
        out.copy_(result)
        return out


def fa3_module(with_splits=True, with_scheduler=True):
    """flash_attn_interface with flash_attn_with_kvcache's and get_scheduler_metadata's signatures,
    attention in torch; `scheduled` counts the metadata computed, `given` the metadata each call got."""
    scheduled, given = [], []

    def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                               cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                               cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                               causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                               num_splits=0, pack_gqa=None, sm_margin=0):
        assert max_seqlen_q == 1 and causal and max_seqlen_k == int(cache_seqlens.max())
        scheduled.append(num_splits)
        return torch.full((batch_size + 1,), len(scheduled) * 1000 + num_splits, dtype=torch.int32)

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        batch, seqlen_q, heads, dim = q.shape
        assert seqlen_q == 1 and causal and page_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
        if scheduler_metadata is not None:  # computed for this call's num_splits
            assert int(scheduler_metadata[0]) % 1000 == num_splits
        given.append(None if scheduler_metadata is None else int(scheduler_metadata[0]))
        assert page_table.shape[0] == batch and k_cache.shape[1:] == (k_cache.shape[1], k_cache.shape[2], dim)
        page = k_cache.shape[1]
        out = torch.empty_like(q)
        for b in range(batch):
            n = int(cache_seqlens[b])
            pages = page_table[b, :-(-n // page)].long()
            keys, values = (c[pages].reshape(-1, c.shape[2], dim)[:n] for c in (k_cache, v_cache))
            out[b, 0] = attention(q[b, 0], keys, values, softmax_scale,
                                  window_size[0] if window_size[0] >= 0 else None)
        return out

    if not with_splits:
        def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, page_table=None,  # noqa: F811
                                    softmax_scale=None, causal=False, window_size=(-1, -1),
                                    _full=flash_attn_with_kvcache):
            return _full(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                         softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    module = types.SimpleNamespace(flash_attn_with_kvcache=flash_attn_with_kvcache, scheduled=scheduled, given=given)
    if with_scheduler:
        module.get_scheduler_metadata = get_scheduler_metadata
    return module


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=FlashInferWrapper))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3_module())
    monkeypatch.setattr(peers, "FLASHINFER_WORKSPACE", 1024)


@pytest.mark.parametrize("case", [small(), small(window=20), small(page_size=1), small(heads_kv=8),
                                  small(name="one length", batch=2, spreads=(), kv_len=70)], ids=lambda c: c.name)
def test_peers_decode_the_reference_through_their_apis(stand_ins, case):
    from benchmarks.measure import row_problem

    batch = build_inputs(torch, case, device="cpu")
    ref = reference(batch, case, None)
    found, notes = peers.candidates(torch, batch, case, engine=None, fp8=None)
    expected = {"flashjit", "flashinfer", "flashinfer-tc", "fa3", f"fa3-splits{peers.FA3_SERVER_SPLITS}"}
    assert set(found) == expected | ({"sdpa-cudnn"} if case.kv_len else set())
    for name in expected - {"flashjit"}:
        impl = found[name]()
        assert row_problem(impl.eager.call(), ref)[1] is None, name
        step = impl.graph()
        out = step.call()
        if step.before_replay:
            out.zero_()
            step.before_replay()
            out = step.call()
        assert row_problem(out, ref)[1] is None, f"{name} (graph step)"


@pytest.mark.parametrize("case", [small(name="one length", batch=2, spreads=(), kv_len=70),
                                  small(name="window", batch=2, spreads=(), kv_len=70, window=20),
                                  small(name="sinks", batch=2, spreads=(), kv_len=70, window=20, sinks=3),
                                  small(name="hnd", batch=2, spreads=(), kv_len=70, kv_layout="HND")],
                         ids=lambda c: c.name)
def test_sdpa_attends_the_keys_of_the_mask(case):
    from torch.nn.attention import SDPBackend

    from flashjit.deploy.random_batches import rel_error

    batch = build_inputs(torch, case, device="cpu")
    batch.q, batch.k_cache, batch.v_cache = batch.q.float(), batch.k_cache.float(), batch.v_cache.float()
    impl = peers.sdpa(torch, batch, case, backend=SDPBackend.MATH)
    assert rel_error(impl.eager.call(), reference(batch, case, None)) < 1e-4


def test_fa3_without_num_splits_is_timed_with_its_default_split(stand_ins, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3_module(with_splits=False))
    batch = build_inputs(torch, small(), device="cpu")
    found, notes = peers.candidates(torch, batch, small(), engine=None, fp8=None)
    assert "fa3" in found and not any(n.startswith("fa3-") for n in found)
    assert any("takes no num_splits" in n for n in notes)


def test_fa3_schedules_once_per_step_outside_the_timed_call(stand_ins, monkeypatch):
    """As vLLM does: the metadata is computed when the step is built and again before each replay
    (into the buffer the graph reads), never inside the call a layer makes; and for the call's num_splits."""
    fa3 = fa3_module()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    batch = build_inputs(torch, small(), device="cpu")
    found, notes = peers.candidates(torch, batch, small(), engine=None, fp8=None)
    assert not any("scheduler runs inside" in n for n in notes)
    step = found[f"fa3-splits{peers.FA3_SERVER_SPLITS}"]().graph()
    assert fa3.scheduled == [peers.FA3_SERVER_SPLITS]
    step.call(), step.call()
    assert fa3.scheduled == [peers.FA3_SERVER_SPLITS] and fa3.given == [1000 + peers.FA3_SERVER_SPLITS] * 2
    buffer_before = fa3.given[-1]
    step.before_replay()  # the next step's metadata, into the same buffer
    step.call()
    assert len(fa3.scheduled) == 2 and fa3.given[-1] == 2000 + peers.FA3_SERVER_SPLITS != buffer_before
    assert "scheduler_metadata" in peers.PLAN_COSTS and "get_scheduler_metadata" in peers.PLAN_COSTS


def test_fa3_without_a_scheduler_says_it_schedules_inside_each_call(stand_ins, monkeypatch):
    fa3 = fa3_module(with_scheduler=False)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    batch = build_inputs(torch, small(), device="cpu")
    found, notes = peers.candidates(torch, batch, small(), engine=None, fp8=None)
    assert peers.FA3_SCHEDULES_INSIDE in notes
    step = found["fa3"]().eager
    step.call()
    assert fa3.given == [None] and step.before_replay is None


@pytest.mark.parametrize("shape, absent, note", [
    (dict(kv_layout="HND"), {"fa3"}, "NHD only"),
    (dict(kv_dtype="float8_e4m3fn"), {"fa3"}, "fp8 queries"),
    (dict(window=20, sinks=2), {"fa3", "flashinfer"}, "sink"),
    (dict(head_dim=96), {"flashinfer", "flashinfer-tc"}, "head_dim 96"),
    (dict(), {"sdpa-cudnn"}, "one length only"),
])
def test_peers_left_out_say_why(stand_ins, shape, absent, note):
    case = small(**shape)
    batch = build_inputs(torch, small(kv_layout=case.kv_layout), device="cpu")
    found, notes = peers.candidates(torch, batch, case, engine=None, fp8=None)
    assert not absent & set(found) and any(note in n for n in notes)


def test_an_absent_peer_is_a_note():
    module, why = peers.optional_module("no_such_module_for_flashjit")
    assert module is None and "not importable (ModuleNotFoundError" in why


def test_page_table_pads_each_request_with_page_0():
    indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    indices = torch.tensor([7, 3, 9, 1, 4], dtype=torch.int32)
    table = peers.page_table(torch, indptr, indices)
    assert table.dtype == torch.int32 and table.tolist() == [[7, 3, 0], [0, 0, 0], [9, 1, 4]]


# ---- report -----------------------------------------------------------------------------------

def row(case="b16 L8192", batch=16, mean=8192.0, uniform=True, family=BASE_FAMILY, impls=None):
    impls = impls if impls is not None else {
        "flashjit": {"us": 100.0, "graph_us": 80.0, "splits": 1, "graph_splits": 2},
        "flashinfer": {"us": 110.0, "graph_us": 120.0},
        "fa3": {"us": 90.0, "graph_error": "RuntimeError: capture failed"},
        "sdpa-cudnn": {"error": "rel error 3.00e-01"},
    }
    result = {"case": case, "batch": batch, "mean_kv_len": mean, "uniform": uniform, "family": family,
              "bytes": 400_000_000, "floor_us": 95.0, "impls": impls}
    return decode.finish_row(result, Case(case, 1, 1), [])


def test_best_peer_times_per_mode():
    r = row()
    assert r["best_peer_us"] == 90.0 and r["best_peer_graph_us"] == 120.0
    assert report.best_of({"flashjit": {"us": 1.0}}, "us") is None


def test_an_fp8_row_reports_its_speed_against_its_bf16_row():
    bf16 = row()
    fp8 = decode.finish_row({"case": "b16 L8192 e4m3", "impls": {"flashjit": {"us": 50.0}}},
                            BY_NAME["b16 L8192 e4m3"], [bf16])
    assert fp8["speedup_vs_bf16"] == 2.0


def test_format_row_shows_both_columns_ratios_and_errors():
    line = report.format_row(row(), ceiling_gbs=4000.0)
    assert "flashjit      100.0/80.0 us" in line and " 4000 GB/s (100.0% of copy,  95% of floor)" in line
    assert "vs best peer 0.90x eager, 1.50x graph" in line and "graph/eager speed 1.25" in line
    assert "splits 1 (graph 2)" in line
    assert "flashinfer 110.0/120.0" in line and "fa3 90.0/ERR(RuntimeError: capture failed)" in line
    assert "sdpa-cudnn ERR(rel error 3.00e-01)" in line


def test_format_row_of_a_failed_flashjit():
    line = report.format_row(row(impls={"flashjit": {"error": "ValueError: bad"}}), 4000.0)
    assert "flashjit ERR(ValueError: bad)" in line and "vs best peer n/a eager, n/a graph" in line


def test_markdown_table_has_a_column_per_implementation_and_mode():
    table = report.markdown_table([row(), row(case="b1 L2048", impls={"flashjit": {"us": 20.0}})]).splitlines()
    assert table[0].startswith("| case | MB | floor µs | flashjit (eager / graph) | sdpa-cudnn (eager / graph) | "
                               "flashinfer (eager / graph) | fa3 (eager / graph) | ÷ best peer, eager |")
    assert len(table) == 4 and all(line.count("|") == table[0].count("|") for line in table)
    assert "| 100.0 / 80.0 |" in table[2] and "| 0.90x | 1.50x | 1.25 |" in table[2]
    assert "| 20.0 / - |" in table[3] and table[3].endswith("| n/a | n/a | n/a |")


def test_plot_points_panel_per_batch_then_mixed_lengths():
    rows = [row(case="b16 L2048", mean=2048.0), row(), row(case="b1 L8192", batch=1),
            row(case="64 req", batch=64, mean=5000.0, uniform=False), row(case="d96", family="other")]
    panels = report.plot_points(rows)
    assert list(panels) == ["batch 1", "batch 16", report.MIXED_PANEL]
    assert panels["batch 16"][("flashjit", "eager")] == [(2048.0, 4000.0, "b16 L2048"), (8192.0, 4000.0, "b16 L8192")]
    assert panels["batch 16"][("flashjit", "graph")] == [(2048.0, 5000.0, "b16 L2048"), (8192.0, 5000.0, "b16 L8192")]
    assert ("fa3", "graph") not in panels["batch 1"] and ("sdpa-cudnn", "eager") not in panels["batch 1"]


def test_plot_is_skipped_with_a_message_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "plot.png"
    message = report.write_plot([row()], str(path))
    assert message.startswith("plot skipped: matplotlib not importable") and not path.exists()
    assert "nothing drawn" in report.write_plot([row(family="other")], str(path))


@pytest.mark.parametrize("count, lines", [(1, [1]), (3, [3]), (4, [2, 2]), (5, [3, 2]), (6, [3, 3]), (7, [3, 2, 2])])
def test_plot_panels_fill_their_lines_with_no_empty_place(count, lines):
    assert report.panel_lines(count) == lines and sum(lines) == count and max(lines) <= report.PANELS_PER_LINE


def test_the_plot_legend_names_every_implementation_measured():
    rows = [row(), row(case="d96", family="other", impls={"flashjit": {"us": 5.0}, "fa3-splits32": {"us": 6.0}})]
    names = report.legend_names(rows, report.plot_points(rows))
    assert ("fa3-splits32", False) in names and ("flashjit", True) in names
    assert [n for n, _ in names] == report.impl_names(rows)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    rows = [row(case="b16 L2048", mean=2048.0), row(), row(case="b1 L8192", batch=1),
            row(case="64 req", batch=64, mean=5000.0, uniform=False)]
    assert report.write_plot(rows, str(path), ceiling_gbs=4200.0, gpu="NVIDIA H200") == f"plot written to {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_are_listed_per_row_and_implementation():
    assert decode.errors_of([row()]) == ["b16 L8192: fa3: RuntimeError: capture failed",
                                         "b16 L8192: sdpa-cudnn: rel error 3.00e-01"]


# ---- the whole loop ---------------------------------------------------------------------------

def test_run_rows_times_prints_and_writes_every_row(stand_ins, monkeypatch, tmp_path, capsys):
    import json

    def reference_flashjit(torch, batch, case, engine, fp8, tensor_cores=None):
        ref = reference(batch, case, fp8)
        info = lambda: {"splits": 1, "work_items": case.batch}  # noqa: E731
        return Impl(Step(lambda: ref.clone(), info=info),
                    lambda: Step(lambda: ref.clone(), before_replay=lambda: None, info=info))

    monkeypatch.setattr(peers, "flashjit_eager_and_graph", reference_flashjit)
    cases = [Case("tiny", 2, 40), Case("tiny e4m3", 2, 40, kv_dtype="float8_e4m3fn", base="tiny"),
             small(name="tiny mixed")]
    bench = decode.Bench(torch, None, FakeTimer(), lambda nbytes: 1.0, 4000.0, lambda: None, fake_capture,
                         device="cpu", planner_us=lambda: 1.25)
    args = types.SimpleNamespace(host_row="^tiny$", cuda_cores=False, peers=".", graph=True, json=str(tmp_path / "out.json"),
                                 plot=str(tmp_path / "out.png"))
    result = decode.run_rows(bench, cases, args, {"device": "cpu"})
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(json.dumps(result))
    rows = {row["case"]: row for row in result["rows"]}
    assert list(rows) == ["tiny", "tiny e4m3", "tiny mixed"]
    for row in rows.values():
        assert {"us", "graph_us", "splits", "graph_splits"} <= set(row["impls"]["flashjit"])
        assert "graph_us" in row["impls"]["flashinfer-tc"] and "graph_us" in row["impls"].get("fa3", {"graph_us": 0})
    assert "fa3" not in rows["tiny e4m3"]["impls"] and "speedup_vs_bf16" in rows["tiny e4m3"]
    assert rows["tiny"]["impls"]["sdpa-cudnn"]["error"].startswith("RuntimeError")  # no cuDNN on the CPU
    assert result["host"]["case"] == "tiny" and result["host"]["run_us"] > 0 and result["host"]["replay_us"] > 0
    assert result["host"]["gpu_planner_us"] == 1.25 and "# GPU planner (CUDA-graph mode, replan()): 1.25 us" in printed
    assert "# host time, tiny: flashjit run()" in printed and "# ERROR tiny: sdpa-cudnn: RuntimeError" in printed
    assert any("FA3 takes an fp8 cache only" in n for n in result["notes"])
    assert "| case | MB | floor µs | flashjit (eager / graph) |" in printed
    assert "plot" in printed.splitlines()[-1]


def test_run_rows_times_only_the_peers_asked_for(stand_ins, monkeypatch, tmp_path):
    def reference_flashjit(torch, batch, case, engine, fp8, tensor_cores=None):
        ref = reference(batch, case, fp8)
        return Impl(Step(lambda: ref.clone(), info=lambda: {"splits": 1, "work_items": case.batch}), None)

    monkeypatch.setattr(peers, "flashjit_eager_and_graph", reference_flashjit)
    bench = decode.Bench(torch, None, FakeTimer(), lambda nbytes: 1.0, 4000.0, lambda: None, fake_capture,
                         device="cpu")
    for pattern, expected in (("^$", {"flashjit"}), ("^flashinfer-tc$", {"flashjit", "flashinfer-tc"})):
        args = types.SimpleNamespace(host_row="^none$", cuda_cores=False, peers=pattern, graph=False, json=None,
                                     plot=None)
        result = decode.run_rows(bench, [Case("tiny", 2, 40)], args, {"device": "cpu"})
        assert set(result["rows"][0]["impls"]) == expected


def test_a_timed_call_starts_after_the_flush_and_a_gpu_hold_so_its_host_work_is_not_timed(monkeypatch):
    """The order the GPU sees each timed call in: flush, hold (a spin), start event, the call's
    kernels, end event; the warm-up calls before are not timed."""
    from benchmarks import timing

    order = []
    event = types.SimpleNamespace(record=lambda: order.append("event"), synchronize=lambda: None,
                                  elapsed_time=lambda other: 0.001)
    cuda = types.SimpleNamespace(Event=lambda enable_timing: event, synchronize=lambda: None,
                                 _sleep=lambda cycles: order.append(f"hold {cycles}"))
    scratch = types.SimpleNamespace(fill_=lambda value: order.append("flush"))
    timer = timing.Timer(types.SimpleNamespace(cuda=cuda, empty=lambda *a, **k: scratch, uint8=None), iters=2)
    monkeypatch.setattr(timing, "WARMUP_S", 0.0)
    timer.median_us(lambda: order.append("call"))
    hold = f"hold {timing.HOLD_CYCLES}"
    assert order == ["flush", "call"] * timing.WARMUP_CALLS + ["flush", hold, "event", "call", "event"] * 2
