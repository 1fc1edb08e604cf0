"""flashjit.integrations.core on the CPU: a framework's cache seen in place, the K/V writer, the
row split, the page tables (host and device forms agree), and StepPlanner's plans (BatchDecode on
the CPU with an injected arch and kernel loader; NVRTC faked: the kernels' code does not matter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashjit.integrations.core.decoders import graph_capacity
from flashjit.integrations.core import (DecodeForm, KVPair, LayerAttention, ReferencePrefill, StepPlanner,
                                        device_page_table, host_page_table, prefill_rows, shared_leading_blocks,
                                        split_kv_cache, split_rows, write_kv)
from flashjit.kernels.worklist_kernel import LoadedKernel

from block_tables import block_table_of

CPU = torch.device("cpu")


def fake_loaded(kernel, device_index) -> LoadedKernel:
    """A kernel 'loaded' at once with an H200's occupancy, without a GPU planner (CPU graph plans run on the host)."""
    packed = 0xD1 if kernel.tiling.packed_entry else None
    return LoadedKernel(None, 0xD0, 0xE0, 2, 132, decode_packed=packed)


def vllm_cache(blocks, block_size, heads, head_dim, dtype=torch.bfloat16, layout="LBNHC", seed=0):
    """(vLLM's per-layer cache view [blocks, heads, block_size, 2 * head_dim], its storage) in a layout."""
    g = torch.Generator().manual_seed(seed)
    if layout == "LBNHC":  # a token's heads one after another
        raw = torch.randn(blocks, block_size, heads, 2 * head_dim, generator=g).to(dtype)
        return raw.permute(0, 2, 1, 3), raw
    raw = torch.randn(blocks, heads, block_size, 2 * head_dim, generator=g).to(dtype)  # LBHNC
    return raw, raw.permute(0, 2, 1, 3)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_split_kv_cache_views_k_and_v_in_place(layout):
    cache, raw = vllm_cache(6, 4, 2, 64, layout=layout)
    pair = split_kv_cache(cache, 64)
    assert pair.k.shape == (6, 4, 2, 64) and pair.k.data_ptr() == raw.data_ptr()
    assert pair.v.data_ptr() == raw.data_ptr() + 64 * raw.element_size()
    natural = raw if layout == "LBNHC" else raw  # raw is [blocks, block_size, heads, 2D] in both views
    assert torch.equal(pair.k, natural[..., :64]) and torch.equal(pair.v, natural[..., 64:])


def test_split_kv_cache_views_fp8_storage_and_refuses_bad_shapes():
    cache = torch.zeros(3, 2, 16, 256, dtype=torch.uint8)
    pair = split_kv_cache(cache, 128, "fp8")
    assert pair.k.dtype == torch.float8_e4m3fn and pair.k.shape == (3, 16, 2, 128)
    assert split_kv_cache(cache, 128, "fp8_e5m2").v.dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache.*2 \\* head_dim = 128"):
        split_kv_cache(cache, 64)
    with pytest.raises(ValueError, match="kv_cache.*1-byte tensor"):
        split_kv_cache(torch.zeros(3, 2, 16, 256, dtype=torch.bfloat16), 128, "fp8")


def test_write_kv_stores_tokens_at_their_slots_and_padding_in_the_null_block():
    cache, raw = vllm_cache(5, 4, 2, 64)
    raw.zero_()
    pair = split_kv_cache(cache, 64)
    key, value = torch.randn(4, 2, 64).bfloat16(), torch.randn(4, 2, 64).bfloat16()
    slots = torch.tensor([9, 17, -1, 2])  # block 2 offset 1, block 4 offset 1, padding, block 0 offset 2
    write_kv(pair, key, value, slots)
    assert torch.equal(pair.k[2, 1], key[0]) and torch.equal(pair.v[4, 1], value[1])
    assert torch.equal(pair.k[0, 2], key[3]) and torch.equal(pair.k[0, 0], key[2])  # padding: the null block's slot 0
    written = {(2, 1), (4, 1), (0, 0), (0, 2)}
    untouched = [(b, s) for b in range(5) for s in range(4) if (b, s) not in written]
    assert all(not pair.k[b, s].any() and not pair.v[b, s].any() for b, s in untouched)


def test_write_kv_quantizes_for_an_fp8_cache():
    cache = torch.zeros(2, 1, 4, 128, dtype=torch.uint8)
    pair = split_kv_cache(cache, 64, "fp8")
    key = torch.linspace(-3, 3, 64).reshape(1, 1, 64).bfloat16()
    write_kv(pair, key, key * 1000, torch.tensor([5]), k_scale=torch.tensor([0.5]), v_scale=2.0)
    assert torch.allclose(pair.k[1, 1, 0].float() * 0.5, key[0, 0].float(), rtol=0.07, atol=0.02)
    assert pair.v[1, 1, 0].float().abs().max() == torch.finfo(torch.float8_e4m3fn).max  # saturated, not NaN
    with pytest.raises(ValueError, match="k_scale"):
        write_kv(pair, key, key, torch.tensor([5]))


def test_split_rows_takes_the_leading_short_rows():
    qsl = torch.tensor([0, 1, 2, 5, 105, 106], dtype=torch.int32)
    rows = split_rows(qsl, 5, 3)
    assert (rows.num_decodes, rows.num_decode_tokens, rows.num_prefills, rows.num_prefill_tokens) == (3, 5, 2, 101)
    assert rows.max_decode_q_len == 3 and not rows.pure_decode
    assert split_rows(qsl, 5, 2).num_decodes == 2  # from the first longer row on, every row is a prefill
    assert split_rows(torch.tensor([0, 1, 1, 1]), 3, 1).pure_decode  # padding rows without tokens
    with pytest.raises(ValueError, match="max_decode_q_len.*1..16"):
        split_rows(qsl, 5, 17)


def test_host_and_device_page_tables_agree():
    rng = np.random.default_rng(1)
    seq = [33, 1, 16, 70, 5]
    q = [1, 1, 2, 1, 40]
    table = block_table_of(seq, 16, 6, rng)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q)]), dtype=torch.int32)
    host = host_page_table(table, torch.tensor(seq), qsl, 4, 16)
    assert host.indptr.tolist() == [0, 3, 4, 5, 10] and host.last_page_len.tolist() == [1, 1, 16, 6]
    assert host.indices.tolist() == [*table[0, :3], table[1, 0], table[2, 0], *table[3, :5]]
    assert host.qo_indptr.tolist() == [0, 1, 2, 4, 5]
    dev = device_page_table(table, torch.tensor(seq, dtype=torch.int32), qsl, 5, 16, 2)  # row 4 is a prefill
    assert dev.indptr.tolist() == host.indptr.tolist() + [10] and dev.batch.tolist() == [5]
    assert dev.last_page_len.tolist() == host.last_page_len.tolist() + [0]
    assert dev.qo_indptr.tolist() == host.qo_indptr.tolist() + [5]
    assert dev.page_ids[:10].tolist() == host.indices.tolist() and not dev.page_ids[10:].any()
    with pytest.raises(ValueError, match="block_table.*at least 5 blocks in row 3"):
        host_page_table(table[:, :4], torch.tensor(seq), qsl, 4, 16)


def test_shared_leading_blocks_counts_common_prefixes():
    indptr = [0, 3, 6, 8]
    ids = torch.tensor([7, 8, 9, 7, 8, 5, 7, 2])
    assert shared_leading_blocks(indptr, ids).tolist() == [2, 1]


@pytest.fixture
def planner_for(engine, fake_nvrtc):
    def make(forms, **options):
        options.setdefault("max_decode_q_len", 2)
        return StepPlanner(forms, CPU, block_size=16, engine=engine, arch="sm_90", load_kernel=fake_loaded,
                           **options)
    return make


FORM = DecodeForm(8, 2, 64, 16, "bfloat16", "bfloat16", 0.125)


def step_inputs(seq, q, table):
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q)]), dtype=torch.int32)
    return dict(query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor(seq, dtype=torch.int32),
                block_table=table, num_reqs=len(seq), num_actual_tokens=int(sum(q)), max_seq_len=max(seq))


def test_step_planner_plans_decode_rows_and_hands_prefill_rows_on(planner_for):
    rng = np.random.default_rng(2)
    seq, q = [40, 17, 300, 90], [1, 2, 60, 1]
    table = block_table_of(seq, 16, 20, rng)
    planner = planner_for([FORM])
    step = planner.plan(**step_inputs(seq, q, table), seq_lens_cpu=torch.tensor(seq))
    decoder = step.decoders[FORM]
    assert decoder is planner.forms[FORM].eager and decoder.batch_size == 2 and decoder.num_tokens == 3
    assert decoder.spec.mask == "causal" and decoder.spec.max_q_len == 2
    p = step.prefill
    assert (p.first_row, p.token_begin, p.token_end, p.max_seqlen_q, p.max_seqlen_k) == (2, 3, 64, 60, 300)
    assert p.cu_seqlens_q.tolist() == [0, 60, 61] and p.seqused_k.tolist() == [300, 90]
    assert torch.equal(p.block_table, table[2:])


def test_step_planner_reads_lengths_only_when_the_host_has_none(planner_for):
    rng = np.random.default_rng(3)
    seq, q = [40, 17], [1, 1]
    planner = planner_for([FORM])
    reads = []
    step = planner.plan(**step_inputs(seq, q, block_table_of(seq, 16, 4, rng)),
                        read_seq_lens=lambda: reads.append(1) or torch.tensor(seq))
    assert reads == [1] and step.decoders[FORM].batch_size == 2


def test_graph_steps_use_one_decoder_per_padded_size(planner_for):
    rng = np.random.default_rng(4)
    planner = planner_for([FORM], max_graph_tokens=8, max_pages=8 * 4)
    seq = [40, 17, 3]
    table = block_table_of(seq, 16, 4, rng)
    step = planner.plan(**step_inputs(seq, [1, 1, 1], table), seq_lens_cpu=torch.tensor(seq),
                        graph_tokens_for=lambda n: 4)
    decoder = step.decoders[FORM]
    assert step.graph_tokens == 4 and step.decode_tokens == 4 and decoder is planner.forms[FORM].graphs[4]
    assert decoder.use_cuda_graph and decoder.graph_page_ids.data_ptr() == planner.page_ids.data_ptr()
    listed = table[0, :3].tolist() + table[1, :2].tolist() + table[2, :1].tolist()
    assert planner.page_ids[:6].tolist() == listed  # the graph decoders read them where the planner wrote them
    again = planner.plan(**step_inputs(seq[:2], [2, 1], table[:2]), seq_lens_cpu=torch.tensor(seq[:2]),
                         graph_tokens_for=lambda n: 3)
    assert again.decoders[FORM] is decoder and decoder.batch_size == 2  # graphs of 3 tokens: the decoder of 4
    assert again.decode_tokens == 3 and [graph_capacity(n) for n in (1, 2, 3, 24, 32, 33)] == [1, 2, 4, 32, 32, 64]
    mixed = planner.plan(**step_inputs([40, 200], [1, 30], table[:2]), seq_lens_cpu=torch.tensor([40, 200]))
    assert mixed.graph_tokens is None and mixed.decoders[FORM] is planner.forms[FORM].eager
    with pytest.raises(ValueError, match="max_graph_tokens"):
        planner.plan(**step_inputs(seq, [1, 1, 1], table), seq_lens_cpu=torch.tensor(seq), graph=True,
                     graph_tokens_for=lambda n: 16)


def test_samples_of_one_prompt_plan_the_shared_prefix_kernel(planner_for):
    rng = np.random.default_rng(5)
    seq = [16 * 8 + 5] * 16
    table = block_table_of(seq, 16, 10, rng, shared=8)
    planner = planner_for([FORM], max_decode_q_len=1)
    step = planner.plan(**step_inputs(seq, [1] * 16, table), seq_lens_cpu=torch.tensor(seq))
    assert step.decoders[FORM].spec.shared_prefix
    pages = host_page_table(table, torch.tensor(seq), torch.arange(17), 16, 16)
    assert shared_leading_blocks(pages.indptr, pages.indices).tolist() == [8] * 15
    alone = planner_for([FORM], max_decode_q_len=1, share_prefixes=False)
    planned = alone.plan(**step_inputs(seq, [1] * 16, table), seq_lens_cpu=torch.tensor(seq))
    assert not planned.decoders[FORM].spec.shared_prefix


def test_forms_prewarm_every_kernel_their_plans_pick(planner_for, fake_nvrtc):
    windowed = DecodeForm(8, 2, 64, 16, "bfloat16", "float8_e4m3fn", 0.125, window_left=127, logits_soft_cap=30.0)
    planner = planner_for([FORM, windowed])
    names = {r.spec.name for r in planner.prewarm("sm_90")}
    assert len(names) == 2 * 2 + 2  # FORM: q1, q2, each with its shared-prefix kernel; windowed: q1, q2
    assert {n for n in names if n.endswith("_sp")} and any("sliding_window-soft_cap" in n for n in names)
    rng = np.random.default_rng(6)
    seq, q = [40, 17], [2, 1]
    planner.plan(**step_inputs(seq, q, block_table_of(seq, 16, 4, rng)), seq_lens_cpu=torch.tensor(seq))
    assert {d.eager.spec.name for d in planner.forms.values()} <= names


def test_layer_attention_refuses_sinks_that_do_not_match_the_form():
    with pytest.raises(ValueError, match="sinks"):
        LayerAttention(FORM, sinks=torch.zeros(8))
    with pytest.raises(ValueError, match="sinks"):
        LayerAttention(DecodeForm(8, 2, 64, 16, "bf16", "bf16", 0.125, has_sinks=True))


def test_reference_prefill_matches_a_dense_causal_attention():
    rng = np.random.default_rng(7)
    seq, q = [5, 37], [3, 20]
    table = block_table_of(seq, 16, 3, rng)
    cache, _ = vllm_cache(int(table.max()) + 1, 16, 2, 64, dtype=torch.float32)
    pair = split_kv_cache(cache, 64)
    inputs = step_inputs(seq, q, table)
    rows = prefill_rows(split_rows(inputs["query_start_loc_cpu"], 2, 1), inputs["query_start_loc"],
                        inputs["query_start_loc_cpu"], inputs["seq_lens"], table, 2, 37, torch.tensor(seq))
    query = torch.randn(23, 8, 64)
    out = ReferencePrefill()(query, pair, torch.empty(23, 8, 64), rows, sm_scale=0.125)
    k = torch.cat([pair.k[b] for b in table[1, :3]])[:37].repeat_interleave(4, dim=1)
    v = torch.cat([pair.v[b] for b in table[1, :3]])[:37].repeat_interleave(4, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query[3:], k) * 0.125
    visible = torch.arange(37)[None, :] <= torch.arange(17, 37)[:, None]
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    assert torch.allclose(out[3:], want, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("cast", ["as probed", "clamped"])
@pytest.mark.parametrize("q_scale", [None, 1.0, 2.0, torch.tensor([2.0])])
def test_quantized_query_saturates_and_divides_by_the_scale(q_scale, cast, kv_dtype, monkeypatch):
    from flashjit.integrations.core import prefill

    if cast == "clamped":  # a torch whose cast does not saturate
        monkeypatch.setattr(prefill, "casts_saturate", lambda *_: False)
    limit = torch.finfo(kv_dtype).max
    q = torch.tensor([3 * limit, -3 * limit, 0.75, -5.5, 1e-3], dtype=torch.bfloat16)
    got = prefill.quantized_query(q, kv_dtype, q_scale)
    scale = 1.0 if q_scale is None else float(q_scale)
    want = (q.float() / scale).clamp(-limit, limit).to(kv_dtype)
    assert got.dtype == kv_dtype
    assert got.float().tolist() == want.float().tolist()
    assert got.float()[:2].tolist() == [limit, -limit]


def test_casts_saturate_probes_the_device_cast_once(monkeypatch):
    from flashjit.integrations.core import prefill

    monkeypatch.setattr(prefill, "_SATURATING_CASTS", {})
    answer = prefill.casts_saturate(CPU, torch.bfloat16, torch.float8_e4m3fn)
    limit = torch.finfo(torch.float8_e4m3fn).max
    direct = torch.tensor([2 * limit], dtype=torch.bfloat16).to(torch.float8_e4m3fn).float().item()
    assert answer == (direct == limit)
    assert list(prefill._SATURATING_CASTS) == [(CPU, torch.bfloat16, torch.float8_e4m3fn)]


@pytest.mark.parametrize("q_scale, want", [(None, None), (1.0, None), (0.5, 0.5), (torch.tensor([0.25]), 0.25)])
def test_fa3_descales_skip_unit_host_scales_and_expand_the_others(q_scale, want):
    from types import SimpleNamespace

    from flashjit.integrations.core.prefill import fa3_descales

    rows = SimpleNamespace(num_rows=3, seqused_k=torch.zeros(3, dtype=torch.int32))
    got = fa3_descales(rows, 2, q_scale, torch.tensor([0.5]), None)
    assert got["v_descale"] is None and got["k_descale"].shape == (3, 2)
    if want is None:
        assert got["q_descale"] is None
    else:
        assert got["q_descale"].shape == (3, 2) and torch.all(got["q_descale"] == want)


def test_fa3_descales_expand_per_kv_head_scales_head_by_head():
    from types import SimpleNamespace

    from flashjit.integrations.core.prefill import fa3_descales

    rows = SimpleNamespace(num_rows=3, seqused_k=torch.zeros(3, dtype=torch.int32))
    got = fa3_descales(rows, 2, torch.tensor([0.5, 2.0]), torch.tensor([0.25, 4.0]), torch.tensor([0.125]))
    assert got["q_descale"].tolist() == [[0.5, 2.0]] * 3 and got["k_descale"].tolist() == [[0.25, 4.0]] * 3
    assert got["v_descale"].tolist() == [[0.125, 0.125]] * 3


def test_reference_prefill_scales_e4m3_queries_per_kv_head():
    cache = KVPair(*(torch.randn(4, 16, 2, 64).to(torch.float8_e4m3fn) for _ in range(2)))
    rows = prefill_rows_for_test()
    q8 = torch.randn(5, 8, 64).to(torch.float8_e4m3fn)  # 8 query heads over 2 KV heads: groups of 4
    per_head, spelled_out = (torch.zeros(5, 8, 64, dtype=torch.bfloat16) for _ in range(2))
    ReferencePrefill()(q8, cache, per_head, rows, sm_scale=0.125, q_scale=torch.tensor([0.5, 2.0]), k_scale=1.0,
                       v_scale=1.0)
    scales = torch.tensor([0.5] * 4 + [2.0] * 4).view(1, 8, 1)
    ReferencePrefill()(q8.float() * scales, cache, spelled_out, rows, sm_scale=0.125, k_scale=1.0, v_scale=1.0)
    assert torch.equal(per_head, spelled_out)


def test_fa3_forward_args_place_names_in_the_ops_order_and_refuse_unknown_ones():
    from flashjit.integrations.core.prefill import FA3_FORWARD_ARGS, fa3_forward_args

    args = fa3_forward_args(q="Q", out_="OUT", page_table="TABLE", sinks="SINKS", num_splits=3)
    assert len(args) == len(FA3_FORWARD_ARGS) == 35
    named = dict(zip(FA3_FORWARD_ARGS, args))
    assert (args[0], args[6], args[14], args[-1]) == ("Q", "OUT", "TABLE", "SINKS")
    assert (named["num_splits"], named["rotary_interleaved"], named["window_size_left"]) == (3, True, -1)
    assert named["k_new"] is None
    with pytest.raises(TypeError, match="window_size"):
        fa3_forward_args(window_size=(-1, 0))


@pytest.mark.parametrize("kind, out_dtype", [("bf16", torch.bfloat16), ("fp8", torch.bfloat16), ("fp8", torch.float16)])
def test_fa3_prefill_writes_the_rows_in_place_with_fp8_queries_over_an_fp8_cache(kind, out_dtype):
    from types import SimpleNamespace

    from flashjit.integrations.core import Fa3KVCachePrefill
    from flashjit.integrations.core.prefill import FA3_FORWARD_ARGS

    calls = []

    def fwd(*args):
        named = dict(zip(FA3_FORWARD_ARGS, args))
        named["out_"].fill_(2.0)  # FA3 writes its rows into the given out
        calls.append(named)

    fa3 = SimpleNamespace(flash_attn_3_gpu=SimpleNamespace(fwd=fwd))
    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    cache = KVPair(torch.zeros(4, 16, 2, 64, dtype=dtype), torch.zeros(4, 16, 2, 64, dtype=dtype))
    rows = SimpleNamespace(num_rows=1, seqused_k=torch.tensor([20], dtype=torch.int32), max_seqlen_q=5,
                           cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32), block_table=torch.tensor([[3, 1]]))
    q, out = torch.randn(5, 8, 64).to(out_dtype), torch.zeros(5, 8, 64, dtype=out_dtype)
    sinks = torch.tensor([0.5, 1.25, -2.0, 3.0, 0.0, 1.0, 2.0, 4.0])
    Fa3KVCachePrefill(fa3)(q, cache, out, rows, sm_scale=0.125, window_left=7, k_scale=torch.tensor([0.5]), sinks=sinks)
    call = calls[0]
    assert call["sinks"].dtype == torch.bfloat16 and call["sinks"].float().tolist() == sinks.tolist()
    assert torch.all(out == 2.0)
    assert (call["out_"] is out) == (out_dtype == torch.bfloat16)  # fp8 queries give bf16: a copy for fp16 outputs
    assert call["q"].dtype == dtype and call["page_table"] is rows.block_table
    assert (call["causal"], call["window_size_left"], call["window_size_right"], call["softmax_scale"]) == (True, 7, 0,
                                                                                                          0.125)
    assert (call["k_descale"] is not None) == (kind == "fp8") and call["q_descale"] is None


# ---- MLA ------------------------------------------------------------------------------------------

def fake_mla_loaded(kernel, device_index) -> LoadedKernel:
    return LoadedKernel(None, 0xD0, None, 1, 132)


def test_mla_decoders_plan_eager_and_graph_steps_from_a_block_table(engine, fake_nvrtc):
    from flashjit.integrations.core.mla import MLADecoders, MLAForm, latent_cache

    form = MLAForm(16, 64, "bfloat16", "bfloat16", 0.1352)
    buffer = torch.zeros(4 * 10, dtype=torch.int32)
    decoders = MLADecoders(form, CPU, max_decode_q_len=2, engine=engine, page_ids_buffer=buffer, arch="sm_90",
                           load_kernel=fake_mla_loaded)
    assert {r.spec.name for r in decoders.prewarm("sm_90")} == {
        "mla_c512_r64_h16_bf16_kvbf16_p64_q1_sm90", "mla_c512_r64_h16_bf16_kvbf16_p64_q2_sm90"}
    rng = np.random.default_rng(8)
    seq, q = [300, 65, 1], [2, 1, 1]
    table = block_table_of(seq, 64, 6, rng)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q)]), dtype=torch.int32)
    eager = decoders.plan_eager(host_page_table(table, torch.tensor(seq), qsl, 3, 64))
    assert eager.current_plan.spec.max_q_len == 2 and eager.current_plan.num_tokens == 4
    graph = decoders.plan_graph(3, host_page_table(table, torch.tensor(seq), qsl, 3, 64, out_indices=buffer))
    assert graph is decoders.graphs[4] and buffer[:7].tolist() == table[0, :5].tolist() + [table[1, 0], table[1, 1]]
    cache = torch.zeros(10, 64, 576, dtype=torch.uint8)
    assert latent_cache(cache, "fp8").dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_c_and_k_pe_cache.*576"):
        latent_cache(torch.zeros(10, 64, 512))
    with pytest.raises(ValueError, match="max_decode_q_len.*1..4"):
        MLADecoders(form, CPU, max_decode_q_len=5, engine=engine, arch="sm_90", load_kernel=fake_mla_loaded)


def test_a_layer_whose_form_was_not_planned_is_refused_naming_it(planner_for):
    rng = np.random.default_rng(9)
    seq = [40, 17]
    step = planner_for([FORM]).plan(**step_inputs(seq, [1, 1], block_table_of(seq, 16, 4, rng)),
                                    seq_lens_cpu=torch.tensor(seq))
    other = LayerAttention(DecodeForm(8, 2, 64, 16, "bfloat16", "bfloat16", 0.125, window_left=63))
    cache, _ = vllm_cache(100, 16, 2, 64)
    with pytest.raises(RuntimeError, match="window_left=63"):
        other.forward(step, torch.zeros(2, 8, 64).bfloat16(), cache, torch.zeros(2, 8, 64).bfloat16())


# ---- e4m3 queries (vLLM's query_quant over an fp8 cache) --------------------------------------------

FP8_QUERY_FORM = DecodeForm(8, 2, 64, 16, "bfloat16", "float8_e4m3fn", 0.125, fp8_queries=True)


def test_an_fp8_query_form_plans_and_prewarms_e4m3_query_kernels(planner_for):
    planner = planner_for([FP8_QUERY_FORM], max_graph_tokens=4, max_pages=16)
    names = {r.spec.name for r in planner.prewarm("sm_90")}
    assert names and all(name.endswith("_fp8q") for name in names)
    rng = np.random.default_rng(7)
    seq = [40, 17]
    table = block_table_of(seq, 16, 4, rng)
    for graph in (False, True):
        step = planner.plan(**step_inputs(seq, [2, 1], table), seq_lens_cpu=torch.tensor(seq), graph=graph)
        decoder = step.decoders[FP8_QUERY_FORM]
        assert decoder.spec.query_fp8 and decoder.spec.name in names
        assert decoder.query_form() == (torch.float8_e4m3fn, 8, 64, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e5m2"])
def test_fp8_queries_need_an_e4m3_cache(kv_dtype):
    with pytest.raises(ValueError, match=f"fp8_queries: expected False, or True over a float8_e4m3fn cache "
                                         f"\\(kv_dtype {kv_dtype}\\)"):
        DecodeForm(8, 2, 64, 16, "bfloat16", kv_dtype, 0.125, fp8_queries=True)


def test_the_query_scale_joins_k_scale_for_e4m3_queries():
    layer = LayerAttention(FP8_QUERY_FORM)
    k_scale = torch.tensor([0.5])
    assert layer._k_scale_with_query(k_scale, None) is k_scale and layer._k_scale_with_query(k_scale, 1.0) is k_scale
    assert layer._k_scale_with_query(0.5, 0.25) == 0.125
    folded = layer._k_scale_with_query(k_scale, 0.25)
    assert folded.tolist() == [0.125] and folded.dtype == torch.float32
    assert layer._k_scale_with_query(k_scale, 0.25) is folded  # kept while neither changes
    k_scale.mul_(2)  # a new value in place (vLLM's calibrated scales): the product follows
    assert layer._k_scale_with_query(k_scale, 0.25).tolist() == [0.25]
    per_head = layer._k_scale_with_query(torch.tensor([0.5, 1.0]), torch.tensor(2.0))
    assert per_head.tolist() == [1.0, 2.0]


def test_fa3_prefill_takes_e4m3_queries_as_given_with_their_scale():
    from types import SimpleNamespace

    from flashjit.integrations.core import Fa3KVCachePrefill
    from flashjit.integrations.core.prefill import FA3_FORWARD_ARGS

    calls = []
    fa3 = SimpleNamespace(flash_attn_3_gpu=SimpleNamespace(fwd=lambda *a: calls.append(dict(zip(FA3_FORWARD_ARGS, a)))))
    cache = KVPair(*(torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2)))
    rows = prefill_rows_for_test()
    q = torch.randn(5, 8, 64).to(torch.float8_e4m3fn)
    Fa3KVCachePrefill(fa3)(q, cache, torch.zeros(5, 8, 64, dtype=torch.bfloat16), rows, sm_scale=0.125, q_scale=0.5,
                           k_scale=torch.tensor([0.25]), v_scale=1.0)
    call = calls[0]
    assert call["q"] is q  # no cast: vLLM quantized them
    assert call["q_descale"].tolist() == [[0.5, 0.5]] and call["v_descale"] is None


def test_reference_prefill_reads_e4m3_queries_times_their_scale():
    cache = KVPair(*(torch.randn(4, 16, 2, 64).to(torch.float8_e4m3fn) for _ in range(2)))
    rows = prefill_rows_for_test()
    q8 = torch.randn(5, 8, 64).to(torch.float8_e4m3fn)
    out8, out16 = (torch.zeros(5, 8, 64, dtype=torch.bfloat16) for _ in range(2))
    ReferencePrefill()(q8, cache, out8, rows, sm_scale=0.125, q_scale=0.5, k_scale=1.0, v_scale=1.0)
    ReferencePrefill()(q8.float() * 0.5, cache, out16, rows, sm_scale=0.125, k_scale=1.0, v_scale=1.0)
    assert torch.equal(out8, out16) and out8.abs().sum() > 0


def prefill_rows_for_test():
    from types import SimpleNamespace

    return SimpleNamespace(num_rows=1, seqused_k=torch.tensor([20], dtype=torch.int32), max_seqlen_q=5,
                           cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                           cu_seqlens_q_cpu=torch.tensor([0, 5], dtype=torch.int32), block_table=torch.tensor([[3, 1]]))
