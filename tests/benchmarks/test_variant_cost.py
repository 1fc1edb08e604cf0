"""benchmarks/variant_cost.py's pure parts on the CPU: which rows it pairs, and the interleaving."""

from __future__ import annotations

import dataclasses

from benchmarks.cases import CASES
from benchmarks.variant_cost import PLAN_ORDER, interleaved_us, markdown, variant_pairs


def test_every_variant_row_is_paired_with_its_shape_without_the_variant():
    pairs = variant_pairs(CASES)
    assert [case for _, case in pairs] == [c for c in CASES if c.variant is not None]
    assert any(case.name == "gpt-oss b16 L8192 window 128 sinks" for _, case in pairs)
    for base, case in pairs:
        assert base.variant is None and base.name != case.name
        assert dataclasses.replace(base, name=case.name, variant=case.variant) == case


class RecordingTimer:
    """median_us(fn) calls fn and returns the next of its side's scripted times."""

    def __init__(self, times: dict):
        self.times, self.order = {name: list(ts) for name, ts in times.items()}, []

    def median_us(self, fn):
        name = fn()
        self.order.append(name)
        return self.times[name].pop(0)


def test_sides_are_timed_in_alternating_rounds_and_each_takes_its_median_round():
    timer = RecordingTimer({"base": [9.0, 8.0, 30.0], "variant": [8.5, 8.2, 8.4]})
    us = interleaved_us(timer, {("base", 0): lambda: "base", ("variant", 1): lambda: "variant"}, rounds=3)
    assert timer.order == ["base", "variant"] * 3
    assert us == {"base": 9.0, "variant": 8.4}  # the 30 µs outlier round does not move the median


def test_each_side_planned_first_and_last_takes_the_median_of_both_copies():
    """Planned base, variant, variant, base: a side's time pools its two copies' rounds, so a copy
    slowed by where its buffers landed weighs on its side no more than its rounds do."""
    assert PLAN_ORDER == ("base", "variant", "variant", "base")
    scripted = {"base first": [8.0, 8.1], "variant second": [8.3, 8.4], "variant third": [8.2, 8.2],
                "base last": [8.6, 8.7]}
    timer = RecordingTimer(scripted)
    names = list(scripted)
    calls = {(side, copy): (lambda name=names[copy]: name) for copy, side in enumerate(PLAN_ORDER)}
    us = interleaved_us(timer, calls, rounds=2)
    assert timer.order == names * 2
    assert us == {"base": (8.1 + 8.6) / 2, "variant": (8.2 + 8.3) / 2}


def test_the_table_gives_the_cost_as_a_signed_percentage_and_reports_errors():
    table = markdown([{"case": "a", "base_us": 8.0, "variant_us": 8.2, "cost": 0.025},
                      {"case": "b", "error": "variant: rel error 1.00e+00"}])
    assert "| a | 8.00 | 8.20 | +2.5% |" in table and "| b | variant: rel error 1.00e+00 | | |" in table
