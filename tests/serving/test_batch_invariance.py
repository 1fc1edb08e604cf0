"""plan(fixed_split_tokens=N) on the CPU: a request's work items, and the tiles each of its CTAs reads,
depend on the request alone, whatever else is in the batch and wherever it sits in it.

The kernels' side is emulated from the work records: SharedTiles (worklist/kernel_core.cuh) gives each CTA
of a tile-sharing group a static run and, when the group's tiles outrun the static runs, a pool it
claims from at run time (timing-dependent, so batch-dependent). Under a fixed split no group has a
pool, at every tiling of TUNING; under the planned split the 16-bit head_dim 256 tiling has one,
which is what the emulation must detect. tests/gpu/test_batch_invariance_gpu.py checks the outputs
bitwise on a GPU.
"""

from __future__ import annotations

import functools
import tempfile

import numpy as np
import pytest
import torch

from flashjit.serving.host_plan import load_host_plan
from flashjit.worklist.record import WORK_ITEM_FIELDS
from flashjit.jit.cache import KernelCache
from flashjit.kernels.worklist_kernel import LoadedKernel
from flashjit.kernels.decode.tiling import TUNING, decode_tiling
from flashjit.serving.batch_decode import BatchDecode
from flashjit.worklist.host import HostPlanner, item_records

from built_ins import SCALAR_PARAM_MASKS

CPU = torch.device("cpu")
FIELD = {name: i for i, name in enumerate(WORK_ITEM_FIELDS)}
# The fields that say what a CTA computes; request, page_begin and q_begin only say where its request sits.
COMPUTED = [FIELD[name] for name in ("v_begin", "v_end", "kv_len", "q_len", "splits", "share", "share_begin",
                                     "share_end", "sharers")]
# (kv dtype, head_dim, tensor_cores): a case for every tiling the kernels have (TUNING's rows and the CUDA cores).
TILINGS = [("float8_e4m3fn" if row.fp8 else "bfloat16", row.head_dim, True) for row in TUNING.tensor_cores]
TILINGS += [("bfloat16", 128, False), ("bfloat16", 96, False)]
# The masks whose parameters are all scalars: one value serves every batch (a tensor parameter is
# laid out for the batch it was made for); sliding_window's window still splits the long requests.
MASKS = [(mask, 1000 if mask == "sliding_window" else None) for mask in SCALAR_PARAM_MASKS]


def fake_loaded(kernel, device_index) -> LoadedKernel:
    return LoadedKernel(None, 0xD0, 0xE0, 2, 132)  # an H200's 132 SMs, 2 CTAs each


@functools.cache
def native_library():
    return load_host_plan(KernelCache(tempfile.mkdtemp(prefix="flashjit-test-host-")))


def decoder_of(engine, native: bool, **options) -> BatchDecode:
    if native and native_library() is None:
        pytest.skip("no C compiler: plan() uses the numpy planner")
    return BatchDecode(engine, CPU, arch="sm_90", load_kernel=fake_loaded,
                       host_planner=HostPlanner(native_library() if native else None), **options)


@pytest.fixture
def planner(engine, fake_nvrtc):
    return engine


def page_table(kv_lens, q_lens, page_size, rng):
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32)
    ids = torch.from_numpy(rng.permutation(sum(pages) + 3)[: sum(pages)].astype(np.int32))
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    qo = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return indptr, ids, last, qo


def plan_batch(decoder, kv_lens, q_lens, *, kv_dtype, head_dim, tensor_cores, mask, window, rng, **split):
    indptr, ids, last, qo = page_table(kv_lens, q_lens, 16, rng)
    decoder.plan(indptr, ids, last, 16, 4, head_dim, 16, qo_indptr=qo, mask=mask, window_left=window,
                 kv_dtype=kv_dtype, tensor_cores=tensor_cores, **split)
    plan = decoder.current_plan
    return item_records(plan.buffers.host, plan.buffers.starts)[:plan.work.num_work].copy()


def request_records(records, request: int) -> np.ndarray:
    """The request's records, in order, with only the fields that decide what its CTAs compute."""
    return records[records[:, FIELD["request"]] == request][:, COMPUTED]


def cta_tiles(record, tile: int, stages: int, static_share: int, page_size: int = 16):
    """(first span position of each tile a CTA of this record reads statically, whether its group
    has a pool of tiles claimed at run time), as SharedTiles computes them where static_share < 100;
    at 100 the CTA streams its item's own tiles."""
    f = dict(zip(WORK_ITEM_FIELDS, record))
    begin, end = (f["share_begin"], f["share_end"]) if static_share < 100 else (f["v_begin"], f["v_end"])
    tile_begin = begin - begin % page_size
    total = -(-(end - tile_begin) // tile)
    if static_share == 100:
        return [tile_begin + t * tile for t in range(total)], False
    sharers, share = f["sharers"], f["share"]
    fair = -(-total // sharers)
    head = fair if sharers == 1 or fair <= stages + 1 else max(stages + 1, fair * static_share // 100)
    first, pool = share * head, sharers * head
    return [tile_begin + t * tile for t in range(first, min(first + head, total))], pool < total


def assert_reads_exactly_its_items(records, tiling):
    """Every CTA reads the tiles of its own item's span, statically, with no pool to claim from."""
    for record in records:
        tiles, claims = cta_tiles(record, tiling.tile_tokens, tiling.stages, tiling.static_share)
        f = dict(zip(WORK_ITEM_FIELDS, record))
        own = cta_tiles(record, tiling.tile_tokens, tiling.stages, 100)[0]
        assert not claims and tiles == own, f
        assert (f["share_begin"], f["share_end"], f["sharers"], f["share"]) == (f["v_begin"], f["v_end"], 1, 0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("kv_dtype, head_dim, tensor_cores", TILINGS)
def test_a_requests_items_do_not_depend_on_the_batch(planner, native, kv_dtype, head_dim, tensor_cores):
    rng = np.random.default_rng(head_dim + (7 if kv_dtype != "bfloat16" else 0) + native)
    decoder = decoder_of(planner, native)
    for trial in range(6):
        mask, window = MASKS[trial % len(MASKS)]
        chunk = int(rng.choice([64, 100, 512, 2048]))
        target_kv, target_q = int(rng.integers(1, 9000)), int(rng.integers(1, 4))
        options = dict(kv_dtype=kv_dtype, head_dim=head_dim, tensor_cores=tensor_cores, mask=mask, window=window,
                       rng=rng, fixed_split_tokens=chunk)
        # alone, its kernel built for 3 query tokens: one with 3 tokens and no keys keeps max_q_len the same
        alone = plan_batch(decoder, [target_kv, 0], [target_q, 3], **options)
        spec = decoder.spec
        expected = request_records(alone, 0)
        assert len(expected) == max(1, -(-min(target_kv, (window or target_kv) + target_q) // chunk))
        tiling = decode_tiling(spec)
        assert_reads_exactly_its_items(alone, tiling)
        for _ in range(4):
            others = int(rng.integers(1, 40))
            kv_lens = (rng.integers(0, 20000, size=others) * (rng.random(others) > 0.1)).tolist()
            q_lens = rng.integers(1, 4, size=others).tolist()
            at = int(rng.integers(0, others + 1))
            kv_lens.insert(at, target_kv)
            q_lens.insert(at, target_q)
            kv_lens.append(0)
            q_lens.append(3)
            records = plan_batch(decoder, kv_lens, q_lens, **options)
            assert decoder.spec == spec  # the same kernel: invariance is among batches planned with it
            assert np.array_equal(request_records(records, at), expected)
            assert_reads_exactly_its_items(records, tiling)


def test_the_planned_split_shares_tiles_at_head_dim_256(planner):
    """Without fixed_split_tokens a long request's CTAs claim tiles at run time where the tiling's
    static_share is below 100 (16-bit head_dim 256): the emulation sees the pool."""
    tiling_256 = [row for row in TUNING.tensor_cores if (row.fp8, row.head_dim) == (False, 256)][0]
    assert tiling_256.static_share < 100
    decoder = decoder_of(planner, native=False)
    rng = np.random.default_rng(5)
    records = plan_batch(decoder, [60000], [1], kv_dtype="bfloat16", head_dim=256, tensor_cores=True, mask="none",
                         window=None, rng=rng, chunk_tokens=2048)
    tiling = decode_tiling(decoder.spec)
    assert len(records) > 1 and all(cta_tiles(r, tiling.tile_tokens, tiling.stages, tiling.static_share)[1]
                                    for r in records)
    records = plan_batch(decoder, [60000], [1], kv_dtype="bfloat16", head_dim=256, tensor_cores=True, mask="none",
                         window=None, rng=rng, fixed_split_tokens=2048)
    assert_reads_exactly_its_items(records, tiling)


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_fixed_split_tokens_forces_the_chunk_and_disable_split_kv_stays_per_request(planner, native):
    decoder = decoder_of(planner, native)
    rng = np.random.default_rng(2)
    kv_lens = [5000, 10, 0, 3000]
    plan_batch(decoder, kv_lens, [1] * 4, kv_dtype="bfloat16", head_dim=128, tensor_cores=None, mask="none",
               window=None, rng=rng, fixed_split_tokens=1000)
    work = decoder.work
    assert work.chunk_tokens == 1000 and work.fixed_split
    assert np.diff(work.req_work_indptr).tolist() == [5, 1, 1, 3]
    records = plan_batch(decoder, kv_lens, [1] * 4, kv_dtype="bfloat16", head_dim=256, tensor_cores=True,
                         mask="none", window=None, rng=rng, disable_split_kv=True)
    assert not decoder.work.fixed_split and np.diff(decoder.work.req_work_indptr).tolist() == [1, 1, 1, 1]
    assert_reads_exactly_its_items(records, decode_tiling(decoder.spec))  # one item each: a group of one


@pytest.mark.parametrize("split, named", [
    (dict(fixed_split_tokens=0), "fixed_split_tokens"),
    (dict(fixed_split_tokens=-5), "fixed_split_tokens"),
    (dict(fixed_split_tokens=True), "fixed_split_tokens"),
    (dict(fixed_split_tokens=512.0), "fixed_split_tokens"),
    (dict(fixed_split_tokens=2**31), "fixed_split_tokens"),
    (dict(fixed_split_tokens=512, chunk_tokens=512), "fixed_split_tokens with chunk_tokens"),
    (dict(fixed_split_tokens=512, disable_split_kv=True), "fixed_split_tokens with disable_split_kv"),
])
def test_bad_fixed_split_tokens_are_refused_and_keep_the_plan(planner, split, named):
    decoder = decoder_of(planner, native=False)
    rng = np.random.default_rng(0)
    plan_batch(decoder, [300], [1], kv_dtype="bfloat16", head_dim=128, tensor_cores=None, mask="none", window=None,
               rng=rng)
    before = decoder.current_plan
    with pytest.raises(ValueError, match=f"^{named}: expected"):
        plan_batch(decoder, [300], [1], kv_dtype="bfloat16", head_dim=128, tensor_cores=None, mask="none",
                   window=None, rng=rng, **split)
    assert decoder.current_plan is before


def test_a_first_cuda_graph_plan_with_a_fixed_split_holds_any_batch_of_its_pages(planner):
    """The capacity holds max_batch_size + max_num_pages x page_size // N items, the most a batch can make."""
    max_batch, max_pages, chunk = 8, 4000, 256
    decoder = decoder_of(planner, native=True, use_cuda_graph=True, max_batch_size=max_batch, max_num_pages=max_pages)
    rng = np.random.default_rng(9)
    plan_batch(decoder, [100], [1], kv_dtype="bfloat16", head_dim=128, tensor_cores=None, mask="none", window=None,
               rng=rng, fixed_split_tokens=chunk)
    capacity = decoder.current_plan.capacity.work
    assert capacity >= max_batch + max_pages * 16 // chunk
    # every page in use, over requests one token past a chunk each: the most items these pages make
    kv_lens = [max_pages * 16 // max_batch] * max_batch
    records = plan_batch(decoder, kv_lens, [1] * max_batch, kv_dtype="bfloat16", head_dim=128, tensor_cores=None,
                         mask="none", window=None, rng=rng, fixed_split_tokens=chunk)
    assert len(records) == sum(-(-n // chunk) for n in kv_lens) <= capacity
    assert decoder.current_plan.capacity.work == capacity  # the buffers of the first plan
