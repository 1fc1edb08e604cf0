"""flashjit's vLLM backend on the GPU, through its framework-free core (the GPU machine has no
vLLM: its wheel pins another torch): batches shaped like vLLM's attention tests' BATCH_SPECS
(small, medium and large decodes, mixed prefill + decode, speculative 1 + k rows, one long
decode), a cache in vLLM's LBNHC layout with shuffled blocks (block 0 the null block), bf16 and
fp8, sliding window, sinks and soft-cap; every row against the float32 reference, eager and in
CUDA graphs replayed after new batch compositions.

The new tokens' K/V go into the cache through the backend's writer (slot_mapping), so the
reference reads what the writer stored. Prefill rows run on FlashAttention 3 (tokenspeed-fa3's
flash_attn_interface, the FA3 vLLM ships) where it imports and takes the case, else on the
reference; test_prefill_kernel_in_use prints which."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import flashjit
from flashjit.integrations.core import (DecodeForm, LayerAttention, ReferencePrefill, StepPlanner, default_prefill,
                                        host_page_table, split_kv_cache)
from flashjit.serving.quantize import dequantize_kv
from flashjit.serving.reference import decode_reference

from block_tables import block_table_of

from .batches import rel_error

BLOCK, HEADS, KV_HEADS, DIM = 16, 32, 8, 128
NUM_BLOCKS = 8192  # block 0 is vLLM's null block: no request owns it
TOLERANCE = {"bf16": 1e-2, "fp8": 2e-2}
FP8_PREFILL_TOLERANCE = 8e-2  # FA3 quantizes the prefill rows' queries to e4m3 too
CUDA = torch.device("cuda")

# name: (seq_lens, query_lens, the reorder threshold: 1, or 1 + k with k speculative tokens), as
# vLLM's tests/v1/attention BATCH_SPECS
BATCH_SPECS = {
    "small_decode": ([32, 40], [1, 1], 1),
    "medium_decode": ([128, 256, 512, 1024, 128, 256, 512, 1024], [1] * 8, 1),
    "large_decode": ([2048] * 32, [1] * 32, 1),
    "mixed_small": ([32, 48, 64, 80], [1, 1, 5, 5], 1),
    "mixed_medium": ([512, 1024, 2048, 512, 1024, 2048], [1, 1, 1, 7, 7, 7], 1),
    "mixed_large": ([1024, 2048, 4096, 1024, 2048, 4096], [1, 1, 1, 32, 32, 32], 1),
    "single_long_decode": ([32768], [1], 1),
    "spec_1_plus_3": ([300, 1000, 2000, 65], [4, 4, 4, 4], 4),
    "spec_mixed": ([300, 1000, 2000, 3000], [4, 2, 3, 200], 4),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return flashjit.Engine(cache_dir=tmp_path_factory.mktemp("vllm-backend-kernels"))


@pytest.fixture(scope="module")
def prefill_kernel():
    return default_prefill()


def test_prefill_kernel_in_use(prefill_kernel, capsys):
    with capsys.disabled():
        print(f"\nprefill rows run on: {prefill_kernel.name}")
    assert prefill_kernel.name in ("fa3", "reference")


@dataclasses.dataclass
class Case:
    form: DecodeForm
    cache_dtype: str  # vLLM's name
    kv_cache: torch.Tensor  # vLLM's per-layer view [blocks, kv_heads, block, 2 * head_dim]
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    sinks: torch.Tensor | None
    q_scale: float | torch.Tensor | None = None  # e4m3 queries (vLLM's query_quant): true queries / q_scale


def make_case(kind="bf16", *, window=None, soft_cap=None, sinks=False, head_dim=DIM, heads=HEADS, seed=0) -> Case:
    """kind: "bf16", "fp8" (an e4m3 cache, bf16 queries), "fp8q" (an e4m3 cache, e4m3 queries) or
    "fp8q_per_head" (that, with a scale per KV head for K, V and the queries)."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    raw = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, 2 * head_dim, generator=g, device=CUDA)  # LBNHC storage
    k_scale = v_scale = None
    if kind.startswith("fp8"):
        k_scale = torch.tensor([0.02], device=CUDA)  # ~4 sigma of the values reaches e4m3's 448 / 0.02
        v_scale = torch.tensor([0.015], device=CUDA)
        if kind == "fp8q_per_head":
            k_scale = torch.linspace(0.015, 0.03, KV_HEADS, device=CUDA)
            v_scale = torch.linspace(0.03, 0.012, KV_HEADS, device=CUDA)
        per_head = lambda scale: scale.view(1, 1, -1, 1)  # noqa: E731 (storage [blocks, block, heads, 2 * dim])
        quant = torch.cat([raw[..., :head_dim] / per_head(k_scale), raw[..., head_dim:] / per_head(v_scale)], dim=-1)
        raw = quant.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        kv_dtype, cache_dtype = "float8_e4m3fn", "fp8"
    else:
        raw = raw.bfloat16()
        kv_dtype, cache_dtype = "bfloat16", "auto"
    form = DecodeForm(heads, KV_HEADS, head_dim, BLOCK, "bfloat16", kv_dtype, head_dim ** -0.5,
                      window_left=None if window is None else window - 1, logits_soft_cap=soft_cap, has_sinks=sinks,
                      fp8_queries=kind.startswith("fp8q"))
    sink_values = torch.randn(heads, generator=g, device=CUDA) * 2 if sinks else None
    q_scale = {"fp8q": 0.5, "fp8q_per_head": torch.linspace(0.25, 1.0, KV_HEADS, device=CUDA)}.get(kind)
    # (not 1: the decode rows fold it into K's scale)
    return Case(form, cache_dtype, raw.permute(0, 2, 1, 3), k_scale, v_scale, sink_values, q_scale)


def vllm_step(seq_lens, query_lens, rng, *, shared_blocks=0):
    """CommonAttentionMetadata's tensors for a batch: shuffled blocks from 1 on, the new tokens' slots."""
    width = max(-(-s // BLOCK) for s in seq_lens) + 2
    table = block_table_of(seq_lens, BLOCK, width, rng, shared=shared_blocks, num_blocks=NUM_BLOCKS).numpy()
    slots = []
    for r, (s, q) in enumerate(zip(seq_lens, query_lens)):
        positions = np.arange(s - q, s)
        slots.extend(table[r, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return dict(query_start_loc=torch.from_numpy(qsl).to(CUDA), query_start_loc_cpu=torch.from_numpy(qsl),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=CUDA),
                block_table=torch.from_numpy(table).to(CUDA), num_reqs=len(seq_lens),
                num_actual_tokens=int(sum(query_lens)), max_seq_len=max(seq_lens)), torch.tensor(slots, device=CUDA)


def new_tokens(case: Case, tokens: int, seed: int):
    """(q as the layer gets it, q as the reference reads it, k, v); e4m3 queries as vLLM quantizes them."""
    g = torch.Generator(device=CUDA).manual_seed(1000 + seed)
    f = case.form
    q = torch.randn(tokens, f.num_qo_heads, f.head_dim, generator=g, device=CUDA).bfloat16()
    k = torch.randn(tokens, f.num_kv_heads, f.head_dim, generator=g, device=CUDA).bfloat16()
    v = torch.randn(tokens, f.num_kv_heads, f.head_dim, generator=g, device=CUDA).bfloat16()
    if case.q_scale is None:
        return q, q, k, v
    scale = torch.as_tensor(case.q_scale, device=CUDA).reshape(-1)  # per tensor, or per KV head's query heads
    scale = scale.repeat_interleave(f.num_qo_heads // scale.numel()).view(1, -1, 1)
    q8 = (q.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q8, q8.float() * scale, k, v


def reference(case: Case, step_inputs, q):
    """Every row's float32 reference over the cache as it is now (the writer's tokens included)."""
    pair = split_kv_cache(case.kv_cache, case.form.head_dim, case.cache_dtype)
    k, v = pair.k, pair.v
    if case.form.kv_is_fp8:
        k, v = dequantize_kv(k, case.k_scale), dequantize_kv(v, case.v_scale)
    seq_cpu = step_inputs["seq_lens"].cpu()
    table = host_page_table(step_inputs["block_table"], seq_cpu, step_inputs["query_start_loc_cpu"],
                            step_inputs["num_reqs"], BLOCK)
    f = case.form
    mask, params = ("causal", None) if f.window_left is None else ("sliding_window", {"window_left": f.window_left})
    variant, vparams = "none", {}
    if f.capped:
        variant, vparams = "soft_cap", {"logits_soft_cap": f.logits_soft_cap}
    if f.has_sinks:
        variant = "soft_cap_sinks" if f.capped else "sinks"
        vparams["sinks"] = case.sinks
    out, _ = decode_reference(q, k, v, table.indptr, table.indices, table.last_page_len, qo_indptr=table.qo_indptr,
                              mask=mask, mask_params=params, sm_scale=f.sm_scale, variant=variant,
                              variant_params=vparams)
    return out


def check_rows(case: Case, step_inputs, out, want, num_decode_tokens: int, label: str):
    qsl = step_inputs["query_start_loc_cpu"].tolist()
    kind = "fp8" if case.form.kv_is_fp8 else "bf16"
    for r in range(step_inputs["num_reqs"]):
        a, b = qsl[r], qsl[r + 1]
        prefill = a >= num_decode_tokens
        tolerance = FP8_PREFILL_TOLERANCE if prefill and kind == "fp8" else TOLERANCE[kind]
        error = rel_error(out[a:b].float(), want[a:b])
        assert error < tolerance, f"{label}: row {r} ({'prefill' if prefill else 'decode'}) rel error {error:.3g}"


def layer_for(case: Case, prefill_kernel):
    # tokenspeed-fa3 is built without soft-capping (flash_attn_config), and sinks over an fp8 cache
    # are no path vLLM's FA3 tests either: those prefill rows take the reference (the decode rows,
    # flashjit's, are what these tests check).
    fa3_lacks = case.form.capped or (case.form.has_sinks and case.form.kv_is_fp8)
    prefill = ReferencePrefill() if fa3_lacks else prefill_kernel
    return LayerAttention(case.form, cache_dtype=case.cache_dtype, prefill=prefill, sinks=case.sinks)


def planner_for(case: Case, engine, max_decode_q_len: int, **options) -> StepPlanner:
    return StepPlanner([case.form], CUDA, block_size=BLOCK, max_decode_q_len=max_decode_q_len, engine=engine, **options)


def run_step(case, layer, planner, inputs, slots, seed, **plan_options):
    """(the reference's queries, the layer's output, the step)."""
    q, q_ref, k, v = new_tokens(case, inputs["num_actual_tokens"], seed)
    layer.write_kv(case.kv_cache, k, v, slots, case.k_scale, case.v_scale)
    step = planner.plan(**inputs, seq_lens_cpu=inputs["seq_lens"].cpu(), **plan_options)
    out = torch.zeros_like(q, dtype=torch.bfloat16)
    layer.forward(step, q, case.kv_cache, out, q_scale=case.q_scale, k_scale=case.k_scale, v_scale=case.v_scale)
    torch.cuda.synchronize()
    return q_ref, out, step


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8q", "fp8q_per_head"])
@pytest.mark.parametrize("spec_name", list(BATCH_SPECS))
def test_batch_specs_eager(spec_name, kind, engine, prefill_kernel):
    seq_lens, query_lens, threshold = BATCH_SPECS[spec_name]
    case = make_case(kind, seed=1)
    layer = layer_for(case, prefill_kernel)
    planner = planner_for(case, engine, threshold)
    inputs, slots = vllm_step(seq_lens, query_lens, np.random.default_rng(2))
    q, out, step = run_step(case, layer, planner, inputs, slots, seed=3)
    check_rows(case, inputs, out, reference(case, inputs, q), step.rows.num_decode_tokens, f"{spec_name}/{kind}")


@pytest.mark.parametrize("variant", ["sliding_window", "sinks", "soft_cap", "window_sinks_fp8"])
@pytest.mark.parametrize("spec_name", ["medium_decode", "mixed_medium", "spec_1_plus_3"])
def test_variants_eager(spec_name, variant, engine, prefill_kernel):
    seq_lens, query_lens, threshold = BATCH_SPECS[spec_name]
    options = {"sliding_window": dict(window=128), "sinks": dict(sinks=True, head_dim=64, heads=64),
               "soft_cap": dict(soft_cap=30.0), "window_sinks_fp8": dict(window=256, sinks=True, head_dim=64,
                                                                         heads=64)}[variant]
    case = make_case("fp8" if variant.endswith("fp8") else "bf16", seed=4, **options)
    layer = layer_for(case, prefill_kernel)
    planner = planner_for(case, engine, threshold)
    inputs, slots = vllm_step(seq_lens, query_lens, np.random.default_rng(5))
    q, out, step = run_step(case, layer, planner, inputs, slots, seed=6)
    check_rows(case, inputs, out, reference(case, inputs, q), step.rows.num_decode_tokens, f"{spec_name}/{variant}")


def test_samples_of_one_prompt_share_its_blocks(engine, prefill_kernel):
    case = make_case("bf16", seed=7)
    layer = layer_for(case, prefill_kernel)
    planner = planner_for(case, engine, 1)
    seq_lens = [8192 + 37] * 16
    inputs, slots = vllm_step(seq_lens, [1] * 16, np.random.default_rng(8), shared_blocks=8192 // BLOCK)
    q, out, step = run_step(case, layer, planner, inputs, slots, seed=9)
    assert step.decoders[case.form].spec.shared_prefix
    check_rows(case, inputs, out, reference(case, inputs, q), 16, "n=16 shared prompt")


GRAPH_COMPOSITIONS = [  # (seq_lens, query_lens) replayed in one graph of 16 tokens
    ([100, 2000, 35, 4096], [1, 1, 1, 1]),
    ([5000] * 16, [1] * 16),
    ([17, 1, 300], [1, 1, 1]),
    ([8000 + 11] * 8, [1] * 8),  # one prompt's samples: shared blocks
    ([64, 3000, 9000, 1500, 250, 1, 2, 3, 4, 5], [1] * 10),
]
SPEC_GRAPH_COMPOSITIONS = [
    ([100, 2000, 35, 4096], [4, 4, 4, 4]),
    ([3000, 64], [4, 2]),  # rows with fewer drafts in a graph of 4-token rows
    ([700, 800, 900], [1, 3, 4]),
]


@pytest.mark.parametrize("kind, share, lengths_on_host", [("bf16", True, True), ("bf16", False, False),
                                                          ("fp8", True, False), ("fp8", False, True),
                                                          ("fp8q", False, False), ("fp8q_per_head", False, True)])
@pytest.mark.parametrize("speculative", [False, True])
def test_graph_replays_after_new_compositions(kind, share, lengths_on_host, speculative, engine, prefill_kernel):
    compositions = SPEC_GRAPH_COMPOSITIONS if speculative else GRAPH_COMPOSITIONS
    q_len = 4 if speculative else 1
    case = make_case(kind, seed=10)
    layer = layer_for(case, prefill_kernel)
    size = 16
    planner = planner_for(case, engine, q_len, max_graph_tokens=size, max_pages=size * (9100 // BLOCK + 2),
                          share_prefixes=share)
    rng = np.random.default_rng(11)
    q_dtype = torch.float8_e4m3fn if case.form.fp8_queries else torch.bfloat16
    q_buf = torch.zeros(size, case.form.num_qo_heads, case.form.head_dim, dtype=q_dtype, device=CUDA)
    out_buf = torch.zeros_like(q_buf, dtype=torch.bfloat16)
    scales = dict(q_scale=case.q_scale, k_scale=case.k_scale, v_scale=case.v_scale)

    def plan(inputs):
        return planner.plan(**inputs, seq_lens_cpu=inputs["seq_lens"].cpu() if lengths_on_host else None,
                            graph=True, graph_tokens_for=lambda n: size)

    inputs, _ = vllm_step(*compositions[0], rng)
    step = plan(inputs)  # makes the size's decoder and plans it, outside the capture
    layer.forward(step, q_buf, case.kv_cache, out_buf, **scales)  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.forward(step, q_buf, case.kv_cache, out_buf, **scales)
    for n, (seq_lens, query_lens) in enumerate(compositions + compositions[:1]):
        shared = 8000 // BLOCK if len(set(seq_lens)) == 1 and len(seq_lens) > 1 else 0
        inputs, slots = vllm_step(seq_lens, query_lens, rng, shared_blocks=shared)
        q, q_ref, k, v = new_tokens(case, inputs["num_actual_tokens"], seed=20 + n)
        layer.write_kv(case.kv_cache, k, v, slots, case.k_scale, case.v_scale)
        step = plan(inputs)
        assert step.decoders[case.form] is planner.forms[case.form].graphs[size]
        q_buf.zero_()
        q_buf[: q.shape[0]].copy_(q)
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        label = f"graph {kind} share={share} host={lengths_on_host} composition {n}"
        check_rows(case, inputs, out_buf[: q.shape[0]], reference(case, inputs, q_ref), q.shape[0], label)
