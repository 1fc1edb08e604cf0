"""torch.compile(fullgraph=True) of a Llama-style layer step with BatchDecode attention: equal to eager,
and replayed from a CUDA graph after new plans."""

from __future__ import annotations

import pytest
import torch

import flashjit
from flashjit.serving.reference import decode_reference

from .batches import rel_error

HEADS, KV_HEADS, DIM, PAGE, HIDDEN, PAGES = 32, 8, 128, 16, 1024, 512  # the longest batch takes 311 pages
BATCHES = ([70, 3, 2000, 16], [71, 4, 2001, 17], [900, 1, 33, 4000])  # one new token per request
torch_compile = torch.compile  # the module-level name keeps pytest's assertion rewriting out of the traced code


class Layer(torch.nn.Module):
    def __init__(self, decoder):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * DIM, bias=False, dtype=torch.bfloat16, device="cuda")
        self.o = torch.nn.Linear(HEADS * DIM, HIDDEN, bias=False, dtype=torch.bfloat16, device="cuda")
        self.decoder = decoder

    def forward(self, x, slots, k_cache, v_cache):
        q, k, v = self.qkv(x).split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        k_cache.view(-1, KV_HEADS, DIM).index_copy_(0, slots, k.view(-1, KV_HEADS, DIM))
        v_cache.view(-1, KV_HEADS, DIM).index_copy_(0, slots, v.reshape(-1, KV_HEADS, DIM))
        out = self.decoder.run(q.reshape(-1, HEADS, DIM), (k_cache, v_cache))
        return self.o(out.view(-1, HEADS * DIM)), out


def page_table(kv_lens, seed):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in kv_lens]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    ids = torch.randperm(PAGES, generator=g)[: sum(pages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    slots = ids[indptr[1:].long() - 1].long() * PAGE + last.long() - 1
    return indptr.cuda(), ids.cuda(), last.cuda(), slots.cuda()


def plan(decoder, kv_lens, seed):
    indptr, ids, last, slots = page_table(kv_lens, seed)
    decoder.plan(indptr, ids, last, HEADS, KV_HEADS, DIM, PAGE, mask="causal", q_dtype=torch.bfloat16)
    return (indptr, ids, last), slots


def fresh_caches(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(PAGES, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2)]


def inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(len(BATCHES[0]), HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def eager_and_compiled(layer, compiled, decoder, kv_lens, seed):
    """A new plan for the batch, then one step of the layer eager and compiled, each on its own copy
    of the caches: (page table, input, the compiled step's caches, eager outputs, compiled outputs)."""
    table, slots = plan(decoder, kv_lens, seed)
    x = inputs(seed)
    eager_caches, compiled_caches = fresh_caches(seed), fresh_caches(seed)
    with torch.no_grad():
        expected = layer(x, slots, *eager_caches)
        got = compiled(x, slots, *compiled_caches)
    torch.cuda.synchronize()
    return table, x, compiled_caches, expected, got


@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_compiled_layer_step_equals_eager(use_cuda_graph):
    options = dict(use_cuda_graph=True, max_batch_size=8, max_num_pages=PAGES) if use_cuda_graph else {}
    decoder = flashjit.BatchDecode(device="cuda", **options)
    layer = Layer(decoder)
    compiled = torch_compile(layer, fullgraph=True)
    for seed, kv_lens in enumerate(BATCHES):
        table, x, compiled_caches, (expected, expected_attn), (got, got_attn) = eager_and_compiled(
            layer, compiled, decoder, kv_lens, seed)
        # The attention is the same kernel over the same cache; the projections may round differently
        # where inductor fuses them.
        assert rel_error(got_attn, expected_attn) < 1e-2
        assert rel_error(got, expected) < 1e-2
        with torch.no_grad():
            q = layer.qkv(x)[:, :HEADS * DIM].reshape(-1, HEADS, DIM)
            reference, _ = decode_reference(q, *compiled_caches, *table, mask="causal")
        assert rel_error(got_attn, reference) < 1e-2


def test_compiled_layer_step_replays_in_a_cuda_graph_after_new_plans():
    decoder = flashjit.BatchDecode(device="cuda", use_cuda_graph=True, max_batch_size=8, max_num_pages=PAGES)
    layer = Layer(decoder)
    compiled = torch_compile(layer, fullgraph=True)
    _, slots = plan(decoder, BATCHES[0], 0)
    static_x, static_slots = inputs(0), slots.clone()
    k_cache, v_cache = fresh_caches(0)
    with torch.no_grad():
        for _ in range(2):  # compile and warm up outside the capture
            compiled(static_x, static_slots, k_cache, v_cache)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out, static_attn = compiled(static_x, static_slots, k_cache, v_cache)
    for seed, kv_lens in enumerate(BATCHES):
        table, slots = plan(decoder, kv_lens, seed)  # a new plan for the captured launches
        static_x.copy_(inputs(seed))
        static_slots.copy_(slots)
        fresh = fresh_caches(seed)
        k_cache.copy_(fresh[0])
        v_cache.copy_(fresh[1])
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            expected, expected_attn = layer(static_x, slots, *fresh)
        assert torch.equal(k_cache, fresh[0]) and torch.equal(v_cache, fresh[1])  # the replay wrote the new K/V
        assert rel_error(static_attn, expected_attn) < 1e-2
        assert rel_error(static_out, expected) < 1e-2


def test_reduce_overhead_mode_serves_each_new_plan():
    decoder = flashjit.BatchDecode(device="cuda", use_cuda_graph=True, max_batch_size=8, max_num_pages=PAGES)
    layer = Layer(decoder)
    compiled = torch_compile(layer, fullgraph=True, mode="reduce-overhead")
    for seed, kv_lens in enumerate(BATCHES * 2):
        _, _, _, (expected, _), (got, _) = eager_and_compiled(layer, compiled, decoder, kv_lens, seed)
        assert rel_error(got.clone(), expected) < 1e-2
