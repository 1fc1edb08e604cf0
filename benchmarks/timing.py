"""How the benchmark times a call: CUDA events around it alone, after warm-up, the L2 flushed before
each timed call (outside any captured graph), the median of many calls; and how it measures the
host time of a launch.

Device time alone: after the flush the GPU spins for HOLD_CYCLES (about 250 µs) before the start
event, so the call's host work (run()'s checks and launches, tens of µs at most) is done while the
GPU is still busy, and its kernels are queued before the start event fires. Without the hold an
eager call whose host work outlasted the flush would be timed with that host time in it.

Warm-up runs the timed loop for WARMUP_S of wall time, not a count of calls: an H200 idles at a
fraction of its SM clock and climbs back over milliseconds, so a cell timed right after the host
was busy (building and capturing a CUDA graph, checking an output) would otherwise be timed at a
lower clock than its neighbour (the first replayed graph of a row measured up to 8% slower than
the same graph timed again, with eager unchanged)."""

from __future__ import annotations

import statistics
import time

FLUSH_BYTES = 256 * 2**20  # over four times the H100/H200 L2
HOLD_CYCLES = 500_000  # of GPU spin after the flush: ~250 µs at the H100/H200's 1.98 GHz
WARMUP_S = 0.05  # of flushes and calls, synchronized: the clocks settle under load in less
WARMUP_CALLS = 3  # at least


class Timer:
    def __init__(self, torch, iters: int, flush: str = "dirty"):
        self.torch, self.iters, self.clean = torch, iters, flush == "clean"
        self.scratch = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def flush(self, i: int):
        self.scratch.fill_(i & 0xFF)
        if self.clean:  # the reads evict the written lines, which are written back now
            self.scratch.view(self.torch.int64).sum()

    def median_us(self, fn, flush: bool = True, before=None) -> float:
        """Median µs of fn(). before(), if given, runs ahead of every call, after the flush and
        outside the timed span: the per-step work a server does once before its layers' calls."""
        torch = self.torch
        deadline, calls = time.perf_counter() + WARMUP_S, 0
        while calls < WARMUP_CALLS or time.perf_counter() < deadline:
            if flush:
                self.flush(calls)
            if before is not None:
                before()
            fn()
            torch.cuda.synchronize()  # the wall time counts work done, not work queued
            calls += 1
        times = []
        for i in range(self.iters):
            if flush:
                self.flush(i)
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOLD_CYCLES)  # the call's host work happens while the GPU spins
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def capture(torch, step):
    """(a CUDA graph of step(), the tensor step() returned while captured: what each replay writes).
    step runs once first on a side stream, as torch asks before a capture: it loads kernels and
    fills allocator and library caches, none of which a capture may do."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


HOST_CALLS = 2000


def host_us(fn, sync, calls: int = HOST_CALLS, sync_every: int = 32) -> float:
    """Median host µs of one fn() over many calls. A sync after every sync_every calls, outside the
    timed calls, keeps the launch queue short, so that no call waits for the GPU to make room."""
    fn()
    sync()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if (i + 1) % sync_every == 0:
            sync()
    sync()
    return 1e6 * statistics.median(times)


READ_CEILING_BYTES = 2 * 2**30


def copy_ceiling_gbs(torch) -> float:
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    timer = Timer(torch, 10)
    us = timer.median_us(lambda: dst.copy_(src), flush=False)
    return 2 * src.numel() / us / 1e3
