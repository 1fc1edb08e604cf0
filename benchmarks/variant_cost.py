"""What an attention variant costs: each variant row of benchmarks/cases.py against the same row
without its variant, timed interleaved on the same inputs.

    python -m benchmarks.variant_cost [--only REGEX] [--iters 60] [--rounds 6] [--flush dirty|clean] [--json out.json]

A variant adds a few instructions to a kernel: on a short call (gpt-oss's 128-token windows take
about 9 µs) that is a fraction of a microsecond, less than two rows of benchmarks/decode.py timed
seconds apart drift from each other. Here both sides of a pair are planned over one batch and timed
in alternating rounds, each round the median of --iters calls under the decode benchmark's flush
and timer (benchmarks/timing.py), so both see the same clocks and L2 state; each side is planned
twice (PLAN_ORDER), and its time is the median of both copies' rounds. Each side's output is
checked against the float32 reference (with its variant) before it is timed. Eager calls of
flashjit's BatchDecode, as the decode benchmark's eager column.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from benchmarks.cases import CASES, Case, select_cases


def variant_pairs(cases) -> list[tuple[Case, Case]]:
    """(the row without its variant, the variant row) for every row with a variant."""
    return [(dataclasses.replace(case, name=f"{case.name} [variant none]", variant=None), case)
            for case in cases if case.variant is not None]


# Each side is planned twice, in the order base, variant, variant, base: whatever the order of
# allocation does to a call (where its decoder's buffers and output land) falls on both sides alike.
PLAN_ORDER = ("base", "variant", "variant", "base")


def interleaved_us(timer, calls: dict, rounds: int) -> dict:
    """{name: median µs} of calls keyed (name, copy), timed in turn, round after round: a name's
    median is over the rounds of all its copies."""
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            times[key].append(timer.median_us(call))
    by_name = {}
    for (name, _), ts in times.items():
        by_name.setdefault(name, []).extend(ts)
    return {name: statistics.median(ts) for name, ts in by_name.items()}


def pair_cost(torch, engine, timer, base: Case, case: Case, rounds: int) -> dict:
    """{"base_us", "variant_us", "cost"} of one pair, or {"error": ...} where a side is off its reference."""
    from benchmarks.inputs import build_inputs, quantize, reference, row_tolerance
    from benchmarks.measure import checked_output
    from benchmarks.peers import flashjit_impl

    batch = build_inputs(torch, base)  # the variant row's shape: the same batch, caches and queries
    fp8 = quantize(batch, base)
    calls = {}
    for copy, side in enumerate(PLAN_ORDER):
        row = case if side == "variant" else base
        run, _, _ = flashjit_impl(torch, batch, row, engine, fp8)
        _, problem = checked_output(run, reference(batch, row, fp8), torch.cuda.synchronize, row_tolerance(row))
        if problem:
            return {"error": f"{side}: {problem}"}
        calls[side, copy] = run
    us = interleaved_us(timer, calls, rounds)
    return {"base_us": us["base"], "variant_us": us["variant"], "cost": us["variant"] / us["base"] - 1}


def markdown(rows) -> str:
    lines = ["| row | without the variant (µs) | with it (µs) | cost |", "|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['case']} | {row['error']} | | |")
        else:
            lines.append(f"| {row['case']} | {row['base_us']:.2f} | {row['variant_us']:.2f} | {row['cost']:+.1%} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.variant_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="variant rows whose name matches this regular expression")
    parser.add_argument("--iters", type=int, default=60, help="timed calls a round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--flush", choices=["dirty", "clean"], default="dirty")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    import torch

    import flashjit
    from benchmarks.timing import Timer

    engine, timer = flashjit.Engine(), Timer(torch, args.iters, args.flush)
    rows = []
    for base, case in variant_pairs(select_cases(CASES, only=args.only)):
        rows.append({"case": case.name, **pair_cost(torch, engine, timer, base, case, args.rounds)})
        torch.cuda.empty_cache()
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\n# {torch.cuda.get_device_name()}, L2 flush {args.flush}, {args.rounds} rounds of {args.iters} calls\n")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
