"""Context-parallel decode on one GPU: every shard through BatchDecode one after another
(SequentialContextParallelDecode), merged by the merge_states kernel, against single-GPU decode of
the whole cache; and the key_range mask's kernels against the reference."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import flashjit
from flashjit.masks.registry import masks
from flashjit.parallel import SequentialContextParallelDecode, Shard
from flashjit.serving.reference import decode_reference

from .batches import assert_exact, make_batch, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the CPU suite's parallel_cases
import parallel_cases as cases  # noqa: E402

KV_LENS = [0, 1, 17, 300, 2048, 5000]
Q_LENS = [1, 4]
MASKS = cases.global_masks((100,))
LAYOUTS = [cases.Layout("contiguous"), cases.Layout("contiguous", uneven=True), cases.Layout("interleaved"),
           cases.Layout("interleaved", block_pages=4)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return flashjit.Engine(cache_dir=tmp_path_factory.mktemp("parallel-kernels"))


def single_decode(engine, b, mask, window_left, q_dtype):
    decoder = flashjit.BatchDecode(engine)
    decoder.plan(b.indptr, b.indices, b.last_page_len, 8, 2, b.q.shape[-1], b.page_size, qo_indptr=b.qo_indptr,
                 mask=mask, window_left=window_left, q_dtype=q_dtype)
    return decoder.run(b.q, (b.k_cache, b.v_cache), return_lse=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("q_len", Q_LENS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.kind}{l.block_pages}{'-uneven' if l.uneven else ''}")
@pytest.mark.parametrize("mask, window_left", MASKS, ids=str)
def test_sequential_shards_equal_single_gpu_decode(engine, dtype, head_dim, q_len, world, layout, mask, window_left):
    b = make_batch(KV_LENS, num_qo_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=16, dtype=dtype,
                   q_lens=q_len, seed=head_dim + world)
    want, want_lse = single_decode(engine, b, mask, window_left, dtype)
    parallel = SequentialContextParallelDecode(world, engine=engine)
    shards = [Shard.from_split(s, "cuda") for s in cases.splits(b, world, layout)]
    parallel.plan(shards, b.kv_lens, 8, 2, head_dim, b.page_size, qo_indptr=b.qo_indptr, mask=mask,
                  window_left=window_left, q_dtype=dtype)
    out, lse = parallel.run(b.q, (b.k_cache, b.v_cache), return_lse=True)
    assert out.dtype == dtype and not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref, ref_lse = decode_reference(b.q, b.k_cache, b.v_cache, b.indptr, b.indices, b.last_page_len,
                                    qo_indptr=b.qo_indptr, mask=mask,
                                    mask_params={} if window_left is None else {"window_left": window_left})
    assert_exact(out, lse, ref, ref_lse, tolerance(dtype), "shards against the reference")
    assert_exact(out, lse, want.float(), want_lse, tolerance(dtype), "shards against one GPU's decode")


def test_one_shard_is_the_single_decode(engine):
    b = make_batch(KV_LENS, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, q_lens=4, seed=5)
    want, _ = single_decode(engine, b, "causal", None, torch.bfloat16)
    parallel = SequentialContextParallelDecode(1, engine=engine)
    parallel.plan([Shard.from_split(cases.splits(b, 1, cases.Layout("contiguous"))[0], "cuda")], b.kv_lens, 8, 2, 128,
                  16, qo_indptr=b.qo_indptr, mask="causal", q_dtype=torch.bfloat16)
    out = parallel.run(b.q, (b.k_cache, b.v_cache))
    assert_exact(out, None, want.float(), None, tolerance(torch.bfloat16))


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cc", "tc"])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_key_range_kernels_match_the_reference(engine, tensor_cores, q_len, page_size):
    rng = random.Random(q_len * 100 + page_size)
    mask = masks.get("key_range")
    for seed in range(3):
        b = make_batch(KV_LENS, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size, q_lens=q_len,
                       seed=seed)
        params = mask.sample_params(rng, b.kv_lens, [q_len] * len(KV_LENS), page_size, "cuda")
        for chunk in (None, 16):
            decoder = flashjit.BatchDecode(engine)
            decoder.plan(b.indptr, b.indices, b.last_page_len, 8, 2, 128, page_size, qo_indptr=b.qo_indptr,
                         mask="key_range", mask_params=params, tensor_cores=tensor_cores, chunk_tokens=chunk)
            out, lse = decoder.run(b.q, (b.k_cache, b.v_cache), return_lse=True)
            ref, ref_lse = decode_reference(b.q, b.k_cache, b.v_cache, b.indptr, b.indices, b.last_page_len,
                                            qo_indptr=b.qo_indptr, mask="key_range", mask_params=params)
            assert_exact(out, lse, ref, ref_lse, tolerance(torch.bfloat16), decoder.spec.name)



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL ranks); one GPU runs the sequential tests")
@pytest.mark.parametrize("output", ["replicated", "heads"])
def test_nccl_ranks_equal_single_gpu_decode(output, tmp_path):
    import torch.multiprocessing as mp

    world = 4 if torch.cuda.device_count() >= 4 else 2  # divides the 8 query heads
    mp.spawn(cases.nccl_worker, args=(world, str(tmp_path / "store"), output), nprocs=world, join=True)
