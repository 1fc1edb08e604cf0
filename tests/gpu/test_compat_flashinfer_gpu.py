"""flashjit.compat.flashinfer against real FlashInfer 0.6 (skipped where it does not import).

Each comparison runs the same code twice, once with `flashinfer` and once with
`flashjit.compat.flashinfer` as the module: the drop-in promise. Tolerances are FlashInfer's own
decode tests' (1e-3 in fp16, 1e-2 in bf16); the LSE is compared in base 2, and once against
flashjit's float32 reference (natural log) times log2(e), so base 2 is checked independently of
FlashInfer. The CUDA-graph tests write page ids into paged_kv_indices_buffer on the GPU in place
(as vLLM's own kernel does), re-plan, replay, and compare with FlashInfer run eagerly on the same table.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from flashjit.compat import flashinfer as compat
from flashjit.serving.plan_setup import LOG2E
from flashjit.serving.quantize import quantize_kv
from flashjit.serving.reference import decode_reference

from .batches import assert_exact, make_batch, tolerance

flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer (the reference) does not import here")

HEADS, KV_HEADS = 16, 4
KV_LENS = [1, 54, 97, 512, 2048, 5000, 16, 300]


@pytest.fixture(scope="module")
def workspace():
    return torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")


def decode_with(module, workspace, batch, kv_cache, plan_options=None, run_options=None, **wrapper_options):
    """One wrapper of `module` planned over the batch and run once: (out, base-2 lse)."""
    wrapper = module.BatchDecodeWithPagedKVCacheWrapper(workspace, batch.kv_layout, **wrapper_options)
    wrapper.plan(batch.indptr, batch.indices, batch.last_page_len, HEADS, KV_HEADS, batch.q.shape[-1],
                 batch.page_size, **(plan_options or {}))
    return wrapper.run(batch.q, kv_cache, return_lse=True, **(run_options or {}))


def assert_close(actual, expected, dtype):
    """Every (token, head) row of the two within the bound the query dtype gives one kernel
    (flashjit.serving.exactness), the base-2 LSEs within its LSE bound."""
    (out, lse), (ref_out, ref_lse) = actual, expected
    assert_exact(out, lse, ref_out.float(), ref_lse, tolerance(dtype))


def cache_form(batch, form):
    if form == "tuple":
        return batch.k_cache, batch.v_cache
    return torch.stack([batch.k_cache, batch.v_cache], dim=1)  # [pages, 2, ...]


# Where ours follows FlashInfer 0.7 over 0.6: run()'s q_len_per_req defaults to None ("the plan's"; 0.6: 1),
# and fast_decode_plan's global_override_indptr_cpu comes after 0.7's new q_len_per_req.
CHANGED_DEFAULTS = {("run", "q_len_per_req")}
CHANGED_POSITIONS = {("fast_decode_plan", "global_override_indptr_cpu")}


def test_signatures_take_every_call_flashinfers_take():
    """Every argument of the installed FlashInfer's wrappers is ours too, at the same position where
    it may be positional, with the same default. 0.7's plan() takes its options through *args and
    **kwargs: they are read from its _plan_impl (their positional order is a CPU test's)."""
    pairs = [(compat.BatchDecodeWithPagedKVCacheWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper),
             (compat.CUDAGraphBatchDecodeWithPagedKVCacheWrapper, flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper)]
    for ours, theirs in pairs:
        for name in ("__init__", "plan", "run", "forward", "forward_return_lse", "reset_workspace_buffer"):
            if name in vars(theirs):
                _assert_accepts(name, getattr(ours, name), getattr(theirs, name))
    _assert_accepts("fast_decode_plan", compat.fast_decode_plan, flashinfer.fast_decode_plan)


def _assert_accepts(name, ours, theirs):
    given = list(inspect.signature(inspect.unwrap(theirs)).parameters.values())
    if name == "plan" and any(p.kind is p.VAR_POSITIONAL for p in given):
        impl = inspect.unwrap(flashinfer.BatchDecodeWithPagedKVCacheWrapper._plan_impl)
        given = list(inspect.signature(impl).parameters.values())
    mine = inspect.signature(ours).parameters
    positional = [p.name for p in mine.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    for index, p in enumerate(given):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        assert p.name in mine, (name, p.name)
        if p.kind is p.POSITIONAL_OR_KEYWORD and (name, p.name) not in CHANGED_POSITIONS:
            assert positional.index(p.name) == index, (name, p.name, "position")
        if p.default is not p.empty and (name, p.name) not in CHANGED_DEFAULTS:
            assert mine[p.name].default == p.default, (name, p.name)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["tuple", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_outputs_and_base_2_lse_match_flashinfer(workspace, kv_layout, form, dtype):
    batch = make_batch(KV_LENS, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16, dtype=dtype,
                       kv_layout=kv_layout, seed=1)
    kv_cache = cache_form(batch, form)
    options = {"q_data_type": dtype, "kv_data_type": dtype}
    ours = decode_with(compat, workspace, batch, kv_cache, options)
    assert_close(ours, decode_with(flashinfer, workspace, batch, kv_cache, options), dtype)
    ref, natural = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                    batch.last_page_len, kv_layout=kv_layout)
    assert_exact(ours[0], ours[1] / LOG2E, ref, natural, tolerance(dtype), "against the float32 reference")


@pytest.mark.parametrize("head_dim", [64, 256])
def test_other_head_dims_match_flashinfer(workspace, head_dim):
    batch = make_batch(KV_LENS, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=head_dim, page_size=16,
                       dtype=torch.float16, seed=2)
    kv_cache = cache_form(batch, "tuple")
    options = {"data_type": torch.float16}  # the deprecated argument, as FlashInfer's own docstring plans
    assert_close(decode_with(compat, workspace, batch, kv_cache, options),
                 decode_with(flashinfer, workspace, batch, kv_cache, options), torch.float16)


def test_page_size_1_caches_without_the_page_dimension_match_flashinfer(workspace):
    batch = make_batch([1, 37, 300], num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=1,
                       dtype=torch.float16, seed=3)
    kv_cache = (batch.k_cache[:, 0], batch.v_cache[:, 0])  # [pages, kv_heads, head_dim]
    assert_close(decode_with(compat, workspace, batch, kv_cache), decode_with(flashinfer, workspace, batch, kv_cache),
                 torch.float16)


@pytest.mark.parametrize("window_left", [0, 255])
def test_window_left_matches_flashinfer(workspace, window_left):
    batch = make_batch(KV_LENS, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.float16, seed=4)
    kv_cache = cache_form(batch, "stacked")
    options = {"window_left": window_left}
    assert_close(decode_with(compat, workspace, batch, kv_cache, options),
                 decode_with(flashinfer, workspace, batch, kv_cache, options), torch.float16)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_fp8_e4m3_cache_with_scales_matches_flashinfer(workspace, kv_layout):
    batch = make_batch(KV_LENS[1:], num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.float16, kv_layout=kv_layout, seed=5)
    (k, k_scale), (v, v_scale) = (quantize_kv(c, "float8_e4m3fn", kv_layout=kv_layout)
                                  for c in (batch.k_cache, batch.v_cache))
    options = {"q_data_type": torch.float16, "kv_data_type": torch.float8_e4m3fn}
    scales = {"q_scale": 0.5, "k_scale": k_scale.item(), "v_scale": v_scale.item()}
    assert_close(decode_with(compat, workspace, batch, (k, v), options, scales),
                 decode_with(flashinfer, workspace, batch, (k, v), options, scales), torch.float16)


def test_e4m3_queries_match_the_reference_on_their_values(workspace):
    """e4m3 queries over an e4m3 cache, as vLLM hands them over: a bf16 output (o_data_type), the
    query scale joining k_scale; the reference reads the queries' dequantized values."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 queries need sm_89 or later")
    batch = make_batch(KV_LENS[1:], num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.bfloat16, seed=9)
    (k, k_scale), (v, v_scale) = (quantize_kv(c, "float8_e4m3fn") for c in (batch.k_cache, batch.v_cache))
    q_scale = 0.25
    q8 = (batch.q.float() / q_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    wrapper = compat.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(batch.indptr, batch.indices, batch.last_page_len, HEADS, KV_HEADS, 128, 16,
                 q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float8_e4m3fn, o_data_type=torch.bfloat16)
    out, lse = wrapper.run(q8, (k, v), q_scale=q_scale, k_scale=k_scale.item(), v_scale=v_scale.item(),
                           return_lse=True)
    assert out.dtype == torch.bfloat16 and wrapper.flashjit_decoder.spec.query_fp8
    ref, ref_lse = decode_reference((q8.float() * q_scale).bfloat16(), k.float() * k_scale, v.float() * v_scale,
                                    batch.indptr, batch.indices, batch.last_page_len)
    assert_exact(out, lse / LOG2E, ref, ref_lse, tolerance(torch.bfloat16, "float8_e4m3fn"))


@pytest.mark.parametrize("split", [{"fixed_split_size": 8}, {"disable_split_kv": True}, {"fixed_split_size": -1}])
def test_split_options_match_flashinfer_tensor_core_decode(workspace, split):
    batch = make_batch(KV_LENS, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.float16, seed=6)
    kv_cache = cache_form(batch, "tuple")
    options = {"q_data_type": torch.float16, **split}  # FlashInfer takes fixed_split_size with tensor cores only
    assert_close(decode_with(compat, workspace, batch, kv_cache, options, use_tensor_cores=True),
                 decode_with(flashinfer, workspace, batch, kv_cache, options, use_tensor_cores=True), torch.float16)


def test_fast_decode_plan_with_a_host_indptr_matches_flashinfer(workspace):
    batch = make_batch(KV_LENS, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.float16, seed=7)
    kv_cache = cache_form(batch, "stacked")
    results = []
    for module in (compat, flashinfer):
        wrapper = module.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr, last = batch.indptr.cuda(), batch.last_page_len.cuda()
        wrapper.plan(indptr, batch.indices, last, HEADS, KV_HEADS, 128, 16, data_type=torch.float16)
        module.fast_decode_plan(wrapper, indptr, batch.indices, last, HEADS, KV_HEADS, 128, 16,
                                data_type=torch.float16, global_override_indptr_cpu=batch.indptr)
        results.append(wrapper.run(batch.q, kv_cache, return_lse=True))
    assert_close(*results, torch.float16)


# ---- CUDA graphs over the caller's page-id buffer ------------------------------------------------

GRAPH_BATCH, POOL_PAGES, PAGE = 6, 1024, 16
GRAPH_STEPS = [[100, 3000, 17, 1, 900, 64], [5000, 1, 40, 900, 2, 2048], [16, 16, 16, 16, 16, 7000],
               [300, 1200, 0, 0, 0, 0]]  # the last: vLLM's padding, requests without pages at the end


def graph_table(kv_lens, seed):
    """(indptr CPU, page ids GPU, last_page_len CPU) over the shared pool, padding requests as vLLM writes them."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in kv_lens]
    indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages), 0)
    ids = torch.randperm(POOL_PAGES, generator=gen)[: int(indptr[-1])].to(torch.int32).cuda()
    last = torch.tensor([n - (p - 1) * PAGE if p else 1 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return indptr, ids, last


def eager_flashinfer(workspace, q, k, v, indptr, ids, last, real):
    """FlashInfer's eager decode of the first `real` requests (the padding rows are not compared)."""
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr[: real + 1], ids, last[:real], HEADS, KV_HEADS, 128, PAGE, data_type=torch.float16)
    return wrapper.run(q[:real], (k, v), return_lse=True)


@pytest.mark.parametrize("form", ["CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "use_cuda_graph=True"])
@pytest.mark.parametrize("planner", ["plan", "fast_decode_plan"])
def test_graph_replays_read_page_ids_written_in_place(workspace, form, planner):
    gen = torch.Generator().manual_seed(8)
    k, v = (torch.randn(POOL_PAGES, PAGE, KV_HEADS, 128, generator=gen).half().cuda() for _ in range(2))
    indptr_buf, last_buf = (torch.zeros(n, dtype=torch.int32, device="cuda") for n in (GRAPH_BATCH + 1, GRAPH_BATCH))
    ids_buf = torch.full((POOL_PAGES,), -1, dtype=torch.int32, device="cuda")
    if form == "use_cuda_graph=True":
        wrapper = compat.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=ids_buf,
            paged_kv_last_page_len_buffer=last_buf)
    else:
        wrapper = compat.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace, indptr_buf, ids_buf, last_buf, "NHD")

    def step(indptr, ids, last):
        ids_buf[: len(ids)].copy_(ids)  # a GPU write into the caller's buffer, as vLLM's kernel makes
        if planner == "plan":
            wrapper.plan(indptr, ids_buf[: len(ids)], last, HEADS, KV_HEADS, 128, PAGE, data_type=torch.float16)
        else:
            indptr_buf.copy_(indptr)
            last_buf.copy_(last)
            compat.fast_decode_plan(wrapper, indptr_buf, ids_buf[: len(ids)], last_buf, HEADS, KV_HEADS, 128, PAGE,
                                    data_type=torch.float16, global_override_indptr_cpu=indptr)

    q = torch.randn(GRAPH_BATCH, HEADS, 128, generator=gen).half().cuda()
    out, lse = torch.empty_like(q), torch.empty(GRAPH_BATCH, HEADS, device="cuda")
    step(*graph_table(GRAPH_STEPS[0], 0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            wrapper.run(q, (k, v), out=out, lse=lse, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, (k, v), out=out, lse=lse, return_lse=True)

    for i, kv_lens in enumerate(GRAPH_STEPS):
        indptr, ids, last = graph_table(kv_lens, i + 10)
        q.copy_(torch.randn(GRAPH_BATCH, HEADS, 128, generator=gen).half())
        step(indptr, ids, last)
        graph.replay()
        real = sum(1 for n in kv_lens if n)
        assert_close((out[:real], lse[:real]), eager_flashinfer(workspace, q, k, v, indptr, ids, last, real),
                     torch.float16)
        if real < GRAPH_BATCH:  # a request without pages attends to nothing
            assert (out[real:] == 0).all() and (lse[real:] == -math.inf).all()

    # Same lengths, other pages, written in place with no plan in between: the replay reads them.
    indptr, _, last = graph_table(GRAPH_STEPS[-1], 99)
    ids = torch.randperm(POOL_PAGES, generator=gen)[: int(indptr[-1])].to(torch.int32).cuda()
    ids_buf[: len(ids)].copy_(ids)
    graph.replay()
    real = sum(1 for n in GRAPH_STEPS[-1] if n)
    assert_close((out[:real], lse[:real]), eager_flashinfer(workspace, q, k, v, indptr, ids, last, real),
                 torch.float16)


# ---- FlashInfer 0.7's arguments, and the variants served --------------------------------------------

@pytest.mark.parametrize("cap", [30.0, 50.0])
def test_logits_soft_cap_matches_flashinfer(workspace, cap):
    batch = make_batch(KV_LENS, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.float16, seed=11)
    batch.q.mul_(8)  # logits large enough for the cap to matter
    kv_cache = cache_form(batch, "tuple")
    options = {"logits_soft_cap": cap}
    assert_close(decode_with(compat, workspace, batch, kv_cache, options),
                 decode_with(flashinfer, workspace, batch, kv_cache, options), torch.float16)


def test_run_sinks_match_the_reference_layer_after_layer(workspace):
    batch = make_batch(KV_LENS, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.bfloat16, seed=12)
    wrapper = compat.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(batch.indptr, batch.indices, batch.last_page_len, HEADS, KV_HEADS, 128, 16,
                 q_data_type=torch.bfloat16)
    for layer in range(3):  # each layer its own sinks: one plan, re-pointed
        sinks = torch.randn(HEADS, device="cuda", generator=torch.Generator("cuda").manual_seed(layer)) * 3
        out, lse = wrapper.run(batch.q, (batch.k_cache, batch.v_cache), sinks=sinks, return_lse=True)
        ref, ref_lse = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                        batch.last_page_len, variant="sinks", variant_params={"sinks": sinks})
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse, ref_lse * LOG2E, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("options, mask", [(dict(q_len_per_req=3), "causal"),
                                           (dict(q_len_per_req=2, is_causal=False), "none"),
                                           (dict(q_len_per_req=2, window_left=64), "sliding_window")])
def test_0_7_multi_token_plans_match_the_reference(workspace, options, mask):
    q_len = options["q_len_per_req"]
    batch = make_batch(KV_LENS[1:], num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, page_size=16,
                       dtype=torch.bfloat16, q_lens=q_len, seed=13)
    wrapper = compat.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(batch.indptr, batch.indices, batch.last_page_len, HEADS, KV_HEADS, 128, 16,
                 q_data_type=torch.bfloat16, **options)
    out = wrapper.run(batch.q, (batch.k_cache, batch.v_cache))
    params = {"window_left": options["window_left"]} if "window_left" in options else None
    ref, _ = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices, batch.last_page_len,
                              qo_indptr=batch.qo_indptr, mask=mask, mask_params=params)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
