"""FLASHJIT_MLA's decode step on the GPU, through its framework-free core (core.mla): vLLM's
[blocks, block_size, 576] latent cache (bf16, and fp8 with one scale as vLLM's _k_scale), shuffled
blocks with block 0 the null block, decodes and multi-token rows (1-4 query tokens), eager and in a
CUDA graph replayed after new compositions, each against the float32 MLA reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashjit
from flashjit.integrations.core import host_page_table
from flashjit.integrations.core.mla import MLADecoders, MLAForm, latent_cache
from flashjit.serving.mla_reference import mla_reference
from flashjit.serving.quantize import quantize_latent

from block_tables import block_table_of

from .batches import rel_error

HEADS, BLOCK, NUM_BLOCKS, SCALE = 16, 64, 1500, 0.1352
CUDA = torch.device("cuda")
TOLERANCE = {"bf16": 1e-2, "fp8": 2e-2}
COMPOSITIONS = [([4000, 77, 9000, 1], [1, 1, 1, 1]), ([2000] * 12, [1] * 12), ([600, 5000], [4, 2]),
                ([33, 3000, 12000], [3, 1, 4])]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return flashjit.Engine(cache_dir=tmp_path_factory.mktemp("vllm-mla-kernels"))


def make_cache(kind):
    g = torch.Generator(device=CUDA).manual_seed(0)
    cache = torch.randn(NUM_BLOCKS, BLOCK, 576, generator=g, device=CUDA).bfloat16()
    if kind == "bf16":
        return cache, None, "auto"
    fp8, scale = quantize_latent(cache, "e4m3")
    return fp8.view(torch.uint8), scale, "fp8"  # vLLM allocates the fp8 latent cache as bytes


def step(seq_lens, query_lens, rng):
    width = max(-(-s // BLOCK) for s in seq_lens) + 1
    table = block_table_of(seq_lens, BLOCK, width, rng, num_blocks=NUM_BLOCKS)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    return table.to(CUDA), torch.tensor(seq_lens), qsl


def check(kind, cache, scale, table, seq, qsl, q_nope, q_pe, out, label):
    pages = host_page_table(table, seq, qsl, len(seq), BLOCK)
    stored = latent_cache(cache, "fp8" if kind == "fp8" else "auto")
    want, _ = mla_reference(q_nope, q_pe, stored, None, pages.indptr, pages.indices, pages.last_page_len,
                            sm_scale=SCALE, qo_indptr=pages.qo_indptr, ckv_scale=1.0 if scale is None else scale)
    error = rel_error(out.float(), want)
    assert error < TOLERANCE[kind], f"{label}: rel error {error:.3g}"


def queries(tokens, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(tokens, HEADS, 576, generator=g, device=CUDA).bfloat16()
    return q[..., :512], q[..., 512:]  # views of one tensor, as vLLM's decode queries can be


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_eager_steps(kind, engine):
    cache, scale, cache_dtype = make_cache(kind)
    form = MLAForm(HEADS, BLOCK, "bfloat16", "float8_e4m3fn" if kind == "fp8" else "bfloat16", SCALE)
    decoders = MLADecoders(form, CUDA, max_decode_q_len=4, engine=engine)
    rng = np.random.default_rng(1)
    for n, (seq_lens, query_lens) in enumerate(COMPOSITIONS):
        table, seq, qsl = step(seq_lens, query_lens, rng)
        decoder = decoders.plan_eager(host_page_table(table, seq, qsl, len(seq), BLOCK))
        q_nope, q_pe = queries(int(qsl[-1]), n)
        out = torch.empty(q_nope.shape, dtype=torch.bfloat16, device=CUDA)
        decoders.run(decoder, q_nope, q_pe, latent_cache(cache, cache_dtype), out, scale=scale)
        check(kind, cache, scale, table, seq, qsl, q_nope, q_pe, out, f"eager {kind} composition {n}")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_graph_replays_after_new_compositions(kind, engine):
    cache, scale, cache_dtype = make_cache(kind)
    form = MLAForm(HEADS, BLOCK, "bfloat16", "float8_e4m3fn" if kind == "fp8" else "bfloat16", SCALE)
    size = 16
    buffer = torch.zeros(size * (12000 // BLOCK + 2), dtype=torch.int32, device=CUDA)
    decoders = MLADecoders(form, CUDA, max_decode_q_len=4, engine=engine, page_ids_buffer=buffer)
    rng = np.random.default_rng(2)
    q_all = torch.zeros(size, HEADS, 576, dtype=torch.bfloat16, device=CUDA)
    out = torch.zeros(size, HEADS, 512, dtype=torch.bfloat16, device=CUDA)
    stored = latent_cache(cache, cache_dtype)

    def plan(seq_lens, query_lens):
        table, seq, qsl = step(seq_lens, query_lens, rng)
        decoder = decoders.plan_graph(size, host_page_table(table, seq, qsl, len(seq), BLOCK, out_indices=buffer))
        return decoder, (table, seq, qsl)

    decoder, _ = plan(*COMPOSITIONS[0])
    decoders.run(decoder, q_all[..., :512], q_all[..., 512:], stored, out, scale=scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoders.run(decoder, q_all[..., :512], q_all[..., 512:], stored, out, scale=scale)
    for n, (seq_lens, query_lens) in enumerate(COMPOSITIONS):
        again, (table, seq, qsl) = plan(seq_lens, query_lens)
        assert again is decoder
        tokens = int(qsl[-1])
        q_nope, q_pe = queries(tokens, 10 + n)
        q_all.zero_()
        q_all[:tokens, :, :512].copy_(q_nope)
        q_all[:tokens, :, 512:].copy_(q_pe)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(kind, cache, scale, table, seq, qsl, q_nope, q_pe, out[:tokens], f"graph {kind} composition {n}")
