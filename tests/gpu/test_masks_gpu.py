"""The masks whose key spans the host computes from their tensors (block_sparse, tree, sink_window,
key_range: every built-in the GPU planner does not plan) against the torch reference, through
check-mask's runner, over test_decode_gpu.py's matrix.

Each batch runs under every split policy and with random and zero queries
(flashjit.deploy.mask_check.check_batch), every row judged on its own; zero queries make the lse an
exact count of visible keys.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashjit
from flashjit.deploy import mask_check as cm
from flashjit.masks import sink_window
from flashjit.serving.reference import decode_reference
from flashjit.masks.registry import masks

from built_ins import HOST_SPAN_MASKS

from .batches import assert_exact, make_batch, tolerance

MASKS = HOST_SPAN_MASKS
DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
GROUPS = [1, 4, 7, 8]
PAGE_SIZES = [1, 16, 64]
Q_LENS = [1, 4]
CORES = [False, True]  # CUDA-core and tensor-core kernels
NUM_KV_HEADS = cm.NUM_KV_HEADS


@pytest.fixture(scope="session")
def engine():
    engine = flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    specs = [flashjit.DecodeSpec(d, dtype=dt, mask=m, page_size=p, group_size=g, max_q_len=q, arch=arch,
                                 tensor_cores=tc)
             for m, dt, d, g, p, q, tc in itertools.product(MASKS, DTYPES, HEAD_DIMS, GROUPS, PAGE_SIZES, Q_LENS, CORES)]
    engine.prewarm(specs, jobs=16)
    return engine


def failure_text(results, where: str) -> str:
    return "\n".join(f"{r.spec} split={r.split} probe={r.probe}: {'; '.join(r.failures)} ({where})"
                     for r in results if not r.passed)


@pytest.mark.parametrize("tensor_cores", CORES, ids=["cc", "tc"])
@pytest.mark.parametrize("q_len", Q_LENS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("mask", MASKS)
def test_matches_reference(engine, mask, dtype, head_dim, group, q_len, tensor_cores, rng):
    for page_size in PAGE_SIZES:
        kv_lens = cm.random_lengths(rng, page_size)
        q_lens = [min(q_len, n) for n in kv_lens]
        batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * group, num_kv_heads=NUM_KV_HEADS,
                           head_dim=head_dim, page_size=page_size, dtype=dtype, q_lens=q_lens,
                           seed=rng.randint(0, 1 << 30))
        params = cm.sample_params(masks.get(mask), rng, kv_lens, q_lens, page_size, "cuda")
        results = cm.check_batch(engine, batch, mask, params, tensor_cores=tensor_cores)
        assert len(results) == len(cm.SPLITS) * len(cm.PROBES)
        where = f"kv_lens={kv_lens} q_lens={q_lens} params: {cm.describe_params(params)}"
        assert all(r.passed for r in results), failure_text(results, where)


@pytest.mark.parametrize("tensor_cores", CORES, ids=["cc", "tc"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sink_window_never_reads_the_skipped_pages(engine, page_size, tensor_cores):
    """NaN in every page holding no walked key: reading any of them would put NaN in the output."""
    kv_lens, q_len, num_sink, window_left = [3000, 37, 1000], 4, 4, 100
    batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * 4, num_kv_heads=NUM_KV_HEADS, head_dim=128,
                       page_size=page_size, dtype=torch.bfloat16, q_lens=q_len, seed=7)
    params = sink_window.sink_window_params(kv_lens, q_len, num_sink=num_sink, window_left=window_left)
    ref, _ = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                              batch.last_page_len, qo_indptr=batch.qo_indptr, mask="sink_window", mask_params=params)
    poisoned = 0
    for r, kv_len in enumerate(kv_lens):
        read = {int(p) // page_size for p in sink_window.kv_positions(kv_len, q_len, num_sink, window_left)}
        pages = batch.indices[int(batch.indptr[r]):int(batch.indptr[r + 1])].long()
        skipped = [i for i in range(len(pages)) if i not in read]
        batch.k_cache[pages[skipped]] = float("nan")
        batch.v_cache[pages[skipped]] = float("nan")
        poisoned += len(skipped)
    assert poisoned > 0
    for split in cm.SPLITS:
        out, _, decoder = cm.plan_and_run(engine, batch, "sink_window", params, split, tensor_cores=tensor_cores)
        assert not out.isnan().any(), f"{decoder.spec.name} split={split} read a skipped page"
        assert_exact(out, None, ref, None, tolerance(torch.bfloat16), f"{decoder.spec.name} split={split}")


@pytest.fixture
def recent_mask_folder(isolated_masks, mask_file, tmp_path, monkeypatch):
    """A template-only mask in a folder on FLASHJIT_TEMPLATE_PATH: no flashjit code change."""
    folder = tmp_path / "user_masks"
    mask_file(folder, "recent", "return kv_pos <= q_pos && q_pos - kv_pos <= params.max_distance;",
              header="{# params: max_distance:int #}\n")
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", str(folder))
    return folder / "recent.cuh.j2"


SMALL_CASES = dict(groups=(1, 4), q_lens=(1, 4), page_sizes=(16,))


def test_template_folder_mask_passes_check_mask(recent_mask_folder, tmp_path):
    engine = flashjit.Engine(cache_dir=tmp_path / "cache")
    mask = masks.get("recent")
    assert mask.reference is None and mask.param_names == ("max_distance",)
    # No torch predicate: every run against the unsplit run (spans, merges, both kernels).
    report = cm.check_mask("recent", overrides={"max_distance": 37}, engine=engine,
                           cases=cm.random_cases(1, **SMALL_CASES))
    assert report.cases and report.gpu and report.passed, "\n".join(report.failures())
    # The same file with a predicate attached: now exact, against decode_reference.
    flashjit.register_mask("recent", template=recent_mask_folder, params={"max_distance": "int"},
                           reference=lambda q_pos, kv_pos, request, p: (kv_pos <= q_pos)
                           & (q_pos - kv_pos <= p["max_distance"]), replace=True)
    report = cm.check_mask("recent", engine=engine, cases=cm.random_cases(2, **SMALL_CASES))  # sampled max_distance
    assert report.passed, "\n".join(report.failures())


def test_check_mask_runner_fails_a_wrong_reference(isolated_masks, mask_file, tmp_path):
    """The runner's own sanity: a kernel that is causal, judged against a 'none' predicate, must fail."""
    flashjit.register_mask("causal_but_says_none", mask_file(tmp_path, "c", "return kv_pos <= q_pos;"),
                           reference=lambda q_pos, kv_pos, request, p: kv_pos >= 0)
    engine = flashjit.Engine(cache_dir=tmp_path / "cache")
    case = cm.Case("bfloat16", 128, 4, 4, 16, False, seed=3)
    result = cm.check_case(engine, "causal_but_says_none", case)
    assert not result.passed
    zero_q = [r for r in result.runs if r.probe == "zero q"]
    assert zero_q and all(not r.passed for r in zero_q)  # the count of visible keys differs in every split
