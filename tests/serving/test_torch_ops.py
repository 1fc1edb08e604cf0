"""torch.ops.flashjit on the CPU: run() as an operator that torch.compile(fullgraph=True) keeps whole.

The model step is a small Llama-style attention layer. ReferenceDecoder computes the attention in
torch behind the same operator BatchDecode uses; BatchDecode itself runs with its launches recorded
(tests/cpu_decoders.py's CPU decoder), so the tests see what the compiled graph would launch. The
"aot_eager" backend traces with fake tensors through the operator's fake implementation, as
inductor does, without compiling C++.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from flashjit.jit import launch
from flashjit.parallel import ReferenceDecoder
from flashjit.serving import torch_ops

from cpu_decoders import cpu_decoder, cpu_mla, launch_of, page_table, tables

HEADS, KV_HEADS, DIM, PAGE, HIDDEN = 4, 2, 64, 16, 128


class CountingBackend:
    """aot_eager that counts the graphs it compiles and the flashjit operator calls in them."""

    def __init__(self):
        self.graphs, self.operator_calls = 0, []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.operator_calls += [str(n.target) for n in gm.graph.nodes
                                if n.op == "call_function" and "flashjit" in str(n.target)]
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)


def rope(x, positions):
    half = x.shape[-1] // 2
    freqs = positions[:, None, None].float() / (10000 ** (torch.arange(half) / half))
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((x[..., :half] * cos - x[..., half:] * sin, x[..., :half] * sin + x[..., half:] * cos), -1)


class LlamaAttention(torch.nn.Module):
    """Projections, RoPE, the new K/V written into the paged cache, paged decode, the output projection."""

    def __init__(self, decoder):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * DIM, HIDDEN, bias=False)
        self.decoder = decoder

    def forward(self, x, positions, slots, k_cache, v_cache):
        q, k, v = self.qkv(x).split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        q, k = rope(q.view(-1, HEADS, DIM), positions), rope(k.view(-1, KV_HEADS, DIM), positions)
        k_cache.view(-1, KV_HEADS, DIM).index_copy_(0, slots, k)
        v_cache.view(-1, KV_HEADS, DIM).index_copy_(0, slots, v.view(-1, KV_HEADS, DIM))
        out, lse = self.decoder.run(q.contiguous(), (k_cache, v_cache), return_lse=True)
        return self.o(out.view(-1, HEADS * DIM)), lse


def decode_batch(kv_lens, pages: int, seed: int):
    """The page table of a decode step (one new token per request, at its last position) and its inputs."""
    indptr, indices, last = tables(kv_lens, PAGE, np.random.default_rng(seed), spare_pages=pages - sum(
        -(-n // PAGE) for n in kv_lens))
    positions = torch.tensor([n - 1 for n in kv_lens])
    ends = indptr[1:].long() - 1
    slots = indices[ends].long() * PAGE + last.long() - 1  # the slot of each request's newest token
    x = torch.randn(len(kv_lens), HIDDEN, generator=torch.Generator().manual_seed(seed))
    return (indptr, indices, last), (x, positions, slots)


def caches(pages: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(pages, PAGE, KV_HEADS, DIM, generator=g) for _ in range(2)]


def test_a_llama_attention_step_compiles_whole_and_matches_eager():
    decoder = ReferenceDecoder()
    layer = LlamaAttention(decoder)
    backend = CountingBackend()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    pages = 40
    for step, kv_lens in enumerate(([70, 3, 200], [71, 4, 201], [16, 300, 5])):  # new page tables, same rows
        table, inputs = decode_batch(kv_lens, pages, step)
        decoder.plan(*table, HEADS, KV_HEADS, DIM, PAGE, mask="causal", q_dtype=torch.float32)
        eager_caches, compiled_caches = caches(pages), caches(pages)
        with torch.no_grad():
            expected, expected_lse = layer(*inputs, *eager_caches)
            got, got_lse = compiled(*inputs, *compiled_caches)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(got_lse, expected_lse)
        assert all(torch.equal(a, b) for a, b in zip(eager_caches, compiled_caches))  # the writes happened
    # One graph for all three plans (the plan is not traced), holding the operator once.
    assert backend.graphs == 1 and backend.operator_calls == ["flashjit.decode"]


def test_the_fake_implementation_refuses_a_query_unlike_the_plan():
    decoder = ReferenceDecoder()
    table, _ = decode_batch([40, 9], 8, 0)
    decoder.plan(*table, HEADS, KV_HEADS, DIM, PAGE, q_dtype="bfloat16")
    k, v = caches(8)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q):
        return decoder.run(q, (k, v))

    with pytest.raises(Exception, match=r"q must be \[tokens, 4, 64\] torch.bfloat16 as planned"):
        step(torch.randn(2, HEADS, DIM))  # float32
    with pytest.raises(Exception, match=r"q must be \[tokens, 4, 64\]"):
        step(torch.randn(2, HEADS + 1, DIM, dtype=torch.bfloat16))


def test_opcheck_passes_for_decode():
    decoder = ReferenceDecoder()
    table, _ = decode_batch([40, 9, 17], 8, 0)
    decoder.plan(*table, HEADS, KV_HEADS, DIM, PAGE, mask="causal")
    k, v = caches(8)
    q = torch.randn(3, HEADS, DIM)
    for lse in (None, torch.empty(3, HEADS)):
        args = (q, [k, v], torch.empty_like(q), lse, None, None, None, 0.5, decoder._op_handle)
        torch.library.opcheck(torch.ops.flashjit.decode.default, args)


@pytest.fixture
def launches(monkeypatch):
    """The argument structs' q/out/lse pointers at each launch the decoders make."""
    calls = []

    def record(*args):
        calls.append(launch_of(args))
        return 0

    monkeypatch.setattr(launch, "_cu_launch", record)
    return calls


def test_batch_decode_runs_its_plan_through_the_operator(planner, launches):
    decoder = cpu_decoder(planner, current_stream=lambda index: 0)
    indptr, indices, last = tables([5000, 30, 700], PAGE, np.random.default_rng(0))
    decoder.plan(indptr, indices, last, 8, 2, 64, PAGE, q_dtype="bfloat16")
    k, v = (torch.zeros(int(indices.max()) + 1, PAGE, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    backend = CountingBackend()

    @torch.compile(fullgraph=True, backend=backend)
    def step(q):
        return decoder.run(q, (k, v), return_lse=True, k_scale=1.0)

    q = torch.randn(3, 8, 64, dtype=torch.bfloat16)
    out, lse = step(q)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (3, 8) and lse.dtype == torch.float32
    a = decoder.current_plan.decode_args
    assert (a.q, a.out, a.lse, a.k, a.v) == (q.data_ptr(), out.data_ptr(), lse.data_ptr(), k.data_ptr(), v.data_ptr())
    assert len(launches) >= 1 and backend.operator_calls == ["flashjit.decode"]
    args = (q, [k, v], torch.empty_like(q), None, None, 1.0, None, None, decoder._op_handle)
    torch.library.opcheck(torch.ops.flashjit.decode.default, args)


def test_batch_decode_mla_runs_through_its_operator(engine, fake_nvrtc, launches):
    decoder = cpu_mla(engine, current_stream=lambda index: 0)
    indptr, indices, last = page_table([300, 17], 64)
    decoder.plan(indptr, indices, last, 16, 64, sm_scale=0.1)
    ckv = torch.zeros(int(indices.max()) + 1, 64, 512, dtype=torch.bfloat16)
    kpe = torch.zeros(int(indices.max()) + 1, 64, 64, dtype=torch.bfloat16)
    backend = CountingBackend()

    @torch.compile(fullgraph=True, backend=backend)
    def step(q_nope, q_pe):
        return decoder.run(q_nope, q_pe, ckv, kpe) * 2

    q_nope, q_pe = torch.randn(2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 16, 64, dtype=torch.bfloat16)
    assert step(q_nope, q_pe).shape == (2, 16, 512)
    a = decoder.current_plan.args
    assert (a.q_nope, a.q_pe, a.ckv, a.kpe) == (q_nope.data_ptr(), q_pe.data_ptr(), ckv.data_ptr(), kpe.data_ptr())
    assert len(launches) == 1 and backend.operator_calls == ["flashjit.mla_decode"]
    args = (q_nope, q_pe, ckv, kpe, torch.empty_like(q_nope), torch.empty(2, 16), None, None, None, None,
            decoder._op_handle)
    torch.library.opcheck(torch.ops.flashjit.mla_decode.default, args)


def test_eager_run_launches_without_the_operator(planner, launches, monkeypatch):
    monkeypatch.setattr(torch_ops, "decode", lambda *args: pytest.fail("eager run() went through the operator"))
    decoder = cpu_decoder(planner, current_stream=lambda index: 0)
    indptr, indices, last = tables([50], PAGE, np.random.default_rng(0))
    decoder.plan(indptr, indices, last, 8, 2, 64, PAGE)
    k = torch.zeros(int(indices.max()) + 1, PAGE, 2, 64, dtype=torch.bfloat16)
    decoder.run(torch.randn(1, 8, 64, dtype=torch.bfloat16), (k, k))
    assert len(launches) == 1


def test_a_handle_outlived_by_its_graph_is_refused_by_name():
    decoder = ReferenceDecoder()
    handle = decoder._op_handle
    assert torch_ops.decoder_of(handle) is decoder
    del decoder
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {handle} refers to no live decoder"):
        torch_ops.decoder_of(handle)


def test_e4m3_queries_give_an_output_of_the_planned_dtype_eager_and_compiled(planner, launches):
    decoder = cpu_decoder(planner, current_stream=lambda index: 0)
    indptr, indices, last = tables([900, 30], PAGE, np.random.default_rng(1))
    decoder.plan(indptr, indices, last, 8, 2, 64, PAGE, q_dtype="e4m3", out_dtype="bf16", kv_dtype="e4m3")
    assert decoder.spec.query_fp8 and decoder.query_form() == (torch.float8_e4m3fn, 8, 64, torch.bfloat16)
    k, v = (torch.zeros(int(indices.max()) + 1, PAGE, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2))
    q = torch.randn(2, 8, 64).to(torch.float8_e4m3fn)
    eager = decoder.run(q, (k, v), k_scale=0.5, v_scale=1.0)
    assert eager.dtype == torch.bfloat16 and eager.shape == q.shape
    with pytest.raises(ValueError, match="out: expected dtype torch.bfloat16"):
        decoder.run(q, (k, v), out=torch.empty(2, 8, 64).to(torch.float8_e4m3fn), k_scale=0.5, v_scale=1.0)
    backend = CountingBackend()

    @torch.compile(fullgraph=True, backend=backend)
    def step(q):
        return decoder.run(q, (k, v), k_scale=0.5, v_scale=1.0)

    out = step(q)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and backend.operator_calls == ["flashjit.decode"]
    a = decoder.current_plan.decode_args
    assert (a.q, a.out) == (q.data_ptr(), out.data_ptr())
