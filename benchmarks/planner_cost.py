"""Device time of CUDA-graph mode's GPU planner (replan()) for one step of many requests.

    python -m benchmarks.planner_cost [--requests 16,256]

prints, per batch size, the planner as it runs (choosing the chunk), with a forced chunk (no
choice) and making one item per request (no choice, fewest records): the differences place its
cost, and the last is its floor of loads, barriers and writes."""

from __future__ import annotations

import random
import tempfile

PLANS_PER_GRAPH = 20


# What plan() tells the planner: choose the chunk, use 16384 tokens (within the capacity), one item per
# request.
MODES = {"planned": {}, "chunk forced": {"chunk_tokens": 16384}, "one item per request": {"disable_split_kv": True}}


def replan_graph(torch, engine, requests: int = 256, seed: int = 0, options: dict | None = None):
    """(decoder, graph): a CUDA graph of PLANS_PER_GRAPH replan() calls over a skewed batch of
    `requests` (32 q / 8 kv heads, d128, page 16), planned with plan()'s options."""
    import flashjit
    from flashjit.deploy.random_batches import make_batch

    rng = random.Random(seed)
    kv_lens = [rng.randint(64, 4096) if i % 16 else rng.randint(16_000, 64_000) for i in range(requests)]
    batch = make_batch(kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, spare_pages=0)
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=requests,
                                   max_num_pages=int(batch.indices.numel()))
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 32, 8, 128, 16, check_page_ids=False,
                 **(options or {}))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PLANS_PER_GRAPH):
            decoder.replan()
    return decoder, graph


def planner_us(torch, engine, timer, requests: int = 256, seed: int = 0, options: dict | None = None) -> float:
    """Median µs of one replan() (a lone launch would time its own launch latency)."""
    decoder, graph = replan_graph(torch, engine, requests, seed, options)  # decoder: the buffers the graph reads
    return timer.median_us(graph.replay, flush=False) / PLANS_PER_GRAPH


def main(argv=None):
    import argparse

    import torch

    import flashjit
    from benchmarks.timing import Timer

    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_cost", description=__doc__)
    parser.add_argument("--requests", default="16,256", help="comma-separated batch sizes")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    engine, timer = flashjit.Engine(cache_dir=tempfile.mkdtemp()), Timer(torch, args.iters)
    for requests in (int(n) for n in args.requests.split(",")):
        cells = [f"{name} {planner_us(torch, engine, timer, requests, options=options):.2f} us"
                 for name, options in MODES.items()]
        print(f"{requests} requests: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
