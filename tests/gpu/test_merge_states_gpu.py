"""The merge_states kernel against the torch path (merge_states_torch), and against one-pass decode,
row by row (flashjit.serving.exactness)."""

from __future__ import annotations

import pytest
import torch

import flashjit
from flashjit import merge_state, merge_states
from flashjit.serving.merge_states import merge_states_torch
from flashjit.serving.reference import decode_reference

from .batches import Tolerance, assert_exact, make_batch, tolerance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128, 256, 512]
COUNTS = [1, 2, 3, 7, 16, 64]


@pytest.fixture(scope="module")
def engine():
    return flashjit.Engine()  # the run's cache (tests/gpu/conftest.py)


def random_states(n, tokens, heads, dim, dtype, seed, dead_fraction=0.25):
    """States with about dead_fraction of them -inf (o NaN there), and some rows -inf in every state."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    o = torch.randn(n, tokens, heads, dim, generator=gen).to(dtype)
    lse = torch.randn(n, tokens, heads, generator=gen) * 8
    dead = torch.rand(n, tokens, heads, generator=gen) < dead_fraction
    dead[:, 0, 0] = True  # a row with no key at all
    lse[dead] = float("-inf")
    o[dead] = float("nan")
    return o.cuda(), lse.cuda()


def check_against_torch(merged, merged_lse, o, lse):
    """Row by row: the states' dtype rounds the output once, everything else is fp32 (the LSEs, up to
    about 30 here, within 1e-5 relative)."""
    want, want_lse = merge_states_torch(o, lse)
    assert_exact(merged, merged_lse, want.float(), want_lse, Tolerance(tolerance(o.dtype).out, 5e-4), f"{o.dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("n", COUNTS)
def test_kernel_matches_torch_path(engine, dtype, head_dim, n):
    o, lse = random_states(n, tokens=13, heads=6, dim=head_dim, dtype=dtype, seed=n * 1000 + head_dim)
    merged, merged_lse = merge_states(o, lse, engine=engine)
    check_against_torch(merged, merged_lse, o, lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_state_minus_inf_gives_zero_and_minus_inf(engine, dtype):
    o = torch.full((5, 3, 4, 128), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((5, 3, 4), float("-inf"), device="cuda")
    merged, merged_lse = merge_states(o, lse, engine=engine)
    assert (merged == 0).all() and (merged_lse == float("-inf")).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_and_strided_views(engine, dtype):
    o, lse = random_states(2, tokens=9, heads=8, dim=128, dtype=dtype, seed=3)
    merged, merged_lse = merge_state(o[0], lse[0], o[1], lse[1], engine=engine)
    check_against_torch(merged, merged_lse, o, lse)
    # heads 2..5 of a wider tensor: strided rows, read in place
    wide, wide_lse = random_states(4, tokens=9, heads=12, dim=128, dtype=dtype, seed=4)
    part, part_lse = wide[:, :, 2:6], wide_lse[:, :, 2:6]
    merged, merged_lse = merge_states(part, part_lse, engine=engine)
    check_against_torch(merged, merged_lse, part.contiguous(), part_lse.contiguous())
    # rows not on 16 bytes (one element off): copied first, same result
    shifted = torch.empty(o.numel() + 1, dtype=dtype, device="cuda")[1:].view_as(o).copy_(o)
    merged, merged_lse = merge_states(shifted, lse, engine=engine)
    check_against_torch(merged, merged_lse, o, lse)


def test_large_merge_inside_a_cuda_graph(engine):
    o, lse = random_states(8, tokens=512, heads=32, dim=128, dtype=torch.bfloat16, seed=9)
    out, out_lse = torch.empty_like(o[0]), torch.empty_like(lse[0])
    merge_states(o, lse, out=out, out_lse=out_lse, engine=engine)  # loads the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merge_states(o, lse, out=out, out_lse=out_lse, engine=engine)
    new_o, new_lse = random_states(8, 512, 32, 128, torch.bfloat16, seed=10)
    o.copy_(new_o)  # o is NaN where its lse is -inf: both change together
    lse.copy_(new_lse)
    graph.replay()
    torch.cuda.synchronize()
    check_against_torch(out, out_lse, o, lse)


@pytest.mark.parametrize("splits", [2, 5])
def test_decode_of_split_pages_merges_to_one_pass(engine, splits):
    """BatchDecode over disjoint page ranges of each request, merged, equals decode over all pages."""
    batch = make_batch([700, 1, 64, 2000], num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, seed=2)
    indptr, last = batch.indptr.tolist(), batch.last_page_len.tolist()
    states = []
    for s in range(splits):
        part_indptr, part_ids, part_last = [0], [], []
        for b in range(len(last)):
            pages = list(range(indptr[b], indptr[b + 1]))
            chunk = pages[s * len(pages) // splits:(s + 1) * len(pages) // splits]
            part_ids += chunk
            part_indptr.append(len(part_ids))
            part_last.append(0 if not chunk else (last[b] if chunk[-1] == pages[-1] else 16))
        ids = batch.indices[torch.tensor(part_ids, dtype=torch.long, device="cuda")] if part_ids else batch.indices[:0]
        decoder = flashjit.BatchDecode(engine)
        decoder.plan(torch.tensor(part_indptr, dtype=torch.int32), ids.contiguous(), torch.tensor(part_last, dtype=torch.int32),
                     8, 2, 128, 16)
        states.append(decoder.run(batch.q, (batch.k_cache, batch.v_cache), return_lse=True))
    merged, merged_lse = merge_states(torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states]),
                                      engine=engine)
    ref, ref_lse = decode_reference(batch.q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                    batch.last_page_len)
    assert_exact(merged, merged_lse, ref, ref_lse, tolerance(torch.bfloat16), f"{splits} splits")
