"""Split-KV planner: chunk choice and work items (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from flashjit.worklist.split import MIN_CHUNK_TOKENS, WorkPlan, choose_chunk, estimate_time, plan_work

from planner_oracle import reference_choose_chunk, reference_estimate_time, reference_plan_work

GRANULARITIES = (1, 16, 32, 64, 48)


def plan_for(span_lens, *, ctas_per_item=4, max_ctas=528, granularity=16, begins=None, q_lens=None,
             chunk_tokens=None) -> WorkPlan:
    span_lens = np.asarray(span_lens, dtype=np.int64)
    begins = np.zeros_like(span_lens) if begins is None else np.asarray(begins, dtype=np.int64)
    q_lens = np.ones_like(span_lens) if q_lens is None else np.asarray(q_lens, dtype=np.int64)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)])
    return plan_work(begins, begins + span_lens, qo_indptr, ctas_per_item=ctas_per_item, max_ctas=max_ctas,
                     granularity=granularity, chunk_tokens=chunk_tokens)


def assert_tiles_exactly(plan: WorkPlan, begins, ends):
    """Each request's items cover [begin, end) in order, with no gap and no overlap."""
    begins, ends = np.asarray(begins), np.maximum(np.asarray(ends), np.asarray(begins))
    assert plan.req_work_indptr[0] == 0 and plan.req_work_indptr[-1] == plan.num_work
    assert np.all(np.diff(plan.req_work_indptr) >= 1)  # at least one item per request
    for b in range(len(begins)):
        lo, hi = plan.req_work_indptr[b], plan.req_work_indptr[b + 1]
        assert np.all(plan.work_request[lo:hi] == b)
        starts, stops = plan.work_begin[lo:hi], plan.work_end[lo:hi]
        assert starts[0] == begins[b] and stops[-1] == ends[b]
        assert np.array_equal(starts[1:], stops[:-1])  # contiguous: no gap, no overlap
        if ends[b] > begins[b]:
            assert np.all(stops > starts)  # no empty item inside a non-empty span
        assert np.all(stops - starts <= plan.chunk_tokens)


# ---- choose_chunk -------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [132, 264, 396])
def test_no_split_when_equal_requests_fill_whole_waves(batch):
    spans = np.full(batch, 5000)
    chunk = choose_chunk(spans, ctas_per_item=4, max_ctas=528, granularity=16)
    assert chunk >= 5000 and chunk % 16 == 0
    plan = plan_for(spans)
    assert plan.num_work == batch and not plan.needs_merge and plan.max_splits == 1


def test_long_request_among_many_short_ones_is_split():
    """The batch alone fills the GPU, but one long request would finish last by far."""
    spans = np.array([32_768] + [200] * 255)
    plan = plan_for(spans, ctas_per_item=8, max_ctas=264)
    assert plan.max_splits > 1 and np.diff(plan.req_work_indptr)[0] == plan.max_splits
    assert plan.chunk_tokens < 32_768


def test_no_split_when_spans_are_short():
    spans = np.array([MIN_CHUNK_TOKENS, 3, 100])
    assert choose_chunk(spans, 4, 528, 16) == MIN_CHUNK_TOKENS
    assert plan_for(spans).num_work == 3


@pytest.mark.parametrize("span, ctas_per_item, max_ctas", [(100_000, 4, 528), (32_768, 8, 1056), (65_536, 1, 132)])
def test_single_long_request_splits_to_about_one_wave(span, ctas_per_item, max_ctas):
    plan = plan_for([span], ctas_per_item=ctas_per_item, max_ctas=max_ctas)
    target = max_ctas // ctas_per_item
    assert 0.9 * target <= plan.num_work <= target
    assert plan.needs_merge and plan.max_splits == plan.num_work


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_chunk_is_a_multiple_of_granularity_and_at_least_min(granularity):
    rng = np.random.default_rng(granularity)
    for _ in range(50):
        spans = rng.integers(0, 20_000, size=rng.integers(1, 12))
        chunk = choose_chunk(spans, ctas_per_item=2, max_ctas=264, granularity=granularity)
        assert chunk % granularity == 0
        split = np.any(spans > chunk)
        if split:
            assert chunk >= MIN_CHUNK_TOKENS
        else:
            assert chunk >= spans.max()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_chunk_minimizes_the_estimate(granularity):
    """No other chunk (a multiple of granularity, >= MIN_CHUNK_TOKENS) is estimated faster by much."""
    rng = np.random.default_rng(100 + granularity)
    for _ in range(50):
        spans = rng.integers(0, 50_000, size=rng.integers(1, 40))
        chunk = choose_chunk(spans, ctas_per_item=4, max_ctas=528, granularity=granularity)
        low = -(-MIN_CHUNK_TOKENS // granularity) * granularity
        others = np.arange(low, -(-int(spans.max()) // granularity) * granularity + granularity, granularity)
        best = estimate_time(spans, others, 4, 528).min()
        # candidates are the longest span cut in 1..128 equal parts, so allow a gap
        assert estimate_time(spans, [chunk], 4, 528)[0] <= 1.25 * best


def test_estimate_prefers_one_wave_to_slightly_more():
    """A grid just over one wave costs a second wave: the quantized bound sees it."""
    one_wave, over = estimate_time(np.array([100_000]), np.array([100_000 // 132 + 1, 100_000 // 150]), 4, 528)
    assert one_wave < over


def test_empty_batch():
    assert choose_chunk(np.zeros(0, dtype=np.int64), 4, 528, 16) == 16
    plan = plan_for([])
    assert plan.num_work == 0 and plan.num_tokens == 0 and list(plan.req_work_indptr) == [0]
    assert not plan.needs_merge and plan.max_splits == 0


# ---- plan_work ----------------------------------------------------------------------------------

def test_random_batches_tile_spans_exactly():
    rng = np.random.default_rng(1234)
    for _ in range(300):
        batch = int(rng.integers(1, 40))
        begins = rng.integers(0, 3000, size=batch)
        lens = rng.integers(0, 40_000, size=batch) * (rng.random(batch) > 0.1)  # some empty spans
        q_lens = rng.integers(1, 5, size=batch)
        ctas_per_item = int(rng.choice([1, 2, 4, 8, 16]))
        max_ctas = int(rng.choice([132, 264, 528, 1056]))
        granularity = int(rng.choice(GRANULARITIES))
        plan = plan_for(lens, begins=begins, q_lens=q_lens, ctas_per_item=ctas_per_item, max_ctas=max_ctas,
                        granularity=granularity)
        assert_tiles_exactly(plan, begins, begins + lens)
        assert plan.chunk_tokens % granularity == 0
        whole = -(-max(int(lens.max()), 1) // granularity) * granularity
        chosen, unsplit = estimate_time(lens, [plan.chunk_tokens, whole], ctas_per_item, max_ctas)
        assert chosen <= unsplit  # splitting is only chosen when estimated faster


def test_zero_length_requests_get_one_empty_item():
    plan = plan_for([0, 5000, 0, 0], begins=[7, 0, 0, 300])
    counts = np.diff(plan.req_work_indptr)
    assert counts[0] == counts[2] == counts[3] == 1 and counts[1] > 1
    for b, begin in ((0, 7), (2, 0), (3, 300)):
        item = plan.req_work_indptr[b]
        assert plan.work_begin[item] == plan.work_end[item] == begin


def test_inverted_span_is_treated_as_empty():
    plan = plan_work(np.array([50]), np.array([10]), np.array([0, 1]), ctas_per_item=4, max_ctas=528,
                     granularity=16)
    assert plan.num_work == 1 and plan.work_begin[0] == plan.work_end[0] == 50


@pytest.mark.parametrize("chunk_tokens", [16, 100, 1000, 4096])
def test_forced_chunk(chunk_tokens):
    lens = [0, 1, 999, 1000, 1001, 10_000]
    plan = plan_for(lens, chunk_tokens=chunk_tokens)
    assert plan.chunk_tokens == chunk_tokens
    assert list(np.diff(plan.req_work_indptr)) == [max(1, -(-n // chunk_tokens)) for n in lens]
    assert_tiles_exactly(plan, np.zeros(len(lens)), np.array(lens))


def test_forced_chunk_ignores_wave_size():
    plan = plan_for([100_000], chunk_tokens=128, ctas_per_item=4, max_ctas=528)
    assert plan.num_work == -(-100_000 // 128)  # more than one wave: the caller asked for it


def test_tokens_and_qo_indptr_are_consistent():
    q_lens = np.array([1, 3, 0, 2, 5])
    plan = plan_for([10, 20_000, 5, 0, 300], q_lens=q_lens)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)])
    assert np.array_equal(plan.req_qo_indptr, qo_indptr)
    assert plan.num_tokens == q_lens.sum()
    for b in range(len(q_lens)):
        assert np.all(plan.token_request[qo_indptr[b]:qo_indptr[b + 1]] == b)
    assert np.array_equal(plan.token_request, np.repeat(np.arange(len(q_lens)), q_lens))


def test_arrays_are_contiguous_int32():
    plan = plan_for([5000, 10, 70_000])
    for array in (plan.work_request, plan.work_begin, plan.work_end, plan.req_work_indptr, plan.req_qo_indptr,
                  plan.token_request):
        assert array.dtype == np.int32 and array.flags.c_contiguous


def test_plan_is_deterministic():
    a, b = plan_for([123, 45_678, 9]), plan_for([123, 45_678, 9])
    for field in ("work_request", "work_begin", "work_end", "req_work_indptr", "req_qo_indptr", "token_request"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert a.chunk_tokens == b.chunk_tokens


# ---- the faster planner against the oracle (the plain forms in planner_oracle.py) -------------------

def random_spans(rng, batch):
    """Span lengths of the shapes serving sees: uniform, log-uniform, one long among short, some empty."""
    kind = rng.integers(4)
    if kind == 0:
        lens = np.full(batch, rng.integers(1, 40_000))
    elif kind == 1:
        lens = np.exp(rng.uniform(0, np.log(200_000), size=batch)).astype(np.int64)
    elif kind == 2:
        lens = rng.integers(1, 600, size=batch)
        lens[rng.integers(batch)] = rng.integers(5_000, 300_000)
    else:
        lens = rng.integers(0, 40_000, size=batch) * (rng.random(batch) > 0.2)
    return lens


def test_choose_chunk_matches_the_reference_on_random_batches():
    rng = np.random.default_rng(2026)
    for _ in range(3000):
        lens = random_spans(rng, int(rng.integers(1, 300)))
        ctas_per_item = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
        max_ctas = int(rng.choice([2, 8, 132, 264, 396, 528, 1056]))
        granularity = int(rng.choice(GRANULARITIES))
        max_items = None if rng.random() < 0.5 else int(rng.integers(1, 2 * len(lens) + 200))
        args = (lens, ctas_per_item, max_ctas, granularity)
        assert choose_chunk(*args, max_items=max_items) == reference_choose_chunk(*args, max_items=max_items), \
            (lens.tolist(), ctas_per_item, max_ctas, granularity, max_items)


def test_estimate_time_matches_the_reference():
    rng = np.random.default_rng(7)
    for _ in range(300):
        lens = random_spans(rng, int(rng.integers(1, 100)))
        chunks = rng.integers(1, 50_000, size=int(rng.integers(1, 40)))
        ctas_per_item, max_ctas = int(rng.choice([1, 4, 8])), int(rng.choice([132, 264, 528]))
        assert np.array_equal(estimate_time(lens, chunks, ctas_per_item, max_ctas),
                              reference_estimate_time(lens, chunks, ctas_per_item, max_ctas))


def test_the_benchmark_batch_plans_as_before():
    """The 64 requests of `python -m benchmarks.decode compile` (lengths 128 + 6i), on an H200's 132 SMs."""
    lens = np.array([128 + 6 * i for i in range(64)])
    for ctas_per_item, max_ctas, granularity in ((8, 264, 64), (8, 132, 64), (16, 264, 16), (8, 264, 1)):
        for max_items in (None, 64, 65, 100, 1000):
            assert (choose_chunk(lens, ctas_per_item, max_ctas, granularity, max_items=max_items)
                    == reference_choose_chunk(lens, ctas_per_item, max_ctas, granularity, max_items=max_items))


PLAN_FIELDS = ("work_request", "work_begin", "work_end", "req_work_indptr", "req_qo_indptr", "token_request")


def test_plan_work_matches_the_reference_on_random_batches():
    rng = np.random.default_rng(99)
    for _ in range(1500):
        batch = int(rng.integers(0, 200))
        lens = random_spans(rng, batch) if batch else np.zeros(0, dtype=np.int64)
        begins = rng.integers(0, 5000, size=batch) * (rng.random(batch) < 0.3)
        inverted = rng.integers(0, 3, size=batch) * (rng.random(batch) < 0.05) * (begins + 1)
        ends = begins + lens - inverted  # a few spans end before they begin
        q_lens = rng.integers(1, 5, size=batch) if rng.random() < 0.5 else np.ones(batch, dtype=np.int64)
        qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(rng.choice([np.int32, np.int64]))
        kwargs = dict(ctas_per_item=int(rng.choice([1, 4, 8, 16])), max_ctas=int(rng.choice([132, 264, 528])),
                      granularity=int(rng.choice(GRANULARITIES)),
                      chunk_tokens=None if rng.random() < 0.7 else int(rng.integers(1, 20_000)),
                      max_items=None if rng.random() < 0.5 else int(rng.integers(batch, 2 * batch + 100)))
        new, old = plan_work(begins, ends, qo_indptr, **kwargs), reference_plan_work(begins, ends, qo_indptr, **kwargs)
        assert new.chunk_tokens == old.chunk_tokens
        for field in PLAN_FIELDS:
            a, b = getattr(new, field), getattr(old, field)
            assert a.dtype == b.dtype == np.int32 and a.flags.c_contiguous and np.array_equal(a, b), field
        counts = np.diff(old.req_work_indptr)  # needs_merge and max_splits by their definitions
        assert (new.num_work, new.num_tokens, new.needs_merge, new.max_splits) == \
               (old.num_work, old.num_tokens, bool(np.any(counts > 1)), int(counts.max(initial=0)))


@pytest.mark.parametrize("lens, merge", [([100, 300, 50], True), ([100, 200, 50], False), ([300], True), ([], False)])
def test_needs_merge_when_one_request_is_split_in_two(lens, merge):
    plan = plan_for(lens, chunk_tokens=200)
    assert plan.needs_merge is merge and plan.num_work == len(lens) + merge


def test_no_span_begin_means_spans_from_zero():
    rng = np.random.default_rng(17)
    for _ in range(300):
        batch = int(rng.integers(0, 100))
        ends = random_spans(rng, batch) if batch else np.zeros(0, dtype=np.int64)
        qo_indptr = np.arange(batch + 1)
        kwargs = dict(ctas_per_item=8, max_ctas=264, granularity=int(rng.choice(GRANULARITIES)),
                      chunk_tokens=None if rng.random() < 0.7 else int(rng.integers(1, 20_000)))
        new = plan_work(None, ends, qo_indptr, **kwargs)
        old = reference_plan_work(np.zeros_like(ends), ends, qo_indptr, **kwargs)
        assert new.chunk_tokens == old.chunk_tokens
        for field in PLAN_FIELDS:
            assert np.array_equal(getattr(new, field), getattr(old, field)), field
