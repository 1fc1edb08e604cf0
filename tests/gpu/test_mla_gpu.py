"""MLA decode on the GPU against the float32 reference (flashjit.serving.mla_reference), row by row.

A sparse grid over heads per latent head {16, 32, 64, 128} (and 8, 4: TP 16), query tokens
{1, 2, 4}, latents {bf16, f16, e4m3, e5m2} under bf16 and f16 queries, page sizes {1, 16, 64} and
split / no split: every value of every axis appears, in combinations chosen to cross the kernel's
shapes (16, 32 and 64 rows per CTA, one and several row tiles, the wgmma kernel). Then the one
576-wide cache, tensor scales, the LSE, empty and too-short requests (rows that see no key), a
CUDA-graph replay after a re-plan, and the full grid (GRID) of heads {16, 32, 64, 128} x query
tokens {1, 2, 4} x bf16/e4m3 latents x pages {1, 16, 64}, eager (split and unsplit) and in CUDA
graphs replayed after re-plans; fp8 latents on the warpgroup kernel (MLATuning.wgmma_fp8) and the
merge of several cells at once (MLATuning.merge_cells) likewise.
Every row (query token x head) is judged on its own (flashjit.serving.exactness); with fp8 latents
the reference takes Q's RoPE part as the kernel rounds it (rounded_pe). No output may be NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashjit
from flashjit.kernels.mla import tiling as mla_tiling_module
from flashjit.kernels.mla.spec import MLASpec
from flashjit.kernels.mla.tiling import mla_tiling
from flashjit.serving.batch_mla import BatchDecodeMLA
from flashjit.serving.mla_reference import mla_reference
from flashjit.serving.quantize import quantize_latent

from .batches import assert_exact, tolerance

SM_SCALE = 192 ** -0.5
FP8 = ("e4m3", "e5m2")
#        heads q_len kv      page split  queries
CASES = [(16,   1,    "bf16", 64,  False, "bf16"),
         (16,   1,    "bf16", 16,  True,  "bf16"),
         (16,   2,    "e4m3", 1,   True,  "bf16"),
         (16,   4,    "bf16", 64,  True,  "bf16"),
         (32,   1,    "e4m3", 16,  False, "bf16"),
         (32,   2,    "bf16", 1,   False, "bf16"),
         (32,   4,    "e4m3", 64,  True,  "bf16"),
         (64,   1,    "bf16", 1,   True,  "bf16"),
         (64,   2,    "e4m3", 64,  False, "bf16"),
         (64,   4,    "bf16", 16,  False, "bf16"),
         (128,  1,    "bf16", 64,  True,  "bf16"),
         (128,  1,    "e4m3", 64,  True,  "bf16"),
         (128,  2,    "bf16", 16,  True,  "bf16"),
         (128,  4,    "e4m3", 1,   False, "bf16"),
         (8,    1,    "bf16", 64,  True,  "bf16"),
         (4,    2,    "e4m3", 16,  True,  "bf16"),
         # e5m2 latents, and f16 queries over f16 and fp8 latents (the wgmma kernel at 128 heads)
         (16,   1,    "e5m2", 16,  True,  "bf16"),
         (64,   2,    "e5m2", 64,  False, "f16"),
         (128,  1,    "e5m2", 1,   True,  "bf16"),
         (16,   2,    "f16",  16,  True,  "f16"),
         (32,   4,    "f16",  64,  False, "f16"),
         (128,  1,    "f16",  64,  True,  "f16"),
         (128,  2,    "e4m3", 16,  True,  "f16")]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
KV_DTYPES = {"bf16": "bfloat16", "f16": "float16", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def arch() -> str:
    return "sm_%d%d" % torch.cuda.get_device_capability()


@pytest.fixture(scope="session")
def engine():
    engine = flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)
    specs = {MLASpec(num_heads=h, dtype=qd, kv_dtype=kv, page_size=p, max_q_len=q, arch=arch())
             for h, q, kv, p, _, qd in CASES}
    specs.add(MLASpec(num_heads=16, page_size=16, max_q_len=2, arch=arch()))
    engine.prewarm(sorted(specs, key=lambda s: s.name), jobs=16)
    return engine


def make_batch(kv_lens, q_lens, heads, page_size, seed, dtype=torch.bfloat16):
    """Shuffled pages of a 576-wide latent cache, queries of the magnitude absorbed MLA queries have."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in kv_lens]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int32), 0)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    qo = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    cache = torch.randn(total, page_size, 576, generator=gen)
    tokens = int(qo[-1])
    q_nope = torch.randn(tokens, heads, 512, generator=gen) * 0.5
    q_pe = torch.randn(tokens, heads, 64, generator=gen) * 2.0
    cuda = lambda t: t.to(dtype).cuda()  # noqa: E731
    return dict(cache=cuda(cache), q_nope=cuda(q_nope), q_pe=cuda(q_pe), indptr=indptr,
                indices=perm[:int(indptr[-1])].cuda(), last=last, qo=qo)


def latent_caches(batch, kv: str):
    """(ckv, kpe) as the kernel reads them, their scales, and (ckv, kpe) in float32 for the reference."""
    ckv, kpe = batch["cache"][..., :512].contiguous(), batch["cache"][..., 512:].contiguous()
    if kv not in FP8:
        return (ckv, kpe), (None, None), (ckv.float(), kpe.float())
    ckv8, ckv_scale = quantize_latent(ckv, kv)
    kpe8, kpe_scale = quantize_latent(kpe * 3.0, kv)  # another range: a scale of its own
    return (ckv8, kpe8), (ckv_scale.item(), kpe_scale.item()), (ckv8.float() * ckv_scale, kpe8.float() * kpe_scale)


def rounded_pe(q_pe, scales):
    """Q's RoPE part as the kernel reads it: over fp8 latents multiplied by kpe_scale / ckv_scale and
    rounded to the query's type (mla.cuh load_q), here divided back for the dequantized reference."""
    if scales[0] is None:
        return q_pe
    ratio = scales[1] / scales[0]
    return (q_pe.float() * ratio).to(q_pe.dtype).float() / ratio


def mla_tolerance(q):
    """The MLA kernel multiplies P V in the query's type, fp8 latents converted to it exactly."""
    return tolerance(q.dtype, mma_dtype=q.dtype)


def reference(batch, reference_caches, scales, q_nope=None, q_pe=None):
    q_nope = batch["q_nope"] if q_nope is None else q_nope
    q_pe = batch["q_pe"] if q_pe is None else q_pe
    return mla_reference(q_nope, rounded_pe(q_pe, scales), *reference_caches, batch["indptr"], batch["indices"],
                         batch["last"], qo_indptr=batch["qo"], sm_scale=SM_SCALE)


def check(out, lse, ref_out, ref_lse, where=""):
    assert_exact(out, lse, ref_out, ref_lse, mla_tolerance(out), where)


def plan_and_run(engine, batch, heads, page_size, kv, split, caches, scales, **run_options):
    decoder = BatchDecodeMLA(engine)
    options = dict(chunk_tokens=128) if split else dict(disable_split_kv=True)
    decoder.plan(batch["indptr"], batch["indices"], batch["last"], heads, page_size, qo_indptr=batch["qo"],
                 sm_scale=SM_SCALE, q_dtype=batch["q_nope"].dtype, kv_dtype=kv if kv in FP8 else None, **options)
    out, lse = decoder.run(batch["q_nope"], batch["q_pe"], *caches, return_lse=True, ckv_scale=scales[0],
                           kpe_scale=scales[1], **run_options)
    return decoder, out, lse


@pytest.mark.parametrize("heads, q_len, kv, page_size, split, queries", CASES)
def test_against_reference(engine, heads, q_len, kv, page_size, split, queries, seed):
    check_case(engine, heads, q_len, kv, page_size, split, queries, seed)


def check_case(engine, heads, q_len, kv, page_size, split, queries, seed):
    kv_lens = [700, 1, 0, 333, 129, 1024] if split else [700, 1, 0, 333, 64]
    batch = make_batch(kv_lens, [q_len] * len(kv_lens), heads, page_size, seed, DTYPES[queries])
    caches, scales, reference_caches = latent_caches(batch, kv)
    decoder, out, lse = plan_and_run(engine, batch, heads, page_size, kv, split, caches, scales)
    assert decoder.work.needs_merge == split and decoder.spec.kv_dtype == KV_DTYPES[kv]
    ref_out, ref_lse = reference(batch, reference_caches, scales)
    check(out, lse, ref_out, ref_lse, decoder.spec.name)


def test_split_equals_one_pass(engine):
    batch = make_batch([2000, 513, 96], [2, 2, 2], 16, 16, 7)
    caches, scales, _ = latent_caches(batch, "bf16")
    _, whole, whole_lse = plan_and_run(engine, batch, 16, 16, "bf16", False, caches, scales)
    _, split, split_lse = plan_and_run(engine, batch, 16, 16, "bf16", True, caches, scales)
    check(split, split_lse, whole.float(), whole_lse, "split against one pass")


def test_one_576_wide_cache_and_tensor_scales(engine):
    batch = make_batch([300, 45], [1, 1], 128, 64, 11)
    ref_out, ref_lse = mla_reference(batch["q_nope"], batch["q_pe"], batch["cache"].float(), None, batch["indptr"],
                                     batch["indices"], batch["last"], qo_indptr=batch["qo"], sm_scale=SM_SCALE)
    decoder = BatchDecodeMLA(engine)
    decoder.plan(batch["indptr"], batch["indices"], batch["last"], 128, 64, sm_scale=SM_SCALE)
    out, lse = decoder.run(batch["q_nope"], batch["q_pe"], batch["cache"], return_lse=True)
    check(out, lse, ref_out, ref_lse, "one 576-wide cache")

    cache8, scale = quantize_latent(batch["cache"], "e4m3")  # one scale for both parts: Q's RoPE part as given
    ref_out, ref_lse = mla_reference(batch["q_nope"], batch["q_pe"], cache8.float() * scale, None, batch["indptr"],
                                     batch["indices"], batch["last"], qo_indptr=batch["qo"], sm_scale=SM_SCALE)
    decoder.plan(batch["indptr"], batch["indices"], batch["last"], 128, 64, sm_scale=SM_SCALE, kv_dtype="e4m3",
                 chunk_tokens=128)
    out, lse = decoder.run(batch["q_nope"], batch["q_pe"], cache8, return_lse=True, ckv_scale=scale)
    check(out, lse, ref_out, ref_lse, "one 576-wide e4m3 cache, a tensor scale")


def test_cuda_graph_replay_after_replan(engine):
    heads, page_size = 16, 16
    decoder = BatchDecodeMLA(engine, use_cuda_graph=True, max_batch_size=4, max_num_pages=512, max_q_len=2)
    first = make_batch([400, 900], [2, 2], heads, page_size, 21)
    second = make_batch([1500, 3, 77, 640], [1, 2, 2, 1], heads, page_size, 22)
    pages = max(first["cache"].shape[0], second["cache"].shape[0])
    cache = torch.zeros(pages, page_size, 576, dtype=torch.bfloat16, device="cuda")
    q_nope = torch.zeros(8, heads, 512, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.zeros(8, heads, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(8, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(8, heads, dtype=torch.float32, device="cuda")

    def load(batch):
        cache.zero_()
        cache[:batch["cache"].shape[0]].copy_(batch["cache"])
        tokens = batch["q_nope"].shape[0]
        q_nope[:tokens].copy_(batch["q_nope"])
        q_pe[:tokens].copy_(batch["q_pe"])
        decoder.plan(batch["indptr"], batch["indices"], batch["last"], heads, page_size, qo_indptr=batch["qo"],
                     sm_scale=SM_SCALE)
        return tokens

    load(first)
    decoder.run(q_nope, q_pe, cache, out=out, lse=lse)  # loads the module before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q_nope, q_pe, cache, out=out, lse=lse)
    for batch in (second, first):
        tokens = load(batch)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = mla_reference(batch["q_nope"], batch["q_pe"], cache.float(), None, batch["indptr"],
                                         batch["indices"], batch["last"], qo_indptr=batch["qo"], sm_scale=SM_SCALE)
        check(out[:tokens], lse[:tokens], ref_out, ref_lse, "replay after a re-plan")


GRID = dict(heads=[16, 32, 64, 128], q_len=[1, 2, 4], kv=["bf16", "e4m3"], page_size=[1, 16, 64])


def grid(test):
    """test over every combination of GRID's heads, query tokens, cache types and page sizes."""
    for name, values in reversed(GRID.items()):
        test = pytest.mark.parametrize(name, values)(test)
    return test


@grid
def test_eager_grid(engine, heads, q_len, kv, page_size):
    """Every head count, query length, cache type and page size, each request in one work item and
    split (chunks of 128), against the reference: rows that see no key (a request of one key or
    none under several query tokens) included."""
    check_eager(engine, heads, q_len, kv, page_size)


def check_eager(engine, heads, q_len, kv, page_size):
    kv_lens = [700, 1, 0, 333, 129, 1024]
    batch = make_batch(kv_lens, [q_len] * len(kv_lens), heads, page_size, 7 * heads + 3 * q_len + page_size)
    caches, scales, reference_caches = latent_caches(batch, kv)
    ref_out, ref_lse = reference(batch, reference_caches, scales)
    for split in (False, True):
        decoder, out, lse = plan_and_run(engine, batch, heads, page_size, kv, split, caches, scales)
        assert decoder.work.needs_merge == split
        check(out, lse, ref_out, ref_lse, f"{decoder.spec.name}, {'split' if split else 'unsplit'}")


@grid
def test_graph_grid(engine, heads, q_len, kv, page_size):
    """Every head count, query length, cache type and page size in a CUDA graph replayed after a
    re-plan for each batch: unsplit, skewed (its long request splits) and one request alone. One
    576-wide cache, fp8 with one scale in a tensor (read at launch, so each batch has its own)."""
    check_graph_replays(engine, heads, q_len, kv, page_size)


def check_graph_replays(engine, heads, q_len, kv, page_size):
    batches = [make_batch(lens, q_lens, heads, page_size, heads + q_len + i) for i, (lens, q_lens) in enumerate(
        [([300, 45, 0, 7], [q_len] * 4), ([5000, 20, 64, 1], [q_len, 1, q_len, 1]), ([1500], [q_len])])]
    rows, pages = max(b["q_nope"].shape[0] for b in batches), max(b["cache"].shape[0] for b in batches)
    decoder = BatchDecodeMLA(engine, use_cuda_graph=True, max_batch_size=4, max_num_pages=pages, max_q_len=q_len)
    fp8 = kv in FP8
    cache = torch.zeros(pages, page_size, 576, dtype=getattr(torch, KV_DTYPES[kv]), device="cuda")
    q_nope = torch.zeros(rows, heads, 512, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.zeros(rows, heads, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(rows, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(rows, heads, dtype=torch.float32, device="cuda")
    scale = torch.ones(1, dtype=torch.float32, device="cuda")

    def load(batch):
        stored, value = (quantize_latent(batch["cache"], kv) if fp8 else (batch["cache"], None))
        cache.view(torch.uint8).zero_()  # bytes: fp8 tensors have no fill
        cache[:stored.shape[0]].copy_(stored)
        if fp8:
            scale.copy_(value)
        tokens = batch["q_nope"].shape[0]
        q_nope[:tokens].copy_(batch["q_nope"])
        q_pe[:tokens].copy_(batch["q_pe"])
        decoder.plan(batch["indptr"], batch["indices"], batch["last"], heads, page_size, qo_indptr=batch["qo"],
                     sm_scale=SM_SCALE, kv_dtype=KV_DTYPES[kv] if fp8 else None)
        return tokens, stored.float() * (value if fp8 else 1.0)

    load(batches[0])
    scales = dict(ckv_scale=scale) if fp8 else {}
    decoder.run(q_nope, q_pe, cache, out=out, lse=lse, **scales)  # loads the module before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q_nope, q_pe, cache, out=out, lse=lse, **scales)
    for batch in batches[1:] + batches[:1]:
        tokens, reference_cache = load(batch)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = mla_reference(batch["q_nope"], batch["q_pe"], reference_cache, None, batch["indptr"],
                                         batch["indices"], batch["last"], qo_indptr=batch["qo"], sm_scale=SM_SCALE)
        where = f"{decoder.spec.name}: replay, {batch['last'].numel()} requests"
        check(out[:tokens], lse[:tokens], ref_out, ref_lse, where)


def engine_under(monkeypatch, **settings):
    """An engine whose MLA kernels take MLA_TUNING with settings (off by default until these tests
    pass and benchmarks/mla.py --sweep has timed them). The tiling is part of the kernels' index
    keys, so they share the run's cache with the default table's."""
    monkeypatch.setattr(mla_tiling_module, "MLA_TUNING", dataclasses.replace(mla_tiling_module.MLA_TUNING, **settings))
    return flashjit.Engine()


@pytest.fixture
def wgmma_fp8_engine(monkeypatch):
    """fp8 specs of 64-row tiles on the warpgroup kernel."""
    return engine_under(monkeypatch, wgmma_fp8=True)


WGMMA_FP8_CASES = [case for case in CASES if case[2] in FP8 and case[0] * case[1] >= 64]


@pytest.mark.parametrize("heads, q_len, kv, page_size, split, queries", WGMMA_FP8_CASES)
def test_fp8_latents_on_the_warpgroup_kernel(wgmma_fp8_engine, heads, q_len, kv, page_size, split, queries, seed):
    spec = MLASpec(num_heads=heads, dtype=queries, kv_dtype=kv, page_size=page_size, max_q_len=q_len, arch=arch())
    assert mla_tiling(spec).wgmma
    check_case(wgmma_fp8_engine, heads, q_len, kv, page_size, split, queries, seed)


@pytest.mark.parametrize("heads, q_len, page_size", [(128, 1, 64), (64, 2, 16), (128, 4, 1)])
def test_fp8_warpgroup_kernel_eager_and_in_graphs(wgmma_fp8_engine, heads, q_len, page_size):
    """The grid's checks on the warpgroup kernel with e4m3 latents: split and unsplit, and CUDA-graph
    replays after re-plans."""
    assert mla_tiling(MLASpec(num_heads=heads, kv_dtype="e4m3", page_size=page_size, max_q_len=q_len,
                              arch=arch())).wgmma
    check_eager(wgmma_fp8_engine, heads, q_len, "e4m3", page_size)
    check_graph_replays(wgmma_fp8_engine, heads, q_len, "e4m3", page_size)


@pytest.mark.parametrize("heads, q_len, kv, page_size", [(128, 1, "bf16", 64), (16, 2, "e4m3", 16), (64, 4, "bf16", 1)])
def test_the_merge_of_several_cells_at_once(monkeypatch, heads, q_len, kv, page_size):
    """The fused merge combining 4 cells a thread at once (MLATuning.merge_cells, 1 by default until
    timed), split and unsplit and in graph replays."""
    engine = engine_under(monkeypatch, merge_cells=4, merge_chunk=4)
    assert mla_tiling(MLASpec(num_heads=heads, kv_dtype=kv, page_size=page_size, max_q_len=q_len,
                              arch=arch())).merge_cells == 4
    check_eager(engine, heads, q_len, kv, page_size)
    check_graph_replays(engine, heads, q_len, kv, page_size)


def test_empty_batch_returns_without_launch(engine):
    decoder = BatchDecodeMLA(engine)
    empty = torch.zeros(1, dtype=torch.int32)
    decoder.plan(empty, torch.zeros(0, dtype=torch.int32, device="cuda"), torch.zeros(0, dtype=torch.int32), 16, 64,
                 sm_scale=SM_SCALE)
    q_nope = torch.zeros(0, 16, 512, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.zeros(0, 16, 64, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(1, 64, 576, dtype=torch.bfloat16, device="cuda")
    assert decoder.run(q_nope, q_pe, cache).shape == (0, 16, 512)
