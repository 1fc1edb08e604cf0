"""benchmarks/cta_timeline.py's analysis of the stamps (pure numpy, so checked here without a GPU)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from benchmarks.cta_timeline import balanced_finish, cta_items, main, print_by_record_kind, print_sm_speeds, sm_means


def test_balanced_finish_spreads_equal_work_at_the_measured_rates():
    # Two CTAs stream one work each in 10 µs, two in 20 µs: at rates 0.1, 0.1, 0.05, 0.05 works/µs
    # the four works take 4 / 0.3 µs when shared, against 20 measured.
    first, done = np.zeros(4), np.array([10.0, 10.0, 20.0, 20.0])
    assert balanced_finish(np, first, done) == pytest.approx(40 / 3)
    # A late start counts: a CTA whose first tile lands at 5 µs adds its lost 5 µs of work at its rate.
    late = np.array([0.0, 5.0])
    assert balanced_finish(np, late, late + 10) == pytest.approx((2 + 0.1 * 5) / 0.2)


def test_balanced_finish_of_identical_ctas_is_their_finish():
    first = np.full(8, 3.0)
    assert balanced_finish(np, first, first + 50) == pytest.approx(53.0)


def test_sm_means_average_per_sm_and_leave_idle_sms_out():
    means = sm_means(np, np.array([10.0, 20.0, 40.0]), np.array([2, 2, 0]), 4)
    assert means[0] == 40.0 and means[2] == 15.0
    assert np.isnan(means[1]) and np.isnan(means[3])


def test_sm_speeds_name_the_stable_fast_and_slow_sms(capsys):
    rng = np.random.default_rng(0)
    speed = np.linspace(60, 75, 20)  # SM i finishes at speed[i] in every call, plus noise
    calls = [speed + rng.normal(0, 0.3, 20) for _ in range(3)]
    calls[1][5] = np.nan  # an SM that ran no CTA in one call is left out of the comparison
    print_sm_speeds(np, calls)
    text = capsys.readouterr().out
    assert "fastest SMs [0, 1, 2, 3, 4, 6]" in text and "slowest [14, 15, 16, 17, 18, 19]" in text
    assert float(text.split("min ")[1].split(",")[0]) > 0.95  # the same SMs are fast in every call


def test_sm_speeds_of_unrelated_calls_do_not_correlate(capsys):
    rng = np.random.default_rng(1)
    print_sm_speeds(np, [rng.normal(70, 3, 132) for _ in range(4)])
    assert float(capsys.readouterr().out.split("median ")[1]) < 0.5


def test_cases_are_checked_against_the_chosen_benchmark(capsys):
    with pytest.raises(SystemExit):
        main(["--shared-prefix", "b16 L8192"])  # a decode row, not a shared-prefix one
    assert "16 samples, 8192 + 512" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["16 samples, 8192 + 512"])  # and the other way round
    assert "b16 L8192" in capsys.readouterr().err


def test_a_shared_prefix_plans_ctas_are_told_apart_by_record_kind(capsys):
    """Shared records come first in the grid; with heads first, CTA x = item * heads + head, but for
    the packed own items, the last records, a CTA for each own_head_pack heads."""
    tables = types.SimpleNamespace(num_shared=1)
    work = types.SimpleNamespace(work_begin=[0, 0, 0], work_end=[1000, 100, 50], num_work=3, packed_items=1)
    tiling = types.SimpleNamespace(heads_first=True, own_head_pack=2)
    decoder = types.SimpleNamespace(current_plan=types.SimpleNamespace(tables=tables), work=work, num_kv_heads=2,
                                    kernel=types.SimpleNamespace(tiling=tiling))
    assert [a.tolist() for a in cta_items(np, np.arange(5), decoder, (5, 1, 1))] == [[0, 0, 1, 1, 2], [0, 1, 0, 1, 0]]
    # CTAs 0, 1: the shared record's two heads (1000 keys in 10 us); 2, 3: the own item's (100 keys in
    # 2 us); 4: the packed item's two heads (50 keys in 1 us)
    since = np.array([[0, 1, 11, 12], [0, 1, 11, 13], [0, 2, 4, 5], [0, 2, 4, 6], [0, 2, 3, 4]], dtype=float)
    print_by_record_kind(np, since, np.arange(5), decoder, (5, 1, 1))
    out = capsys.readouterr().out
    assert "shared records (2 CTAs)" in out and "exit p100 13.0; 10.0 ns a key" in out
    assert "own items (3 CTAs)" in out and "exit p100 6.0; 20.0 ns a key" in out
    decoder.current_plan.tables = types.SimpleNamespace()  # a plan that shares nothing: no lines
    print_by_record_kind(np, since, np.arange(5), decoder, (5, 1, 1))
    assert capsys.readouterr().out == ""
