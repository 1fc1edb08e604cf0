"""benchmarks/cta_timeline.py's analysis of the stamps (pure numpy, so checked here without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.cta_timeline import balanced_finish, print_sm_speeds, sm_means


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
