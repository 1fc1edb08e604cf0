"""Host time of the shared-prefix detection (HostPlanner.shared_spans, the C helper), no GPU needed.

    python -m benchmarks.shared_prefix_host [--calls 200]

256 requests of 100 pages, none shared and 16 prompts x 16 samples of 64 shared pages: the median
µs of one detection over --calls calls. plan()'s whole host time with sharing is in
benchmarks/shared_prefix.py's "plan host us" (GPU).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

BATCH, PAGES, PAGE = 256, 100, 16


def patterns(np):
    """name -> page ids of the 256 requests."""
    alone = np.random.default_rng(0).permutation(BATCH * PAGES).astype(np.int32)
    shared = np.concatenate([np.concatenate([np.arange(64) + 1000 * (r // 16), 10 ** 6 + r * 100 + np.arange(36)])
                             for r in range(BATCH)]).astype(np.int32)
    return {"none shared": alone, "16 prompts x 16 samples": shared}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    from flashjit.jit.cache import KernelCache
    from flashjit.serving.host_plan import load_host_plan
    from flashjit.worklist.host import HostPlanner

    library = load_host_plan(KernelCache(tempfile.mkdtemp(prefix="flashjit-bench-host-")))
    if library is None:
        raise SystemExit("no C compiler: the detection's C helper cannot be built here")
    planner = HostPlanner(library)
    tables = planner.read(torch.arange(BATCH + 1, dtype=torch.int32) * PAGES, torch.full((BATCH,), PAGE,
                                                                                          dtype=torch.int32), PAGE)
    for name, ids in patterns(np).items():
        ids = torch.from_numpy(ids)
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            planner.shared_spans(tables, ids, PAGE, True, 4)
            times.append(time.perf_counter() - start)
        print(f"shared-prefix detection, {BATCH} requests, {name}: {statistics.median(times) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
