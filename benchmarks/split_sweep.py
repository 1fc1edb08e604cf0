"""flashjit's decode at the chunk its planner picks and at forced chunks (GPU), eager and replayed in
a CUDA graph: whether the makespan estimate (flashjit/worklist/split.py: ITEM_OVERHEAD_TOKENS,
MERGE_COST_TOKENS, MIN_CHUNK_TOKENS) picks the fastest split where a step's fixed costs decide its
time, on the small and skewed rows.

    python -m benchmarks.split_sweep [REGEX] [--chunks 128,256,512,...] [--peers REGEX] [--iters N] [--no-graph]

Each row prints the planner's choice (chunk, work items, most splits of a request), then each forced
chunk shorter than the row's longest request and one item a request (disable_split_kv): eager and
graph µs, and their ratio to the planner's (below 1: faster than the planner's choice); then the
peers of benchmarks/decode.py that --peers matches (cuDNN by default, where the row's lengths are
equal), and each split's speed against the fastest of them (above 1: faster than the best peer).
Inputs, flush, timing and the row-by-row check against the float32 reference are
benchmarks/decode.py's: a wrong output is reported, not timed.
"""

from __future__ import annotations

import argparse
import re

from benchmarks.cases import CASES
from benchmarks.inputs import build_inputs, quantize
from benchmarks.measure import build_and_measure
from benchmarks.peers import candidates, flashjit_eager_and_graph
from benchmarks.timing import Timer, capture

ROWS = ["b1 L2048", "b1 L8192", "b1 L32768", "b16 L512", "b16 L2048", "b16 L8192",
        "16 req skewed: 15 of 256..2048, 1 of 64k", "b16 L8192 e4m3"]
CHUNKS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ONE_ITEM = "one item a request"


def splits_to_time(longest: int, chunks) -> dict[str, dict]:
    """label -> plan()'s split options: the planner's, each forced chunk shorter than the longest
    request (a longer one is one item a request), and one item a request."""
    found = {"planned": {}}
    for chunk in sorted(set(chunks)):
        if chunk < longest:
            found[f"chunk {chunk}"] = {"chunk_tokens": chunk}
    found[ONE_ITEM] = {"disable_split_kv": True}
    return found


def cell(entry: dict, key: str, planned: float | None) -> str:
    """'µs (ratio to the planner's)', or the entry's error."""
    if key not in entry:
        return entry.get("error") or entry.get("graph_error") or "-"
    us = entry[key]
    return f"{us:7.1f}" + (f" ({us / planned:4.2f})" if planned else "")


def best_peer(peers: dict, key: str) -> float | None:
    """The fastest peer's time of key ("us" or "graph_us"), None where no peer has one."""
    times = [entry[key] for entry in peers.values() if key in entry]
    return min(times) if times else None


def against_peer(entry: dict, best: dict) -> str:
    """Each of the split's eager and graph speeds against the best peer's ('÷ best'), where both were timed."""
    cells = [f"{best[key] / entry[key]:.2f}x" for key in ("us", "graph_us") if key in entry and best.get(key)]
    return f"  ÷ best peer {' / '.join(cells)}" if cells else ""


def parse_chunks(text: str) -> tuple[int, ...]:
    try:
        chunks = tuple(int(part) for part in text.split(","))
    except ValueError:
        chunks = ()
    if not chunks or min(chunks) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive ints, not {text!r}")
    return chunks


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.split_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="?", default="", metavar="REGEX",
                        help="rows of benchmarks/cases.py whose name matches (default: ROWS)")
    parser.add_argument("--chunks", type=parse_chunks, default=CHUNKS, help="forced chunks, comma-separated")
    parser.add_argument("--peers", default="cudnn", metavar="REGEX",
                        help="peers of benchmarks/decode.py to time beside (default: cudnn; '^$': none)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                        help="also time each split replayed in a CUDA graph (default)")
    args = parser.parse_args(argv)

    import torch

    import flashjit
    from benchmarks.inputs import reference

    timer, sync = Timer(torch, args.iters), torch.cuda.synchronize
    engine = flashjit.Engine()
    cases = [c for c in CASES if (re.search(args.only, c.name) if args.only else c.name in ROWS)]
    print(f"# {torch.cuda.get_device_name()}  µs eager / graph (ratio to the planner's choice)", flush=True)
    for case in cases:
        batch = build_inputs(torch, case)
        fp8 = quantize(batch, case)
        ref = reference(batch, case, fp8)
        timed = lambda name, make: build_and_measure(  # noqa: E731
            name, make, case.name, ref, timer, sync=sync, capture=lambda step: capture(torch, step), graph=args.graph)
        factories, skipped = candidates(torch, batch, case, engine, fp8)
        peers = {name: timed(name, make) for name, make in factories.items()
                 if not name.startswith("flashjit") and re.search(args.peers, name)}
        best = {key: best_peer(peers, key) for key in ("us", "graph_us")}
        planned = None
        for label, split in splits_to_time(max(batch.kv_lens), args.chunks).items():
            entry = timed("flashjit", lambda: flashjit_eager_and_graph(torch, batch, case, engine, fp8, split=split))
            if planned is None:
                planned = entry
                print(f"{case.name}: planner's chunk {entry.get('chunk')}, {entry.get('work_items')} items, "
                      f"at most {entry.get('splits')} a request", flush=True)
            print(f"  {label:>20}: {cell(entry, 'us', planned.get('us'))} / "
                  f"{cell(entry, 'graph_us', planned.get('graph_us'))}{against_peer(entry, best)}", flush=True)
        for name, entry in peers.items():
            print(f"  {name:>20}: {cell(entry, 'us', None)} / {cell(entry, 'graph_us', None)}", flush=True)
        if skipped and args.peers != "^$":
            print(f"  (left out: {'; '.join(skipped)})", flush=True)
        del batch, fp8, ref, factories, peers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
