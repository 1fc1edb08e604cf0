"""Device time of CUDA-graph mode's GPU planner (replan()) for one step of many requests."""

from __future__ import annotations

import random

PLANS_PER_GRAPH = 20


def planner_us(torch, engine, timer, requests: int = 256, seed: int = 0) -> float:
    """Median µs of one replan() over a skewed batch of `requests` (32 q / 8 kv heads, d128, page 16),
    from a graph of PLANS_PER_GRAPH of them (a lone launch would time its own launch latency)."""
    import flashjit
    from flashjit.deploy.random_batches import make_batch

    rng = random.Random(seed)
    kv_lens = [rng.randint(64, 4096) if i % 16 else rng.randint(16_000, 64_000) for i in range(requests)]
    batch = make_batch(kv_lens, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, spare_pages=0)
    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=requests,
                                   max_num_pages=int(batch.indices.numel()))
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, 32, 8, 128, 16, check_page_ids=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PLANS_PER_GRAPH):
            decoder.replan()
    return timer.median_us(graph.replay, flush=False) / PLANS_PER_GRAPH
