"""flashjit decode benchmark: flashjit against cuDNN (torch SDPA), FlashInfer and FlashAttention-3 on
a fixed set of rows (benchmarks/cases.py), each timed eagerly and as a replayed CUDA graph.

    python -m benchmarks.decode [--quick] [--no-graph] [--plot out.png] [--json out.json]   # GPU: kernel times
    python -m benchmarks.decode compile [--json out.json]                                   # compile, cache, host costs

Method: random inputs, shuffled page tables, the L2 flushed before every timed call (--flush: "dirty"
writes 256 MB, which leaves ~60 MB of dirty lines the timed call then pays to write back; "clean"
reads the 256 MB after writing them, so the call starts from a cold, clean L2, as a serving step
does and as rotating inputs larger than the L2 would, though stricter: the page table and work list
are cold too), CUDA events around the call alone, warm-up first, the median of --iters calls.

The graph column times each implementation as a server runs it: captured in a CUDA graph (flashjit
and FlashInfer in their CUDA-graph modes, over buffers sized for the row, planned before the
capture and again before the replays), then replayed under the same flush and timing; the flush
stays outside the graph. Every implementation's output, eager and replayed, is checked against
flashjit.serving.reference (float32) row by row (each query token and head within a bound from the
dtypes, benchmarks.measure.row_problem) before it is timed; a wrong one is reported, not timed.

Plan costs are paid as a server pays them, once per step and outside every per-layer call: flashjit's
plan() (in CUDA-graph mode it queues the GPU planner before the replay; its device time is reported
apart) and FA3's scheduler_metadata (get_scheduler_metadata, as vLLM precomputes it per step, written
into the captured buffer before each replay). The run prints which (PLAN_COSTS).

Peers: cuDNN on a dense copy of the KV (rows of one length), FlashInfer's
BatchDecodeWithPagedKVCacheWrapper (CUDA-core and tensor-core paths), and FA3's paged
flash_attn_with_kvcache with its own split heuristic and with the split cap a server passes
(benchmarks/peers.py). A peer that does not import is left out with a note.

Bandwidth counts the K/V bytes attended (a window counts only the window) plus q and out, and is
compared with a device-to-device copy measured in the same run. Each row's "floor" is a streaming
read of the same number of bytes under the same flush and timing (benchmarks/read_floor.py): no
kernel reading those bytes can take less. One row (--host-row) also reports the host time of
flashjit's run() and of a graph replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Callable

from benchmarks.cases import CASES, attended_bytes, select_cases
from benchmarks.inputs import build_inputs, quantize, row_tolerance
from benchmarks.measure import build_and_measure
from benchmarks.peers import PLAN_COSTS, candidates
from benchmarks.report import best_of, format_row, markdown_table, write_plot
from benchmarks.timing import HOST_CALLS, READ_CEILING_BYTES, Timer, capture, copy_ceiling_gbs

HOST_ROW = "^b16 L8192$"


def host_row(cases, pattern: str):
    """The row whose host times are reported: the first matching pattern, else the first row."""
    return next((c for c in cases if re.search(pattern, c.name)), cases[0] if cases else None)


def new_row(case, kv_lens) -> dict:
    return {"case": case.name, "batch": case.batch, "mean_kv_len": sum(kv_lens) / len(kv_lens),
            "uniform": case.kv_len is not None, "family": case.family, "bytes": attended_bytes(case, kv_lens),
            "impls": {}}


def finish_row(row: dict, case, rows) -> dict:
    """The best peer's eager and graph times, and the fp8 row's speed against its bf16 row."""
    impls = row["impls"]
    row["best_peer_us"], row["best_peer_graph_us"] = best_of(impls, "us"), best_of(impls, "graph_us")
    base = next((r for r in rows if r["case"] == case.base), None)
    if base and "us" in base["impls"].get("flashjit", {}) and "us" in impls.get("flashjit", {}):
        row["speedup_vs_bf16"] = base["impls"]["flashjit"]["us"] / impls["flashjit"]["us"]
    return row


def errors_of(rows) -> list[str]:
    return [f"{row['case']}: {name}: {entry[key]}" for row in rows for name, entry in row["impls"].items()
            for key in ("error", "graph_error") if key in entry]


def write_json(path, result):
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


@dataclasses.dataclass
class Bench:
    """What the rows are timed with: on a GPU (gpu_bench), or stand-ins in the CPU tests."""
    torch: object
    engine: object
    timer: object                  # median_us(fn)
    floor_us: Callable             # (bytes) -> µs of a streaming read of that many bytes
    ceiling_gbs: float             # the copy ceiling, for the printed rows and the plot
    sync: Callable
    capture: Callable              # (step) -> (graph, the output each replay writes)
    release: Callable = lambda: None  # frees a row's cached memory
    device: str = "cuda"
    planner_us: Callable | None = None  # () -> µs of the GPU planner at 256 requests; None: not timed


def gpu_bench(args) -> tuple[Bench, dict]:
    """The GPU's Bench and the run's header (device, ceilings, method)."""
    import torch

    import flashjit
    from benchmarks.read_floor import ReadFloor

    timer = Timer(torch, args.iters, args.flush)
    ceiling = copy_ceiling_gbs(torch)
    floor = ReadFloor(torch)
    read_ceiling = READ_CEILING_BYTES / floor.us(Timer(torch, 10), READ_CEILING_BYTES, flush=False) / 1e3
    from benchmarks.planner_cost import planner_us

    engine = flashjit.Engine(cache_dir=args.cache_dir)
    bench = Bench(torch, engine, timer, lambda nbytes: floor.us(timer, nbytes),
                  ceiling, torch.cuda.synchronize, lambda step: capture(torch, step), torch.cuda.empty_cache,
                  planner_us=lambda: planner_us(torch, engine, timer))
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_ceiling_gbs": ceiling,
              "read_ceiling_gbs": read_ceiling, "flush": args.flush, "graph": args.graph, "plan_costs": PLAN_COSTS}
    return bench, header


def bench_kernels(args) -> dict:
    bench, header = gpu_bench(args)
    print(f"# {header['device']}  copy ceiling {header['copy_ceiling_gbs']:.0f} GB/s  read ceiling "
          f"{header['read_ceiling_gbs']:.0f} GB/s  torch {header['torch']}  L2 flush {args.flush}  "
          "cells: eager/graph us", flush=True)
    print(f"# {PLAN_COSTS}; outputs checked row by row against the float32 reference first", flush=True)
    return run_rows(bench, select_cases(CASES, args.quick, args.only), args, header)


def run_rows(bench: Bench, cases, args, result: dict) -> dict:
    """Times every case's implementations, printing each row as it lands and writing the JSON after
    each; then the notes, the errors, the markdown table and the plot."""
    from benchmarks.inputs import reference

    torch = bench.torch
    host_case = host_row(cases, args.host_row)
    rows, notes = [], set()
    result.update(rows=rows, notes=[], host=None)
    for case in cases:
        batch = build_inputs(torch, case, device=bench.device)
        fp8 = quantize(batch, case)
        ref = reference(batch, case, fp8)
        factories, skipped = candidates(torch, batch, case, bench.engine, fp8, args.cuda_cores)
        factories = {name: make for name, make in factories.items()
                     if name.startswith("flashjit") or re.search(args.peers, name)}
        notes.update(skipped)
        row = new_row(case, batch.kv_lens)
        row["floor_us"] = bench.floor_us(row["bytes"])
        for name, make in factories.items():
            row["impls"][name] = build_and_measure(name, make, case.name, ref, bench.timer, sync=bench.sync,
                                                   capture=bench.capture, graph=args.graph,
                                                   host=case is host_case and name == "flashjit",
                                                   tol=row_tolerance(case))
        rows.append(finish_row(row, case, rows))
        print(format_row(row, bench.ceiling_gbs), flush=True)
        fj = row["impls"]["flashjit"]
        if case is host_case and "host_us" in fj:
            result["host"] = {"case": case.name, "run_us": fj["host_us"], "replay_us": fj.get("graph_host_us")}
            replay = f"{fj['graph_host_us']:.1f} us" if "graph_host_us" in fj else "not measured"
            print(f"# host time, {case.name}: flashjit run() {fj['host_us']:.1f} us, graph replay {replay} "
                  f"(medians of {HOST_CALLS} calls, no sync between them)", flush=True)
        if case is host_case and bench.planner_us is not None:
            result["host"] = dict(result["host"] or {}, gpu_planner_us=(planned := bench.planner_us()))
            print(f"# GPU planner (CUDA-graph mode, replan()): {planned:.2f} us of device time per step at 256 requests",
                  flush=True)
        result["notes"] = sorted(notes)
        write_json(args.json, result)  # after every row: a run cut short keeps what it measured
        del batch, fp8, ref, factories
        bench.release()
    for note in sorted(notes):
        print(f"# note: {note}")
    for error in errors_of(rows):
        print(f"# ERROR {error}")
    print("\n" + markdown_table(rows))
    if args.plot:
        print(write_plot(rows, args.plot, bench.ceiling_gbs, gpu=result.get("device", "")))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="kernels", choices=["kernels", "compile"])
    parser.add_argument("--quick", action="store_true", help="a subset of the rows")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--flush", choices=["dirty", "clean"], default="dirty",
                        help="L2 flush before each timed call: a 256 MB write (dirty: the timed call writes "
                             "those lines back) or that write read back (clean: a cold L2 with nothing to write back)")
    parser.add_argument("--only", default="", help="rows whose name matches this regular expression")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                        help="also time each implementation as a replayed CUDA graph (default; --no-graph: eager only)")
    parser.add_argument("--peers", default=".", metavar="PATTERN",
                        help="the peers to time: a regular expression over their names (default: all; '^$': none)")
    parser.add_argument("--cuda-cores", action="store_true", help="also time flashjit's CUDA-core kernel")
    parser.add_argument("--host-row", default=HOST_ROW,
                        help=f"regular expression of the row whose host times are reported (default {HOST_ROW!r}; "
                             "none matching: the first row)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s against context length here")
    parser.add_argument("--json", help="write the results here (after every row)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--arch", default=None, help="compile mode: target arch (default: the GPU's, else sm_90)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.mode == "compile":
        from benchmarks.compile_costs import bench_compile

        if args.arch is None:
            from flashjit.jit.arch import current_arch
            args.arch = current_arch() or "sm_90"
        write_json(args.json, bench_compile(args))
    else:
        bench_kernels(args)


if __name__ == "__main__":
    main()
