"""When each CTA of one decode call starts, gets its first tile, finishes its tiles and exits (GPU).

    python -m benchmarks.cta_timeline "b16 L8192 e4m3" ["b64 L8192 e4m3" ...] [--calls 3]
    python -m benchmarks.cta_timeline --shared-prefix "16 samples, 8192 + 512" [...]

ncu reports a kernel's averages; this shows its shape in time: how long CTAs wait for their first
tile (the prologue's chain of loads), how far apart they finish (the tail, where the memory system
idles), and what the epilogue and merge add. Over the calls it also shows which SMs finish first
(the same ones every call: the memory system serves some SMs faster) and, for a call whose CTAs
have equal work, when the last tile would land if that work were spread over the CTAs at their
measured rates: the most that balancing across CTAs could gain. The kernel is built with
-DFJ_TIMELINE, which compiles in a %globaltimer stamp at four points of every CTA
(templates/common/prelude.cuh, FJ_STAMP); the cubin built without it is unchanged. Inputs, flush
and timing are those of benchmarks/decode.py (of benchmarks/shared_prefix.py with --shared-prefix,
where the stamps are also shown by record kind: shared records and the requests' own items).
Percentiles are in µs from the first CTA's entry.
"""

import argparse
import tempfile

from benchmarks.cases import CASES
from benchmarks.inputs import build_inputs, quantize
from benchmarks.peers import flashjit_impl
from benchmarks.shared_prefix import ROWS as SHARED_ROWS
from benchmarks.timing import Timer

STAMPS = ("entry", "first tile", "tiles done", "exit")
PERCENTILES = (0, 10, 50, 90, 100)
CTAS = 65536  # FJ_TIMELINE_CTAS
NUM_SMS_MAX = 1024  # an upper bound on %smid


def stamped_engine(cache_dir, define: str = "FJ_TIMELINE"):
    """An Engine whose kernels are built with -D{define} (built beside the cached plain ones): the
    timeline stamps, or another diagnostic the templates compile in on request."""
    import flashjit
    from flashjit.jit.compile import compile_source
    from flashjit.kernels.worklist_kernel import Kernel

    class TimelineEngine(flashjit.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._stamped = {}

        def get_kernel(self, spec):
            if spec not in self._stamped:
                plain = super().get_kernel(spec)
                cubin = compile_source(self.source(spec), spec.compile_arch, spec.name, extra_options=(f"-D{define}",)).cubin
                self._stamped[spec] = Kernel(spec, plain.tiling, plain.mask, cubin, f"{plain.key}+{define}")
            return self._stamped[spec]

    return TimelineEngine(cache_dir=cache_dir)


def read_stamps(kernel, ctas: int):
    """The four stamps (ns) and the SM of the first ctas CTAs, as an int64 array [ctas, 5]."""
    import numpy as np
    from cupy.cuda import runtime

    address = kernel.loaded(0).module.get_global_var("fj_timeline")
    host = np.zeros((CTAS, 5), dtype=np.uint64)
    runtime.memcpy(host.ctypes.data, address, host.nbytes, runtime.memcpyDeviceToHost)
    return host[:ctas].astype(np.int64), address, host.nbytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", metavar="CASE",
                        help="rows of benchmarks/decode.py (of benchmarks/shared_prefix.py with --shared-prefix)")
    parser.add_argument("--shared-prefix", action="store_true", help="the cases are shared-prefix rows")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per case, each printed")
    args = parser.parse_args(argv)
    names = [row.name for row in SHARED_ROWS] if args.shared_prefix else [c.name for c in CASES]
    unknown = [name for name in args.cases if name not in names]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; the cases are {names}")

    import numpy as np
    import torch
    from cupy.cuda import runtime

    engine = stamped_engine(tempfile.mkdtemp())
    timer = Timer(torch, 1)
    for name in args.cases:
        # (inputs: the tensors run() reads, kept alive while it runs)
        run, decoder, inputs = (shared_prefix_call if args.shared_prefix else decode_call)(torch, name, engine)
        grid = decoder.current_plan.decode_launch.grid
        ctas = grid[0] * grid[1] * grid[2]
        print(f"{name}: {decoder.spec.name}, {decoder.work.num_work} work items, {ctas} CTAs")
        _, address, nbytes = read_stamps(decoder.kernel, 0)
        # The balanced bound needs equal work per CTA: equal items, and no tiles shared among CTAs.
        spans = np.asarray(decoder.work.work_end) - np.asarray(decoder.work.work_begin)
        equal_work = decoder.kernel.tiling.static_share == 100 and bool((spans == spans[0]).all())
        finish_by_sm = []
        for call in range(args.calls):
            runtime.memset(address, 0, nbytes)
            torch.cuda.synchronize()
            us = timer.median_us(run)  # warm-up, flush, one timed call: the stamps are the timed call's
            stamps = read_stamps(decoder.kernel, ctas)[0]
            sm = stamps[:, 4]
            stamps = stamps[:, :4]
            read = (stamps > 0).all(axis=1)  # CTAs with no tile to read have no stamps 1 and 2
            stamps, sm = stamps[read], sm[read]
            since = (stamps - stamps[:, 0].min()) / 1e3
            print(f"  call {call}: {us:.1f} µs by events, CTAs from first entry to last exit "
                  f"{since[:, 3].max():.1f} µs")
            for column, name in enumerate(STAMPS):
                cells = "  ".join(f"p{p} {v:6.1f}" for p, v in zip(PERCENTILES, np.percentile(since[:, column], PERCENTILES)))
                print(f"    {name:<11} {cells}")
            print(f"    per CTA: first tile after entry {np.median(since[:, 1] - since[:, 0]):.1f}, "
                  f"tiles {np.median(since[:, 2] - since[:, 1]):.1f}, epilogue {np.median(since[:, 3] - since[:, 2]):.1f} (medians)")
            print_by_sm_load(np, since, sm)
            print_by_record_kind(np, since, np.nonzero(read)[0], decoder, grid)
            print_by_request(np, since, np.nonzero(read)[0], decoder, grid)
            if equal_work:
                print(f"    if the work were spread over the CTAs at their rates, the last tile would land at "
                      f"{balanced_finish(np, since[:, 1], since[:, 2]):.1f} µs (measured {since[:, 2].max():.1f})")
            finish_by_sm.append(sm_means(np, since[:, 2], sm, NUM_SMS_MAX))
        print_sm_speeds(np, finish_by_sm)


def decode_call(torch, name: str, engine):
    """(run, decoder, what run needs kept alive) of a benchmarks/decode.py row."""
    case = next(c for c in CASES if c.name == name)
    batch = build_inputs(torch, case)
    run, _, decoder = flashjit_impl(torch, batch, case, engine, quantize(batch, case))
    return run, decoder, batch


def shared_prefix_call(torch, name: str, engine):
    """(run, decoder, what run needs kept alive) of a benchmarks/shared_prefix.py row, planned to share."""
    import flashjit
    from benchmarks.shared_prefix import HEAD_DIM, HEADS_KV, HEADS_QO, PAGE, row_inputs

    row = next(r for r in SHARED_ROWS if r.name == name)
    _, q, cache, (indptr, ids, last) = row_inputs(torch, row)
    decoder = flashjit.BatchDecode(engine).plan(indptr, ids, last, HEADS_QO, HEADS_KV, HEAD_DIM, PAGE)
    out = torch.empty_like(q)
    return (lambda: decoder.run(q, cache, out=out)), decoder, (q, cache, out)


def cta_items(np, cta_index, decoder, grid):
    """(work item, KV head) of each CTA of a heads-first grid (CtaCoords): a CTA a head, but for a
    plan's packed own items, the last records, a CTA for each own_head_pack heads."""
    heads, x, work = decoder.num_kv_heads, cta_index % grid[0], decoder.work
    pack = decoder.kernel.tiling.own_head_pack
    plain = work.num_work - work.packed_items
    packed = x - plain * heads
    item = np.where(packed < 0, x // heads, plain + packed // (heads // pack))
    head = np.where(packed < 0, x % heads, packed % (heads // pack) * pack)
    return item, head


def print_by_record_kind(np, since, cta_index, decoder, grid):
    """A shared-prefix plan's CTAs by record kind (its shared records come first in the grid): when
    they start and finish, and each CTA's time per key of its span."""
    num_shared = getattr(decoder.current_plan.tables, "num_shared", 0)  # a sharing plan's tables have it
    if not num_shared:
        return
    item = cta_items(np, cta_index, decoder, grid)[0] if decoder.kernel.tiling.heads_first else cta_index % grid[0]
    keys = (np.asarray(decoder.work.work_end) - np.asarray(decoder.work.work_begin))[item]
    for kind, chosen in (("shared records", item < num_shared), ("own items", item >= num_shared)):
        d = since[chosen]
        per_key = (d[:, 2] - d[:, 1]) * 1e3 / np.maximum(keys[chosen], 1)
        print(f"    {kind} ({chosen.sum()} CTAs): entry p50 {np.median(d[:, 0]):.1f}, first tile after entry "
              f"p50 {np.median(d[:, 1] - d[:, 0]):.1f}, tiles done p100 {d[:, 2].max():.1f}, exit p100 "
              f"{d[:, 3].max():.1f}; {np.median(per_key):.1f} ns a key (median)")


def print_by_request(np, since, cta_index, decoder, grid):
    """How far apart the CTAs of one split request and KV head finish, against all CTAs: if a group's
    CTAs finish far apart, sharing its tiles among them would shorten the tail."""
    tiling = decoder.kernel.tiling
    if not tiling.heads_first:
        return
    heads = decoder.num_kv_heads
    row_tile = cta_index // grid[0]
    item, head = cta_items(np, cta_index, decoder, grid)
    request = np.asarray(decoder.work.work_request)[item]
    group = (request * heads + head) * tiling.row_tiles + row_tile
    done = since[:, 2]
    spread, last = [], []
    for g in np.unique(group):
        members = done[group == g]
        if len(members) > 1:
            spread.append(members.max() - members.min())
            last.append(members.max())
    if spread:
        for name, values in (("group finish spread", spread), ("group last finish", last)):
            cells = "  ".join(f"p{p} {v:6.1f}" for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES)))
            print(f"    {name} ({len(spread)} split groups): {cells}")


def balanced_finish(np, first, done) -> float:
    """When the last tile would land if the call's work, equal per CTA, were spread over its CTAs so
    that all finish together, each streaming from its first tile at the rate it measured
    (1 / (done - first) CTA-works per µs): T with sum_i rate_i (T - first_i) = number of CTAs. The
    gap to the measured last tile is what balancing across CTAs could gain at most."""
    rate = 1.0 / (done - first)
    return float((len(rate) + (rate * first).sum()) / rate.sum())


def sm_means(np, done, sm, num_sms: int):
    """Mean finish time of the CTAs on each SM (NaN for an SM that ran none)."""
    total, count = np.zeros(num_sms), np.zeros(num_sms)
    np.add.at(total, sm, done)
    np.add.at(count, sm, 1)
    with np.errstate(invalid="ignore"):
        return total / count


def print_sm_speeds(np, finish_by_sm):
    """Whether the same SMs finish early in every call: the per-SM mean finish of each call, how
    far apart the SMs are, and how the calls' per-SM means correlate (near 1: the memory system
    serves some SMs faster, stably, so balancing must move work across SMs)."""
    means = np.array(finish_by_sm)
    seen = ~np.isnan(means).any(axis=0)
    average = means[:, seen].mean(axis=0)
    order = np.argsort(average)
    sms = np.nonzero(seen)[0]
    print(f"  per-SM mean finish over the calls: fastest SMs {sms[order[:6]].tolist()} at {average[order[0]]:.1f} µs, "
          f"slowest {sms[order[-6:]].tolist()} at {average[order[-1]]:.1f}")
    if len(means) > 1:
        corr = np.corrcoef(means[:, seen])[np.triu_indices(len(means), 1)]
        print(f"  correlation of the per-SM means between calls: min {corr.min():.2f}, median {np.median(corr):.2f}")


def print_by_sm_load(np, since, sm):
    """When CTAs finish their tiles, by how many CTAs of the call ran on their SM: a one-wave grid
    that leaves some SMs a CTA short shows whether a CTA's speed follows its SM's load."""
    per_sm = np.bincount(sm)
    load = per_sm[sm]
    for count in np.unique(load):
        done = since[load == count, 2]
        cells = "  ".join(f"p{p} {v:6.1f}" for p, v in zip(PERCENTILES, np.percentile(done, PERCENTILES)))
        print(f"    tiles done, {count} CTAs on the SM ({len(done)} CTAs): {cells}")


if __name__ == "__main__":
    main()
