"""flashjit's SGLang adapter core on the GPU, driven as SGLang 0.5.23 drives its attention backend,
with tensors shaped as SGLang builds them (the GPU machine has no SGLang): a token pool of
separate K and V buffers per layer ([size + page_size, kv_heads, head_dim], or page-major with
SGLANG_USE_HND_KVCACHE), req_to_token rows of pool slots, and decode steps that write each new
token's K/V at out_cache_loc before attention reads it.

Each step is checked row by row against flashjit.serving.reference.decode_reference over the
float32 (dequantized) pool, with a page table read off req_to_token by a plain loop: decode batches
of mixed lengths, page sizes 1 and 16, bf16 and fp8 pools, a full layer and a sliding-window
soft-capped one, eager and replayed in CUDA graphs captured once per batch size (as SGLang
captures them, padding rows included) after new batch compositions planned outside the graph.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashjit.integrations.sglang import (AttentionShape, LayerForm, PoolDecoder, pages_per_request, paged_kv,
                                          write_kv)
from flashjit.serving.reference import decode_reference

HEADS, KV_HEADS, DIM = 32, 8, 128
CONTEXT, SLOTS = 6144, 40
FULL = LayerForm(sm_scale=DIM ** -0.5)
CAPPED_WINDOW = LayerForm(sm_scale=DIM ** -0.5, window_left=700, logit_cap=30.0)
FORMS = (FULL, CAPPED_WINDOW)  # layer 0, layer 1
SCALES = {"bfloat16": (None, None), "float8_e4m3fn": (0.03, 0.02)}
TOLERANCE = {"bfloat16": 1e-2, "float8_e4m3fn": 2e-2}
LENGTHS = [1, 7, 300, 2049, 33, 5000, 16, 17, 1200, 64, 2, 999]  # mixed, padded to every page boundary case


class Pool:
    """SGLang's ReqToTokenPool and MHATokenToKVPool as tensors: req_to_token [SLOTS + 1, CONTEXT]
    (row 0: the padding row), per layer K and V buffers of `pages` pages (page 0: the padding page,
    where padded rows write), an fp8 pool holding K / k_scale and V / v_scale."""

    def __init__(self, page_size, kv_dtype, layout="NHD", pages=None, seed=0):
        self.page_size, self.layout, self.kv_dtype = page_size, layout, kv_dtype
        self.k_scale, self.v_scale = SCALES[kv_dtype]
        self.rng, gen = random.Random(seed), torch.Generator(device="cuda").manual_seed(seed)
        self.pages = pages or (16 * CONTEXT // page_size + 64)  # the largest step: 16 requests of CONTEXT keys
        shape = ((self.pages * page_size, KV_HEADS, DIM) if layout == "NHD"
                 else (self.pages, KV_HEADS, page_size, DIM))
        dtype = getattr(torch, kv_dtype)
        self.k, self.v = [], []
        for _ in FORMS:
            for buffers, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
                values = torch.randn(shape, generator=gen, device="cuda")
                buffers.append((values if scale is None else values / scale).to(dtype))
        self.req_to_token = torch.zeros(SLOTS + 1, CONTEXT, dtype=torch.int32, device="cuda")
        self.free_pages = list(range(1, self.pages))
        self.rng.shuffle(self.free_pages)
        self.free_slots = list(range(1, SLOTS + 1))

    def admit(self, seq_lens):
        """Requests of seq_lens keys (the new token's included) in fresh slots and pages, as
        SGLang's scheduler leaves them for a decode step: (req_pool_indices, out_cache_loc)."""
        slots = [self.free_slots.pop(self.rng.randrange(len(self.free_slots))) for _ in seq_lens]
        locs = []
        for slot, n in zip(slots, seq_lens):
            pages = [self.free_pages.pop() for _ in range(-(-n // self.page_size))]
            tokens = [p * self.page_size + i for p in pages for i in range(self.page_size)][:n]
            self.req_to_token[slot, :n] = torch.tensor(tokens, dtype=torch.int32)
            locs.append(tokens[-1])
        return (torch.tensor(slots, dtype=torch.int64, device="cuda"),
                torch.tensor(locs, dtype=torch.int64, device="cuda"))

    def release(self, req_pool_indices, seq_lens):
        for slot, n in zip(req_pool_indices.tolist(), seq_lens):
            self.free_slots.append(slot)
            row = self.req_to_token[slot, :n].tolist()
            self.free_pages += sorted({t // self.page_size for t in row})

    def dequantized(self, layer):
        """(K, V) of a layer as float32 pages, what the pool stands for."""
        return tuple(paged_kv(buffers[layer].float() * (1.0 if scale is None else scale), self.page_size, self.layout)
                     for buffers, scale in ((self.k, self.k_scale), (self.v, self.v_scale)))

    def write(self, layer, loc, k, v):
        write_kv(self.k[layer], self.v[layer], loc, k, v, page_size=self.page_size, layout=self.layout,
                 k_scale=self.k_scale, v_scale=self.v_scale)

    def check_written(self, layer, loc, k, v):
        """The pool holds k and v at slots loc, stored as its dtype stores them (fp8: over the scale)."""
        for buffers, new, scale in ((self.k, k, self.k_scale), (self.v, v, self.v_scale)):
            b = buffers[layer]
            held = b[loc] if self.layout == "NHD" else b[loc // self.page_size, :, loc % self.page_size]
            expected = new if scale is None else (new.float() / scale).to(b.dtype)
            assert torch.equal(held.view(torch.uint8), expected.view(torch.uint8)), f"layer {layer}: KV write"


def reference_tables(pool, req_pool_indices, seq_lens):
    """indptr, page ids, last_page_len read off req_to_token by a plain loop."""
    rows = pool.req_to_token.cpu()
    indptr, ids, last = [0], [], []
    for slot, n in zip(req_pool_indices.tolist(), seq_lens):
        pages = -(-n // pool.page_size)
        ids += [int(rows[slot, j * pool.page_size]) // pool.page_size for j in range(pages)]
        indptr.append(len(ids))
        last.append(n - (pages - 1) * pool.page_size)
    return indptr, torch.tensor(ids, dtype=torch.int32, device="cuda"), last


def check_rows(pool, layer, form, q, out, req_pool_indices, seq_lens, rows):
    """The first `rows` rows of out against decode_reference, each row on its own."""
    indptr, ids, last = reference_tables(pool, req_pool_indices[:rows], seq_lens[:rows])
    k, v = pool.dequantized(layer)
    mask, params = "none", {}
    if form.window_left is not None:
        mask, params = "sliding_window", {"window_left": form.window_left}
    variant = "none" if form.logit_cap is None else "soft_cap"
    ref, _ = decode_reference(q[:rows], k, v, indptr, ids, last, mask=mask, mask_params=params,
                              sm_scale=form.sm_scale, kv_layout=pool.layout, variant=variant,
                              variant_params=None if form.logit_cap is None else {"logits_soft_cap": form.logit_cap})
    got = out[:rows].float()
    assert not got.isnan().any()
    errors = ((got - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2)).clamp_min(1e-6)).tolist()
    worst = max(range(rows), key=errors.__getitem__)
    assert errors[worst] <= TOLERANCE[pool.kv_dtype], (
        f"layer {layer}, row {worst} of {rows} (seq_len {seq_lens[worst]}): relative error {errors[worst]:.3g}")


def decoder_for(pool):
    shape = AttentionShape(HEADS, KV_HEADS, DIM, q_dtype="bfloat16", kv_dtype=pool.kv_dtype,
                           page_size=pool.page_size, kv_layout=pool.layout)
    decoder = PoolDecoder(shape, FORMS, "cuda")
    decoder.prewarm()
    return decoder


def new_tokens(rows, gen):
    q = torch.randn(rows, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    k = torch.randn(rows, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    v = torch.randn(rows, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    return q, k, v


POOLS = [(1, "bfloat16", "NHD"), (16, "bfloat16", "NHD"), (1, "float8_e4m3fn", "NHD"),
         (16, "float8_e4m3fn", "NHD"), (16, "bfloat16", "HND")]


@pytest.mark.parametrize("page_size, kv_dtype, layout", POOLS)
def test_eager_decode_steps_match_the_reference_row_by_row(page_size, kv_dtype, layout):
    pool = Pool(page_size, kv_dtype, layout)
    decoder = decoder_for(pool)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for seq_lens in (LENGTHS, LENGTHS[3:7], [1], [4097] * 3):
        slots, loc = pool.admit(seq_lens)
        lens = torch.tensor(seq_lens, device="cuda")
        step = decoder.plan(pool.req_to_token, slots, lens, torch.tensor(seq_lens))
        for layer, form in enumerate(FORMS):
            q, k, v = new_tokens(len(seq_lens), gen)
            pool.write(layer, loc, k, v)
            pool.check_written(layer, loc, k, v)  # the new token, at the slot req_to_token lists last
            out = decoder.run(step, form, q, pool.k[layer], pool.v[layer], k_scale=pool.k_scale,
                              v_scale=pool.v_scale)
            check_rows(pool, layer, form, q, out, slots, seq_lens, len(seq_lens))
        pool.release(slots, seq_lens)


class CapturedDecode:
    """One SGLang decode graph of `bs` rows: the step's inputs in static buffers (query, new K/V,
    out_cache_loc), each layer's KV write and attention captured once."""

    def __init__(self, pool, decoder, bs, gen):
        self.pool, self.decoder, self.bs = pool, decoder, bs
        self.q = torch.zeros(len(FORMS), bs, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        self.k = torch.zeros(len(FORMS), bs, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        self.v = torch.zeros_like(self.k)
        self.loc = torch.zeros(bs, dtype=torch.int64, device="cuda")  # padding rows write slot 0
        self.out = torch.zeros_like(self.q)
        padding = torch.zeros(bs, dtype=torch.int64, device="cuda")
        self.plan(padding, [1] * bs)  # SGLang's capture plans the padding batch (seq_len fill value 1)
        self.forward()  # warm-up outside the capture, as SGLang runs it
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.forward()

    def plan(self, req_pool_indices, seq_lens):
        self.step = self.decoder.plan_graph(self.pool.req_to_token, req_pool_indices,
                                            torch.tensor(seq_lens, device="cuda"), torch.tensor(seq_lens))

    def forward(self):
        for layer, form in enumerate(FORMS):
            self.pool.write(layer, self.loc, self.k[layer], self.v[layer])
            self.decoder.run(self.step, form, self.q[layer], self.pool.k[layer], self.pool.v[layer],
                             out=self.out[layer], k_scale=self.pool.k_scale, v_scale=self.pool.v_scale)

    def replay(self, req_pool_indices, loc, seq_lens, gen):
        """A batch of up to bs requests, padded as SGLang pads it, planned outside the graph and replayed."""
        rows, pad = len(seq_lens), self.bs - len(seq_lens)
        zeros = torch.zeros(pad, dtype=torch.int64, device="cuda")
        self.plan(torch.cat([req_pool_indices, zeros]), list(seq_lens) + [1] * pad)
        self.loc.copy_(torch.cat([loc, zeros]))
        for layer in range(len(FORMS)):
            q, k, v = new_tokens(self.bs, gen)
            self.q[layer].copy_(q)
            self.k[layer].copy_(k)
            self.v[layer].copy_(v)
        self.out.fill_(float("nan"))
        self.graph.replay()
        return rows


@pytest.mark.parametrize("page_size, kv_dtype, layout", POOLS)
def test_cuda_graph_replays_plan_each_new_composition_outside_the_graph(page_size, kv_dtype, layout):
    pool = Pool(page_size, kv_dtype, layout)
    decoder = decoder_for(pool)
    gen = torch.Generator(device="cuda").manual_seed(2)
    sizes = (16, 8, 2)  # SGLang captures its sizes largest first, all over one set of decoders
    decoder.init_graphs(max(sizes), pages_per_request(CONTEXT, page_size))
    graphs = {bs: CapturedDecode(pool, decoder, bs, gen) for bs in sizes}
    compositions = (LENGTHS, [5000] * 8, [1, 2], LENGTHS[:5], [CONTEXT] * 16, LENGTHS[::-1][:9], [3])
    for seq_lens in compositions:
        bs = min(size for size in sizes if size >= len(seq_lens))
        slots, loc = pool.admit(seq_lens)
        rows = graphs[bs].replay(slots, loc, seq_lens, gen)
        captured = graphs[bs]
        assert captured.step.graph and all(d.batch_size == bs for d in captured.step.decoders.values())
        for layer, form in enumerate(FORMS):
            check_rows(pool, layer, form, captured.q[layer], captured.out[layer], slots, seq_lens, rows)
        pool.release(slots, seq_lens)


def test_a_graph_step_beyond_the_capacity_is_refused_before_the_graph_runs():
    pool = Pool(16, "bfloat16")
    decoder = decoder_for(pool)
    decoder.init_graphs(4, pages_per_request(CONTEXT, 16))
    slots, _ = pool.admit([1] * 5)
    with pytest.raises(ValueError, match="at most max_batch_size=4 requests"):
        decoder.plan_graph(pool.req_to_token, slots, torch.ones(5, dtype=torch.int64, device="cuda"),
                           torch.ones(5, dtype=torch.int64))
