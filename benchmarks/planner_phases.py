"""Where the GPU planner's time goes: thread 0's %clock64 between the steps of a plan (GPU).

    python -m benchmarks.planner_phases [--requests 16,256] [--rounds 20]

The planner is one CTA whose time is a chain of dependent steps, so each step's share says what to
shorten. It is built with -DFJ_PLAN_STAMPS, which compiles in a stamp after each step
(templates/worklist/device_plan.cuh, FJ_PLAN_STAMP); the cubin built without it is unchanged. Each
round replays planner_cost's graph of replans and reads the last plan's stamps; the table gives
the medians over the rounds, in cycles, for the modes planner_cost times.
"""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.cta_timeline import stamped_engine
from benchmarks.planner_cost import MODES, replan_graph

STEPS = ("load the requests", "publish them", "choose the chunk", "scan the work list", "write the records",
         "write the request arrays")
STAMPS = len(STEPS) + 1  # the entry's, then one after each step


def step_cycles(np, stamps):
    """Median cycles of each step over rounds of stamps [rounds, STAMPS]."""
    stamps = np.asarray(stamps, dtype=np.int64)
    return np.median(np.diff(stamps, axis=1), axis=0)


def read_stamps(decoder):
    import numpy as np
    from cupy.cuda import runtime

    address = decoder.kernel.loaded(0).module.get_global_var("fj_plan_stamps")
    host = np.zeros(STAMPS, dtype=np.uint64)
    runtime.memcpy(host.ctypes.data, address, host.nbytes, runtime.memcpyDeviceToHost)
    return host


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_phases", description=__doc__)
    parser.add_argument("--requests", default="16,256", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    engine = stamped_engine(tempfile.mkdtemp(), f"FJ_PLAN_STAMPS={STAMPS}")
    print(f"{'requests, mode':<28}" + "".join(f"{step:>20}" for step in STEPS) + f"{'all':>8}")
    for requests in (int(n) for n in args.requests.split(",")):
        for mode, options in MODES.items():
            decoder, graph = replan_graph(torch, engine, requests, options=options)
            rounds = []
            for _ in range(args.rounds):
                graph.replay()
                torch.cuda.synchronize()
                rounds.append(read_stamps(decoder))
            cycles = step_cycles(np, rounds)
            print(f"{f'{requests}, {mode}':<28}" + "".join(f"{c:>20.0f}" for c in cycles) + f"{cycles.sum():>8.0f}",
                  flush=True)
            del graph, decoder


if __name__ == "__main__":
    main()
