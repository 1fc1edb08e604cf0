"""Batch invariance: with plan(fixed_split_tokens=N), a request's output and LSE are bitwise the same
alone and at any position among any other requests, for every kernel family, KV dtype and mask.

Each case tracks two requests (one long enough to split into many items, one that fits in one),
puts each alone, then both at random positions among random others, on other pages of the cache
each time, and compares their rows with torch.equal. The caches hold each tracked request's K/V
at whatever pages the batch gives it; fp8 caches use fixed scales (a scale derived from the whole
cache, as quantize_kv does, would change with the batch). Multi-token cases keep the batch's
largest q_len equal to the tracked requests' (the kernel is built for the largest, and the
guarantee is among batches planned with the same kernel). The alone outputs are also checked
against the float32 reference, so the comparisons are of real attention.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import zlib

import pytest
import torch

import flashjit
from flashjit.worklist.record import WORK_ITEM_FIELDS
from flashjit.serving.reference import decode_reference

from built_ins import DEVICE_PLANNED_MASKS, SCALAR_PARAM_MASKS

from .batches import assert_exact, tolerance

PAGE = 16
NUM_KV_HEADS = 2
KV_SCALES = (0.07, 0.05)  # fp8 caches: K / 0.07 and V / 0.05 stored, the same in every batch
WINDOW = 5000  # the long tracked request still splits into several items
# (head_dim, kv dtype, mask, query tokens per tracked request, GQA group): tensor cores at group 4,
# CUDA cores (one row per KV head) at group 1. The masks whose parameters are all scalars: one value
# serves every batch (a tensor parameter is laid out for the batch it was made for).
CASES = [(d, kv, m, q, 4) for d, kv, m, q in itertools.product(
    [64, 128, 256], ["bfloat16", "float8_e4m3fn"], SCALAR_PARAM_MASKS, [1, 4])]
CASES += [(128, "bfloat16", "causal", 1, 1), (64, "float8_e4m3fn", "sliding_window", 1, 1),
          (256, "bfloat16", "none", 1, 1)]
TRIALS = 4  # batches with others per case
FIELD = {name: i for i, name in enumerate(WORK_ITEM_FIELDS)}


def spec_of(arch, head_dim, kv, mask, q_len, group):
    return flashjit.DecodeSpec(head_dim, dtype="bfloat16", kv_dtype=kv, mask=mask, page_size=PAGE,
                               group_size=group, max_q_len=q_len, arch=arch)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = flashjit.Engine(cache_dir=tmp_path_factory.mktemp("invariance-kernels"))
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    engine.prewarm([spec_of(arch, *case) for case in CASES], jobs=16)
    return engine


@dataclasses.dataclass(eq=False)  # found in a batch by identity
class Request:
    k: torch.Tensor  # [pages, PAGE, kv heads, head_dim], in the cache's dtype, on the GPU
    v: torch.Tensor
    q: torch.Tensor  # [q_len, qo heads, head_dim] bf16
    kv_len: int

    @property
    def pages(self) -> int:
        return self.k.shape[0]


def random_request(gen, kv_len, q_len, head_dim, group, kv_dtype) -> Request:
    pages = -(-kv_len // PAGE)
    shape = (pages, PAGE, NUM_KV_HEADS, head_dim)
    k = torch.randn(shape, generator=gen, device="cuda")
    v = torch.randn(shape, generator=gen, device="cuda")
    if kv_dtype == "bfloat16":
        k, v = k.bfloat16(), v.bfloat16()
    else:  # values of about 1 / scale, within e4m3's range
        fp8 = getattr(torch, kv_dtype)
        k, v = (k / KV_SCALES[0]).clamp(-400, 400).to(fp8), (v / KV_SCALES[1]).clamp(-400, 400).to(fp8)
    q = torch.randn((q_len, NUM_KV_HEADS * group, head_dim), generator=gen, device="cuda").bfloat16()
    return Request(k, v, q, kv_len)


@dataclasses.dataclass
class Batch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q: torch.Tensor
    indptr: torch.Tensor         # CPU int32
    indices: torch.Tensor        # GPU int32
    last_page_len: torch.Tensor  # CPU int32
    qo_indptr: torch.Tensor      # CPU int32
    rows: list                   # each request's query rows: (first, end)


def build_batch(requests: list[Request], rng: random.Random, spare_pages: int = 5) -> Batch:
    """The requests in this order, each on pages drawn at random from one cache."""
    total = sum(r.pages for r in requests) + spare_pages
    pages = list(range(total))
    rng.shuffle(pages)
    k0 = requests[0].k
    raw = torch.zeros((total,) + tuple(k0.shape[1:-1]) + (k0.shape[-1] * k0.element_size(),), dtype=torch.uint8,
                      device="cuda")
    k_cache, v_cache = raw.view(k0.dtype), raw.clone().view(k0.dtype)
    ids, at, rows, q_at = [], 0, [], 0
    for r in requests:
        own = torch.tensor(pages[at:at + r.pages], dtype=torch.long, device="cuda")
        at += r.pages
        # byte copies: index_copy_ does not take every fp8 dtype
        k_cache.view(torch.uint8).index_copy_(0, own, r.k.view(torch.uint8))
        v_cache.view(torch.uint8).index_copy_(0, own, r.v.view(torch.uint8))
        ids.append(own)
        rows.append((q_at, q_at + r.q.shape[0]))
        q_at += r.q.shape[0]
    counts = [r.pages for r in requests]
    indptr = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    last = torch.tensor([r.kv_len - (r.pages - 1) * PAGE if r.pages else 0 for r in requests], dtype=torch.int32)
    qo = torch.tensor([0] + [end for _, end in rows], dtype=torch.int32)
    indices = torch.cat(ids).to(torch.int32) if ids else torch.zeros(0, dtype=torch.int32, device="cuda")
    return Batch(k_cache, v_cache, torch.cat([r.q for r in requests]), indptr, indices, last, qo, rows)


def decode(decoder, batch: Batch, head_dim, kv_dtype, mask, chunk):
    num_qo_heads = batch.q.shape[1]
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, num_qo_heads, NUM_KV_HEADS, head_dim, PAGE,
                 qo_indptr=batch.qo_indptr, mask=mask, window_left=WINDOW if mask == "sliding_window" else None,
                 q_dtype=torch.bfloat16, kv_dtype=kv_dtype, fixed_split_tokens=chunk)
    scales = dict(zip(("k_scale", "v_scale"), KV_SCALES)) if kv_dtype != "bfloat16" else {}
    return decoder.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True, **scales)


def assert_matches_reference(out, batch: Batch, kv_dtype, mask):
    k, v = batch.k_cache, batch.v_cache
    if kv_dtype != "bfloat16":
        k, v = k.float() * KV_SCALES[0], v.float() * KV_SCALES[1]
    params = {"window_left": WINDOW} if mask == "sliding_window" else {}
    ref, _ = decode_reference(batch.q, k, v, batch.indptr, batch.indices, batch.last_page_len,
                              qo_indptr=batch.qo_indptr, mask=mask, mask_params=params)
    assert_exact(out, None, ref, None, tolerance(torch.bfloat16, kv_dtype), f"{kv_dtype} {mask}")


@pytest.mark.parametrize("head_dim, kv_dtype, mask, q_len, group", CASES)
def test_a_requests_output_is_bitwise_the_same_in_any_batch(engine, head_dim, kv_dtype, mask, q_len, group):
    seed = zlib.crc32(repr((head_dim, kv_dtype, mask, q_len, group)).encode())
    rng, gen = random.Random(seed), torch.Generator(device="cuda").manual_seed(seed)
    chunk = rng.choice([256, 1000, 2048])
    tracked = [random_request(gen, rng.randint(6000, 16000), q_len, head_dim, group, kv_dtype),
               random_request(gen, rng.randint(q_len, chunk), q_len, head_dim, group, kv_dtype)]
    decoder = flashjit.BatchDecode(engine)
    alone, items = [], []
    for request in tracked:
        batch = build_batch([request], rng)
        out, lse = decode(decoder, batch, head_dim, kv_dtype, mask, chunk)
        items.append(decoder.work.num_work)
        assert_matches_reference(out, batch, kv_dtype, mask)
        again = decode(decoder, build_batch([request], rng), head_dim, kv_dtype, mask, chunk)  # other pages
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
        alone.append((out.clone(), lse.clone()))
    assert items[0] > 2 and items[1] == 1  # split into several items, and written directly
    spec = decoder.spec
    for trial in range(TRIALS):
        others = [random_request(gen, 0 if rng.random() < 0.1 else rng.randint(1, 8000), rng.randint(1, q_len),
                                 head_dim, group, kv_dtype) for _ in range(rng.randint(1, 24))]
        order = others + tracked
        rng.shuffle(order)
        batch = build_batch(order, rng)
        out, lse = decode(decoder, batch, head_dim, kv_dtype, mask, chunk)
        assert decoder.spec == spec
        repeated = decoder.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True,
                               **(dict(zip(("k_scale", "v_scale"), KV_SCALES)) if kv_dtype != "bfloat16" else {}))
        assert torch.equal(repeated[0], out) and torch.equal(repeated[1], lse)  # the same launch twice
        for request, (want_out, want_lse) in zip(tracked, alone):
            first, end = batch.rows[next(i for i, r in enumerate(order) if r is request)]
            assert torch.equal(out[first:end], want_out), f"trial {trial}: output differs"
            assert torch.equal(lse[first:end], want_lse), f"trial {trial}: lse differs"
    assert decoder.work.fixed_split and decoder.work.chunk_tokens == chunk


@pytest.mark.parametrize("head_dim", [128, 256])
def test_cuda_graph_replays_planned_on_the_gpu_keep_the_eager_output(engine, head_dim):
    """The GPU planner writes fixed-split records too: replays after plan() of other batches give
    the tracked request the rows it has alone in eager mode."""
    rng, gen = random.Random(head_dim), torch.Generator(device="cuda").manual_seed(head_dim)
    kv, mask, chunk, max_batch = "bfloat16", "causal", 1000, 16
    tracked = random_request(gen, 12000, 1, head_dim, 4, kv)
    eager = flashjit.BatchDecode(engine)
    want_out, want_lse = decode(eager, build_batch([tracked], rng), head_dim, kv, mask, chunk)

    batches = []
    for _ in range(4):
        order = [random_request(gen, rng.randint(0, 9000), 1, head_dim, 4, kv) for _ in range(rng.randint(1, 15))]
        order.insert(rng.randint(0, len(order)), tracked)
        batches.append((build_batch(order, rng), next(i for i, r in enumerate(order) if r is tracked)))
    max_pages = max(b.k_cache.shape[0] for b, _ in batches)
    k_static = torch.zeros((max_pages,) + tuple(tracked.k.shape[1:]), dtype=tracked.k.dtype, device="cuda")
    v_static = torch.zeros_like(k_static)
    q_static = torch.zeros((max_batch,) + tuple(tracked.q.shape[1:]), dtype=torch.bfloat16, device="cuda")
    out_static, lse_static = torch.zeros_like(q_static), torch.zeros(q_static.shape[:2], device="cuda")
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=max_batch, max_num_pages=max_pages)

    def plan(batch):
        k_static[: batch.k_cache.shape[0]].copy_(batch.k_cache)
        v_static[: batch.v_cache.shape[0]].copy_(batch.v_cache)
        q_static[: batch.q.shape[0]].copy_(batch.q)
        decoder.plan(batch.indptr, batch.indices, batch.last_page_len, q_static.shape[1], NUM_KV_HEADS, head_dim,
                     PAGE, qo_indptr=batch.qo_indptr, mask=mask, q_dtype=torch.bfloat16, kv_dtype=kv,
                     fixed_split_tokens=chunk)

    plan(batches[0][0])
    assert decoder.graph_page_table is not None  # planned on the GPU
    decoder.run(q_static, (k_static, v_static), out=out_static, lse=lse_static)  # loads outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(q_static, (k_static, v_static), out=out_static, lse=lse_static)
    for batch, at in batches[1:] + batches[:1]:
        plan(batch)
        out_static.fill_(float("nan"))
        graph.replay()
        assert decoder.work.fixed_split and decoder.work.num_work > len(batch.rows)
        first, end = batch.rows[at]
        assert torch.equal(out_static[first:end], want_out) and torch.equal(lse_static[first:end], want_lse)


def test_a_fixed_split_over_the_gpu_planners_capacity_is_refused(engine):
    """A CUDA-graph decoder sized by a planned first plan holds fewer items than a small fixed split
    can make: plan() refuses it rather than let the GPU planner fall back to one item per request."""
    rng, gen = random.Random(1), torch.Generator(device="cuda").manual_seed(1)
    requests = [random_request(gen, 20000, 1, 128, 4, "bfloat16") for _ in range(4)]
    batch = build_batch(requests, rng)
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=4, max_num_pages=batch.k_cache.shape[0])
    args = (batch.indptr, batch.indices, batch.last_page_len, 8, NUM_KV_HEADS, 128, PAGE)
    decoder.plan(*args, mask="causal")
    planned = decoder.current_plan
    with pytest.raises(ValueError, match="^fixed_split_tokens: expected at most"):
        decoder.plan(*args, mask="causal", fixed_split_tokens=16)
    assert decoder.current_plan is planned


def device_records(decoder) -> torch.Tensor:
    """The work-item records the current plan wrote to the device."""
    plan = decoder.current_plan
    values, at = plan.buffers.device_buffer.cpu(), plan.buffers.offsets
    num_work = int(values[at["req_work_indptr"] + plan.batch_size])
    return values[at["work_items"]:at["num_tokens"]].view(-1, len(WORK_ITEM_FIELDS))[:num_work]


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("mask", DEVICE_PLANNED_MASKS)
def test_the_gpu_planner_writes_the_host_planners_fixed_split_records(engine, head_dim, mask):
    rng = random.Random(head_dim + len(mask))
    options = dict(use_cuda_graph=True, max_batch_size=64, max_num_pages=20000)
    on_gpu = flashjit.BatchDecode(engine, **options)
    on_host = flashjit.BatchDecode(engine, load_kernel=lambda kernel, index: dataclasses.replace(
        kernel.loaded(index), plan=None), **options)  # without its planner entry: plans on the host
    for batch in (64, 1, 23, 64):
        kv_lens = [0 if rng.random() < 0.1 else rng.randint(1, 4800) for _ in range(batch)]
        pages = [-(-n // PAGE) for n in kv_lens]
        indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
        ids = torch.randperm(20000, dtype=torch.int32)[: sum(pages)].cuda()
        for decoder in (on_gpu, on_host):
            decoder.plan(indptr, ids, last, 8, NUM_KV_HEADS, head_dim, PAGE, mask=mask,
                         window_left=WINDOW if mask == "sliding_window" else None, fixed_split_tokens=512)
        assert on_gpu.graph_page_table is not None and on_host.graph_page_table is None
        gpu, host = device_records(on_gpu), device_records(on_host)
        assert torch.equal(gpu, host), f"{batch} requests"
        assert (gpu[:, FIELD["sharers"]] == 1).all()
        assert torch.equal(gpu[:, FIELD["share_begin"]], gpu[:, FIELD["v_begin"]])
