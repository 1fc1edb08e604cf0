"""The suite's checks are sharp: each deliberately broken kernel (tests/fault_injection.py: a work item
skipped, a merge partial dropped, a page id read off by one) fails them on each kernel path, where
the unbroken kernels pass the same checks on the same batch. The checks are the ones the suite's
tests call: check-mask's check_batch (every split, random and zero queries, row by row and key
counts) for the decode paths, and the row and count checks of the MLA and shared-prefix tests.

Which checks caught each fault is recorded as the test's `caught_by` property (in a --junitxml
report). `pytest tests/gpu --inject-fault FAULT:PATH` runs the whole suite against one broken path.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import flashjit
from fault_injection import FAULTS, PATHS, faulted_engine
from flashjit.deploy import mask_check as cm
from flashjit.masks.registry import masks
from flashjit.serving.batch_mla import BatchDecodeMLA
from flashjit.serving.reference import decode_reference

from .batches import check_key_counts, check_rows, key_counts, make_batch, tolerance
from .test_mla_gpu import SM_SCALE, latent_caches, mla_tolerance, reference
from .test_mla_gpu import make_batch as latent_batch

KV_LENS = [0, 1, 17, 49, 700, 5000]  # several pages, and a request long enough to split many ways
DECODE_PATHS = {  # path -> (plan's tensor_cores, cache dtype, GQA group)
    "cuda_cores": (False, None, 1),
    "tensor_cores": (True, None, 4),
    "fp8": (None, "float8_e4m3fn", 4),
}


def decode_failures(engine, path: str, seed: int) -> list[str]:
    tensor_cores, kv_dtype, group = DECODE_PATHS[path]
    rng = random.Random(seed)
    q_lens = [min(2, n) for n in KV_LENS]
    batch = make_batch(KV_LENS, num_qo_heads=2 * group, num_kv_heads=2, head_dim=128, page_size=16, q_lens=q_lens,
                       seed=seed)
    params = cm.sample_params(masks.get("causal"), rng, KV_LENS, q_lens, 16, "cuda")
    results = cm.check_batch(engine, batch, "causal", params, tensor_cores=tensor_cores, kv_dtype=kv_dtype)
    assert all(("_tc" in r.spec) == (path != "cuda_cores") and ("kve4m3" in r.spec) == (path == "fp8")
               for r in results)
    return [f"check_batch {r.split}/{r.probe}: {r.failures[0]}" for r in results if not r.passed]


def mla_failures(engine, seed: int) -> list[str]:
    kv_lens, q_lens = [700, 1, 0, 333, 2000], [2, 1, 2, 2, 1]
    batch = latent_batch(kv_lens, q_lens, 16, 16, seed)
    caches, scales, reference_caches = latent_caches(batch, "bf16")
    failures = []
    for options, factor in itertools.product(({"disable_split_kv": True}, {"chunk_tokens": 64}), (1.0, 0.0)):
        decoder = BatchDecodeMLA(engine)
        decoder.plan(batch["indptr"], batch["indices"], batch["last"], 16, 16, qo_indptr=batch["qo"],
                     sm_scale=SM_SCALE, **options)
        q_nope, q_pe = batch["q_nope"] * factor, batch["q_pe"] * factor
        out, lse = decoder.run(q_nope, q_pe, *caches, return_lse=True)
        ref, ref_lse = reference(batch, reference_caches, scales, q_nope, q_pe)
        what = f"mla {options} q x {factor}"
        failures += [f"{what}: {f}" for f in check_rows(out, lse, ref, ref_lse, mla_tolerance(out)).failures]
        if factor == 0.0:
            failures += [f"{what}: {f}" for f in check_key_counts(lse, key_counts(ref_lse))]
    return failures


def shared_prefix_failures(engine, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    pool, heads = 400, 32
    k = torch.randn(pool, 16, 8, 128, generator=gen).bfloat16().cuda()
    v = torch.randn(pool, 16, 8, 128, generator=gen).bfloat16().cuda()
    order = torch.randperm(pool, generator=gen).tolist()
    prompt, rest = order[:120], iter(order[120:])
    lists = [prompt + [next(rest) for _ in range(n)] for n in (1, 3, 0, 9, 2, 5)]
    indptr = torch.tensor([0] + list(itertools.accumulate(map(len, lists))), dtype=torch.int32)
    ids = torch.tensor([i for p in lists for i in p], dtype=torch.int32).cuda()
    last = torch.tensor([7, 16, 1, 9, 12, 3], dtype=torch.int32)
    decoder = flashjit.BatchDecode(engine).plan(indptr, ids, last, heads, 8, 128, 16, mask="causal",
                                                share_prefixes=True)
    assert decoder.spec.shared_prefix
    failures = []
    for factor in (1.0, 0.0):
        q = torch.randn(len(lists), heads, 128, generator=gen).bfloat16().cuda() * factor
        out, lse = decoder.run(q, (k, v), return_lse=True)
        ref, ref_lse = decode_reference(q, k, v, indptr, ids, last, mask="causal")
        failures += [f"shared prefix q x {factor}: {f}"
                     for f in check_rows(out, lse, ref, ref_lse, tolerance(torch.bfloat16)).failures]
        if factor == 0.0:
            failures += [f"shared prefix q x 0: {f}" for f in check_key_counts(lse, key_counts(ref_lse))]
    return failures


def failures_of(path: str, engine, seed: int) -> list[str]:
    if path == "mla":
        return mla_failures(engine, seed)
    if path == "shared_prefix":
        return shared_prefix_failures(engine, seed)
    return decode_failures(engine, path, seed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_fails_the_checks_of_each_path(fault, path, tmp_path, seed, record_property, injected_fault):
    if injected_fault is not None:
        pytest.skip(f"this session runs the broken kernels of --inject-fault {injected_fault}: no clean baseline")
    clean = failures_of(path, flashjit.Engine(), seed)
    assert not clean, f"the unbroken kernels fail the {path} checks: " + "; ".join(clean[:3])
    with faulted_engine(fault, path):
        caught = failures_of(path, flashjit.Engine(cache_dir=tmp_path), seed)
    record_property("caught_by", " | ".join(caught))
    assert caught, f"fault {fault!r} on the {path} path passed every check"
