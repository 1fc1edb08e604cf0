"""Shared-prefix decode benchmark: batches of samples whose page tables start with their prompt's pages.

    python -m benchmarks.shared_prefix [--iters 50] [--flush dirty|clean] [--no-graph] [--peers REGEX]
                                       [--only TEXT] [--json out.json]

Rows (32 q / 8 kv heads, head_dim 128, bf16, page 16; the L2 flushed before each timed call, CUDA
events around the call, the median of --iters; benchmarks/timing.py):
  "16 samples, 8192 + 512"      one prompt of 8192 tokens, 16 requests each with 512 own tokens
  "16 samples, 32768 + 1024"
  "4 prompts x 16 samples, 4096 + 256"
  "64 samples, 2048 + 128"
  "64 requests, nothing shared, 0 + 2048"   what detection costs a batch that shares nothing
Columns: flashjit (share_prefixes=True; in CUDA-graph mode too), flashjit per request
(share_prefixes=False), FlashInfer's tensor-core decode and its MultiLevelCascadeAttentionWrapper
with 2 levels (prompt, own pages) when FlashInfer imports and the row has a prompt, and the
read-once floor: every shared page once plus each request's own pages,
streamed under the same flush and timing (benchmarks/read_floor.py). Each implementation's output
is checked against flashjit.serving.reference row by row before it is timed. The graph columns
replay a CUDA graph of the step (flashjit in its CUDA-graph mode, planned before capture and again before the
replays). --peers selects the peers by name (a regular expression; '^$' times flashjit alone,
without importing FlashInfer); the flashjit columns and the floor always run. Each cell is printed
as it lands, then the row's summary; "plan host us" is the median host time of plan() (sharing and
per request), which waits for the stream as check_page_ids=True does.
"""

from __future__ import annotations

import argparse
import json
import re
import typing

import numpy as np

HEADS_QO, HEADS_KV, HEAD_DIM, PAGE = 32, 8, 128, 16


class Row(typing.NamedTuple):
    name: str
    prompts: int
    samples: int     # per prompt
    prompt_len: int  # tokens, a multiple of PAGE
    own_len: int     # tokens each request adds after its prompt


ROWS = [
    Row("16 samples, 8192 + 512", 1, 16, 8192, 512),
    Row("16 samples, 32768 + 1024", 1, 16, 32768, 1024),
    Row("4 prompts x 16 samples, 4096 + 256", 4, 16, 4096, 256),
    Row("64 samples, 2048 + 128", 1, 64, 2048, 128),
    Row("64 requests, nothing shared, 0 + 2048", 1, 64, 0, 2048),
]


class Tables(typing.NamedTuple):
    indptr: np.ndarray         # [B+1]
    indices: np.ndarray        # page ids (a shuffled pool)
    last_page_len: np.ndarray  # [B]
    prompt_pages: list         # per prompt, its page ids
    own_pages: list            # per request, its own page ids
    unique_pages: int          # pages the batch reads at least once


def build_tables(row: Row, seed: int = 0) -> Tables:
    """The page table of a row: prompt pages shared by its samples, then each request's own pages,
    over a shuffled pool (no two rows of the cache neighbours by accident)."""
    rng = np.random.default_rng(seed)
    prompt_n, own_n = row.prompt_len // PAGE, -(-row.own_len // PAGE)
    total = row.prompts * prompt_n + row.prompts * row.samples * own_n
    pool = rng.permutation(total).astype(np.int32)
    prompts = [pool[p * prompt_n:(p + 1) * prompt_n] for p in range(row.prompts)]
    start = row.prompts * prompt_n
    owns, lists = [], []
    for p in range(row.prompts):
        for _ in range(row.samples):
            own = pool[start:start + own_n]
            start += own_n
            owns.append(own)
            lists.append(np.concatenate([prompts[p], own]))
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    last = row.own_len - (own_n - 1) * PAGE if own_n else PAGE
    return Tables(indptr, np.concatenate(lists), np.full(len(lists), last, dtype=np.int32), prompts, owns, total)


def row_inputs(torch, row: Row, seed: int = 0):
    """(tables, q, (k, v), (indptr, page ids, last page lengths)) of a row on the GPU: random bf16
    q, K and V, the page table of build_tables."""
    tables = build_tables(row, seed)
    gen = torch.Generator().manual_seed(seed)
    pages = tables.unique_pages
    k = torch.randn(pages, PAGE, HEADS_KV, HEAD_DIM, generator=gen).bfloat16().cuda()
    v = torch.randn(pages, PAGE, HEADS_KV, HEAD_DIM, generator=gen).bfloat16().cuda()
    q = torch.randn(len(tables.last_page_len), HEADS_QO, HEAD_DIM, generator=gen).bfloat16().cuda()
    indptr, last = torch.tensor(tables.indptr), torch.tensor(tables.last_page_len)
    return tables, q, (k, v), (indptr, torch.tensor(tables.indices).cuda(), last)


def floor_bytes(row: Row, tables: Tables) -> int:
    """Bytes a read-once kernel must read: every page once (K and V), plus q and out."""
    page_bytes = 2 * PAGE * HEADS_KV * HEAD_DIM * 2
    batch = row.prompts * row.samples
    return tables.unique_pages * page_bytes + 2 * batch * HEADS_QO * HEAD_DIM * 2


def _flashinfer_cascade(torch, flashinfer, row: Row, tables: Tables, q, cache):
    """MultiLevelCascadeAttentionWrapper over 2 levels: each prompt's pages for its samples' queries,
    then each request's own pages."""
    device = q.device
    i32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32, device=device)  # noqa: E731
    prompt_n = row.prompt_len // PAGE
    qo_prompt = i32(np.arange(row.prompts + 1) * row.samples)
    kv_prompt = i32(np.arange(row.prompts + 1) * prompt_n)
    idx_prompt = i32(np.concatenate(tables.prompt_pages))
    last_prompt = i32(np.full(row.prompts, PAGE))
    batch = row.prompts * row.samples
    own_lens = [len(x) for x in tables.own_pages]
    qo_own = i32(np.arange(batch + 1))
    kv_own = i32(np.concatenate([[0], np.cumsum(own_lens)]))
    idx_own = i32(np.concatenate(tables.own_pages))
    last_own = i32(tables.last_page_len)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
    wrapper.plan([qo_prompt, qo_own], [kv_prompt, kv_own], [idx_prompt, idx_own], [last_prompt, last_own],
                 HEADS_QO, HEADS_KV, HEAD_DIM, PAGE, causal=False, q_data_type=torch.bfloat16)
    return lambda: wrapper.run(q, cache)


def _flashinfer_decode(torch, flashinfer, tables: Tables, q, cache):
    device = q.device
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(torch.tensor(tables.indptr, device=device), torch.tensor(tables.indices, device=device),
                 torch.tensor(tables.last_page_len, device=device), HEADS_QO, HEADS_KV, HEAD_DIM, PAGE,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, cache, out=out)


def _flashjit_graph(torch, engine, tables: Tables, q, cache, capture, share: bool):
    """flashjit in CUDA-graph mode: (a replay, the output it writes). The replay holds the decoder
    and the graph: the graph points into the decoder's buffers, which must outlive it."""
    import flashjit

    indptr, last = torch.tensor(tables.indptr), torch.tensor(tables.last_page_len)
    ids = torch.tensor(tables.indices).cuda()
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=len(last), max_num_pages=len(ids))

    def plan():
        decoder.plan(indptr, ids, last, HEADS_QO, HEADS_KV, HEAD_DIM, PAGE, share_prefixes=share)

    plan()
    out = torch.empty_like(q)
    graph, _ = capture(torch, lambda: decoder.run(q, cache, out=out))
    plan()

    def replay():
        graph.replay()
    replay.holds = (graph, decoder)
    return replay, out


PEERS = ("FlashInfer TC decode", "FlashInfer cascade (2 levels)")
PLAN_CALLS = 500  # plan() calls whose median host time is reported


def bench_row(torch, row: Row, engine, timer, floor, capture, graphs: bool, seed: int = 0, peers: str = ".",
              report=None) -> dict:
    """One row's cells (result["impls"], in us or a problem) and plan() host times; report(name,
    value) is called as each lands."""
    import flashjit
    from benchmarks.measure import row_problem
    from benchmarks.timing import host_us
    from flashjit.serving.reference import decode_reference

    report = report or (lambda name, value: None)

    tables, q, (k, v), (indptr, ids, last) = row_inputs(torch, row, seed)
    batch = len(tables.last_page_len)
    ref, _ = decode_reference(q, k, v, indptr, ids, last)

    def checked(name, fn, out=None):
        if out is not None:  # a replay must rewrite its output: an earlier run's must not pass the check
            out.fill_(float("nan"))
        got = fn() if out is None else (fn(), out)[1]
        torch.cuda.synchronize()
        problem = row_problem(got, ref)[1]
        return f"wrong output ({problem})" if problem else None

    result = {"row": row.name, "batch": batch, "impls": {}, "plan_us": {}, "notes": []}

    def land(name, value):
        result["impls"][name] = value
        report(name, value)

    def time_it(name, fn, out=None):
        problem = checked(name, fn, out)
        land(name, problem if problem else round(timer.median_us(fn), 1))

    for share in (True, False):
        decoder = flashjit.BatchDecode(engine)

        def plan():
            decoder.plan(indptr, ids, last, HEADS_QO, HEADS_KV, HEAD_DIM, PAGE, share_prefixes=share)

        plan()
        out = torch.empty_like(q)
        name = "flashjit" if share else "flashjit per request"
        if share and not decoder.spec.shared_prefix and row.prompt_len:
            result["notes"].append("flashjit found no shared prefix")
        time_it(name, lambda: decoder.run(q, (k, v), out=out), out)
        result["plan_us"][name] = round(host_us(plan, torch.cuda.synchronize, calls=PLAN_CALLS), 1)
        report(f"{name} plan host us", result["plan_us"][name])
        if graphs:
            replay, graph_out = _flashjit_graph(torch, engine, tables, q, (k, v), capture, share)
            time_it(name + " (graph)", replay, graph_out)
    wanted, flashinfer = [name for name in PEERS if re.search(peers, name)], None
    if not row.prompt_len and "FlashInfer cascade (2 levels)" in wanted:  # no prompt level to give it
        wanted.remove("FlashInfer cascade (2 levels)")
    if wanted:
        try:
            import flashinfer
        except ImportError:
            result["notes"].append("FlashInfer does not import: its columns are left out")
    if flashinfer is not None:
        makers = {"FlashInfer TC decode": lambda: _flashinfer_decode(torch, flashinfer, tables, q, (k, v)),
                  "FlashInfer cascade (2 levels)": lambda: _flashinfer_cascade(torch, flashinfer, row, tables, q,
                                                                               (k, v))}
        for name in wanted:
            try:
                time_it(name, makers[name]())
            except Exception as exc:  # a peer's failure is reported in the row, not fatal
                land(name, f"failed: {type(exc).__name__}: {exc}"[:200])
    land("read-once floor", round(floor.us(timer, floor_bytes(row, tables)), 1))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per cell, of which the median is reported")
    parser.add_argument("--flush", choices=("dirty", "clean"), default="dirty")
    parser.add_argument("--no-graph", action="store_true")
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument("--peers", default=".", metavar="REGEX",
                        help=f"the peers to time, a regular expression over {', '.join(PEERS)} (default: all; "
                             "'^$': none); the flashjit columns always run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        re.compile(args.peers)
    except re.error as exc:
        parser.error(f"--peers {args.peers!r} is not a regular expression: {exc}")
    import torch

    import flashjit
    from benchmarks.read_floor import ReadFloor
    from benchmarks.timing import Timer, capture

    engine = flashjit.Engine()
    timer, floor = Timer(torch, args.iters, args.flush), ReadFloor(torch)
    results = []
    for row in ROWS:
        if args.only and args.only not in row.name:
            continue
        print(f"{row.name}:", flush=True)
        r = bench_row(torch, row, engine, timer, floor, capture, not args.no_graph, peers=args.peers,
                      report=lambda name, value: print(f"    {name}: {value}", flush=True))
        results.append(r)
        if args.json:  # after every row, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        impls = r["impls"]
        cells = ", ".join(f"{k}: {v}" for k, v in impls.items())
        cells += "".join(f", {k} plan: {v} host us" for k, v in r["plan_us"].items())
        fi = impls.get("FlashInfer TC decode")
        ours = impls.get("flashjit")
        ratio = f" | x{fi / ours:.2f} vs FlashInfer TC" if isinstance(fi, float) and isinstance(ours, float) else ""
        share = impls["read-once floor"] / ours if isinstance(ours, float) else None
        print(f"{row.name}: {cells}{ratio}" + (f" | floor/flashjit {share:.0%}" if share else "")
              + ("".join(f" [{n}]" for n in r["notes"])), flush=True)


if __name__ == "__main__":
    main()
