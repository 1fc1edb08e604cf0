"""Zero queries count the keys each row reads (flashjit.serving.exactness): with q = 0 every visible
key weighs 1, so a row's LSE is ln(keys read), and one key skipped, read twice or read from another
page moves it. Every built-in mask (taken from the registry: a new one is covered without an edit
here) on every kernel path (CUDA cores and tensor cores, 16-bit and fp8 caches), under every kind
of split, eager and replayed from a CUDA graph after re-plans, beside a request of 65,637 keys;
random queries in the same runs, judged row by row. MLA and shared-prefix decode likewise.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashjit
from flashjit.deploy import mask_check as cm
from flashjit.masks.registry import masks
from flashjit.serving.batch_mla import BatchDecodeMLA
from flashjit.serving.mla_reference import mla_reference
from flashjit.serving.quantize import dequantize_kv, quantize_kv
from flashjit.serving.reference import decode_reference

from built_ins import BUILT_IN_MASKS

from .batches import assert_exact, check_key_counts, key_counts, make_batch, tolerance
from .test_mla_gpu import SM_SCALE, latent_caches, mla_tolerance, rounded_pe
from .test_mla_gpu import make_batch as latent_batch

# kernel path -> (query dtype, cache dtype, tensor cores, head_dim, GQA group)
PATHS = {
    "cuda_cores": ("bfloat16", "bfloat16", False, 128, 1),
    "tensor_cores": ("bfloat16", "bfloat16", True, 128, 4),
    "fp8_tensor_cores": ("bfloat16", "float8_e4m3fn", True, 128, 4),
    "fp8_cuda_cores": ("float16", "float8_e5m2", False, 64, 1),
}
LONG = 65_637  # keys: past 64k, and no page multiple
KV_HEADS, PAGE, Q_LEN = 2, 16, 3
POOL = LONG // PAGE + 600  # pages of the CUDA-graph tests' cache


@pytest.fixture(scope="module")
def engine():
    return flashjit.Engine()  # the run's cache (tests/gpu/conftest.py): shared across test processes


def test_every_built_in_mask_is_here():
    assert {"none", "causal", "sliding_window", "block_sparse", "tree", "sink_window", "key_range"} <= set(BUILT_IN_MASKS)


def cache_of(k, v, kv_dtype: str):
    """(cache the kernel reads, its scales, (k, v) the reference reads: dequantized for fp8)."""
    if not kv_dtype.startswith("float8"):
        return (k, v), (None, None), (k, v)
    (k8, k_scale), (v8, v_scale) = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
    return (k8, v8), (k_scale.item(), v_scale.item()), (dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale))


def probes(q):
    return (("random q", q), ("zero q", torch.zeros_like(q)))


def check_run(out, lse, ref, ref_lse, counts, tol, probe: str, where: str):
    assert_exact(out, lse, ref, ref_lse, tol, where)
    if probe == "zero q":
        failures = check_key_counts(lse, counts)
        assert not failures, "; ".join(failures) + f" ({where})"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", BUILT_IN_MASKS)
def test_every_key_is_counted_under_every_split(engine, mask, path, rng, seed):
    q_dtype, kv_dtype, tensor_cores, head_dim, group = PATHS[path]
    kv_lens = [0, 1, 17, 3 * PAGE + 1, 700, LONG]
    rng.shuffle(kv_lens)
    q_lens = [min(Q_LEN, n) for n in kv_lens]
    batch = make_batch(kv_lens, num_qo_heads=KV_HEADS * group, num_kv_heads=KV_HEADS, head_dim=head_dim,
                       page_size=PAGE, dtype=getattr(torch, q_dtype), q_lens=q_lens, seed=seed)
    cache, scales, (k_ref, v_ref) = cache_of(batch.k_cache, batch.v_cache, kv_dtype)
    params = cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, PAGE, "cuda")
    tol = tolerance(q_dtype, kv_dtype)
    refs = {probe: decode_reference(q, k_ref, v_ref, batch.indptr, batch.indices, batch.last_page_len,
                                    qo_indptr=batch.qo_indptr, mask=mask, mask_params=params)
            for probe, q in probes(batch.q)}
    counts = key_counts(refs["zero q"][1])
    if mask == "none":
        assert int(counts.max()) == LONG
    for split, (probe, q) in itertools.product(cm.SPLITS, probes(batch.q)):
        decoder = flashjit.BatchDecode(engine)
        decoder.plan(batch.indptr, batch.indices, batch.last_page_len, q.shape[1], KV_HEADS, head_dim, PAGE,
                     qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, q_dtype=q.dtype, kv_dtype=kv_dtype,
                     tensor_cores=tensor_cores, **cm.split_options(split, kv_lens))
        assert decoder.spec.tensor_cores == tensor_cores
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device="cuda")
        decoder.run(q, cache, out=out, lse=lse, k_scale=scales[0], v_scale=scales[1])
        where = (f"{decoder.spec.name} split={split} probe={probe} items={decoder.work.num_work} kv_lens={kv_lens} "
                 f"params: {cm.describe_params(params)}")
        check_run(out, lse, *refs[probe], counts, tol, probe, where)


class StaticParams:
    """Mask parameters for a captured graph: the first plan's scalars (a replay launches with the
    values captured), each plan's tensors written in place into buffers of one address each."""

    def __init__(self):
        self.scalars, self.buffers = None, {}

    def __call__(self, params: dict) -> dict:
        if self.scalars is None:
            self.scalars = {k: v for k, v in params.items() if not torch.is_tensor(v)}
        fixed = dict(self.scalars)
        for name, value in params.items():
            if torch.is_tensor(value):
                buffer = self.buffers.setdefault(name, torch.zeros(1 << 17, dtype=value.dtype, device="cuda"))
                buffer[:value.numel()].copy_(value.flatten())
                fixed[name] = buffer[:value.numel()]
        return fixed


def page_tables(kv_lens, q_lens, gen):
    pages = [-(-n // PAGE) for n in kv_lens]
    ids = torch.randperm(POOL, generator=gen)[:sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    return indptr, ids.cuda(), last, qo


GRAPH_BATCHES = ([100, 3000, 17, 1], [LONG, 0, 1, 40, 900, 16, 33, 5000], [1], [LONG, 2])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", BUILT_IN_MASKS)
def test_graph_replays_after_replans_count_every_key(engine, mask, path, rng, seed):
    q_dtype, kv_dtype, tensor_cores, head_dim, group = PATHS[path]
    dtype, heads = getattr(torch, q_dtype), KV_HEADS * group
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, PAGE, KV_HEADS, head_dim, generator=gen).to(dtype).cuda()
    v = torch.randn(POOL, PAGE, KV_HEADS, head_dim, generator=gen).to(dtype).cuda()
    cache, scales, (k_ref, v_ref) = cache_of(k, v, kv_dtype)
    max_batch = max(map(len, GRAPH_BATCHES))
    q_static = torch.zeros(max_batch * Q_LEN, heads, head_dim, dtype=dtype, device="cuda")
    out_static = torch.zeros_like(q_static)
    lse_static = torch.zeros(q_static.shape[:2], device="cuda")
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=max_batch, max_num_pages=POOL,
                                   max_q_len=Q_LEN)
    static, tol = StaticParams(), tolerance(q_dtype, kv_dtype)

    def plan(kv_lens):
        q_lens = [min(Q_LEN, n) for n in kv_lens]
        tables = page_tables(kv_lens, q_lens, gen)
        params = static(cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, PAGE, "cuda"))
        decoder.plan(*tables[:3], heads, KV_HEADS, head_dim, PAGE, qo_indptr=tables[3], mask=mask, mask_params=params,
                     q_dtype=dtype, kv_dtype=kv_dtype, tensor_cores=tensor_cores)
        return tables, params

    def launch():
        decoder.run(q_static, cache, out=out_static, lse=lse_static, k_scale=scales[0], v_scale=scales[1])

    plan(GRAPH_BATCHES[0])
    launch()  # loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for kv_lens in GRAPH_BATCHES:
        (indptr, ids, last, qo), params = plan(kv_lens)
        tokens = int(qo[-1])
        refs = {}
        for probe, q in probes(torch.randn(q_static.shape, generator=gen).to(dtype)):
            q_static.copy_(q)
            out_static.fill_(float("nan"))
            lse_static.fill_(float("nan"))
            graph.replay()
            refs[probe] = decode_reference(q_static[:tokens], k_ref, v_ref, indptr, ids, last, qo_indptr=qo,
                                           mask=mask, mask_params=params)
            counts = key_counts(refs["zero q"][1]) if probe == "zero q" else None
            where = (f"{decoder.spec.name} replay probe={probe} items={decoder.work.num_work} kv_lens={kv_lens} "
                     f"params: {cm.describe_params(params)}")
            check_run(out_static[:tokens], lse_static[:tokens], *refs[probe], counts, tol, probe, where)


@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
@pytest.mark.parametrize("split", ["auto", "one", "many"])
def test_mla_counts_every_key(engine, kv, split, seed):
    heads, page = 16, 64
    kv_lens, q_lens = [LONG, 0, 1, 700, 129], [2, 2, 1, 2, 1]
    batch = latent_batch(kv_lens, q_lens, heads, page, seed)
    caches, scales, reference_caches = latent_caches(batch, kv)
    options = {"auto": {}, "one": {"disable_split_kv": True}, "many": {"chunk_tokens": 64}}[split]
    decoder = BatchDecodeMLA(engine)
    decoder.plan(batch["indptr"], batch["indices"], batch["last"], heads, page, qo_indptr=batch["qo"],
                 sm_scale=SM_SCALE, kv_dtype=None if kv == "bf16" else "e4m3", **options)
    for probe, factor in (("random q", 1.0), ("zero q", 0.0)):
        q_nope, q_pe = batch["q_nope"] * factor, batch["q_pe"] * factor
        out, lse = decoder.run(q_nope, q_pe, *caches, return_lse=True, ckv_scale=scales[0], kpe_scale=scales[1])
        ref, ref_lse = mla_reference(q_nope, rounded_pe(q_pe, scales), *reference_caches, batch["indptr"],
                                     batch["indices"], batch["last"], qo_indptr=batch["qo"], sm_scale=SM_SCALE)
        where = f"{decoder.spec.name} split={split} probe={probe} items={decoder.work.num_work}"
        counts = key_counts(ref_lse) if probe == "zero q" else None
        check_run(out, lse, ref, ref_lse, counts, mla_tolerance(q_nope), probe, where)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_shared_prefix_counts_every_key(engine, graph, seed):
    """Four samples of a 65,637-key prompt (its pages read once for all of them) beside requests of
    their own, eager and replayed after re-plans (CUDA-graph mode with share_prefixes=True)."""
    heads, dim = 8, 128
    gen = torch.Generator().manual_seed(seed)
    pool = LONG // PAGE + 300
    k = torch.randn(pool, PAGE, KV_HEADS, dim, generator=gen).bfloat16().cuda()
    v = torch.randn(pool, PAGE, KV_HEADS, dim, generator=gen).bfloat16().cuda()
    order = torch.randperm(pool, generator=gen).tolist()
    prompt, rest = order[:LONG // PAGE + 1], iter(order[LONG // PAGE + 1:])
    steps = [[prompt + [next(rest) for _ in range(n)] for n in (0, 1, 3, 7)] + [[next(rest) for _ in range(5)]],
             [prompt[:40] + [next(rest)] for _ in range(6)] + [prompt + [next(rest)]]]
    graph_mode = dict(use_cuda_graph=True, max_batch_size=8, max_num_pages=8 * (LONG // PAGE + 10))
    decoder = flashjit.BatchDecode(engine, **(graph_mode if graph else {}))
    q_static = torch.zeros(8, heads, dim, dtype=torch.bfloat16, device="cuda")
    out_static, lse_static = torch.zeros_like(q_static), torch.zeros(8, heads, device="cuda")
    replay = None
    for lists in steps:
        indptr = torch.tensor([0] + list(itertools.accumulate(map(len, lists))), dtype=torch.int32)
        ids = torch.tensor([i for p in lists for i in p], dtype=torch.int32).cuda()
        last = torch.tensor([(LONG - 1) % PAGE + 1] * len(lists), dtype=torch.int32)
        decoder.plan(indptr, ids, last, heads, KV_HEADS, dim, PAGE, mask="causal", share_prefixes=True)
        assert decoder.spec.shared_prefix
        n = len(lists)
        if graph and replay is None:
            decoder.run(q_static, (k, v), out=out_static, lse=lse_static)
            replay = torch.cuda.CUDAGraph()
            with torch.cuda.graph(replay):
                decoder.run(q_static, (k, v), out=out_static, lse=lse_static)
        for probe, q in probes(torch.randn(8, heads, dim, generator=gen).bfloat16().cuda()):
            q_static.copy_(q)
            out_static.fill_(float("nan"))
            lse_static.fill_(float("nan"))
            if graph:
                replay.replay()
            else:
                decoder.run(q_static[:n], (k, v), out=out_static[:n], lse=lse_static[:n])
            ref, ref_lse = decode_reference(q_static[:n], k, v, indptr, ids, last, mask="causal")
            counts = key_counts(ref_lse) if probe == "zero q" else None
            where = f"{decoder.spec.name} probe={probe} items={decoder.work.num_work} lengths={[len(p) for p in lists]}"
            check_run(out_static[:n], lse_static[:n], ref, ref_lse, counts, tolerance("bfloat16"), probe, where)
