"""Context-parallel decode: one request's context sharded over the ranks of a torchrun job, checked
against single-GPU decode of the same cache.

    torchrun --nproc-per-node 2 examples/context_parallel_decode.py --tokens 1048576
    torchrun --nproc-per-node 4 examples/context_parallel_decode.py --layout contiguous --mask causal --q-len 4
    python examples/context_parallel_decode.py --shards 4        # one GPU: the shards one after another
    torchrun --nproc-per-node 2 examples/context_parallel_decode.py --device cpu --tokens 4096   # gloo, torch attention

Every rank builds the same seeded cache (so the single-GPU check can run anywhere; a server's rank
holds only its own pages), takes its shard (split_page_table) and runs ContextParallelDecode; rank 0
prints the error against BatchDecode over the whole cache, the step time, and the time of the
shard's decode alone (the rest is the collective and the merge).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import flashjit
from flashjit.parallel import (ContextParallelDecode, ReferenceDecoder, SequentialContextParallelDecode, Shard,
                               split_page_table)
from flashjit.serving.reference import decode_reference


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=262144, help="keys of the request (default 256k)")
    p.add_argument("--batch", type=int, default=1, help="requests, each of --tokens keys")
    p.add_argument("--q-len", type=int, default=1, help="query tokens per request")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layout", choices=["interleaved", "contiguous"], default="interleaved")
    p.add_argument("--block-pages", type=int, default=16, help="interleaved: pages per run")
    p.add_argument("--mask", choices=["none", "causal", "sliding_window"], default="causal")
    p.add_argument("--window-left", type=int, default=None)
    p.add_argument("--output", choices=["replicated", "heads"], default="replicated")
    p.add_argument("--shards", type=int, default=2, help="without torchrun: shards run one after another")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args()


def make_cache(args, device):
    gen = torch.Generator().manual_seed(0)
    pages_per = -(-args.tokens // args.page_size)
    total = pages_per * args.batch
    indptr = torch.arange(args.batch + 1, dtype=torch.int32) * pages_per
    indices = torch.randperm(total, generator=gen).to(torch.int32)
    last = torch.full((args.batch,), args.tokens - (pages_per - 1) * args.page_size, dtype=torch.int32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (total, args.page_size, args.kv_heads, args.head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    q = torch.randn(args.batch * args.q_len, args.heads, args.head_dim, generator=gen).to(dtype).to(device)
    qo = torch.arange(args.batch + 1, dtype=torch.int32) * args.q_len
    return q, (k, v), indptr, indices, last, qo


def timed(fn, iters, device):
    if device.type != "cuda":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000 / iters  # us


def main():
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ
    device = torch.device(args.device)
    if distributed:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        rank, world = 0, args.shards
    q, cache, indptr, indices, last, qo = make_cache(args, device)
    kv_lens = [args.tokens] * args.batch
    plan_args = (kv_lens, args.heads, args.kv_heads, args.head_dim, args.page_size)
    options = dict(qo_indptr=qo, mask=args.mask, window_left=args.window_left)
    splits = split_page_table(indptr, indices.numpy(), last, args.page_size, world, layout=args.layout,
                              block_pages=args.block_pages)
    shards = [Shard.from_split(s, device) for s in splits]
    decoder = None if device.type == "cuda" else ReferenceDecoder
    if distributed:
        parallel = ContextParallelDecode(output=args.output, device=device, decoder=decoder)
        parallel.plan(shards[rank], *plan_args, **options)
    else:
        parallel = SequentialContextParallelDecode(world, device=device, decoder=decoder)
        parallel.plan(shards, *plan_args, **options)
    out, lse = parallel.run(q, cache, return_lse=True)

    params = {} if args.window_left is None else {"window_left": args.window_left}
    if device.type == "cuda":
        single = flashjit.BatchDecode(device=device)
        single.plan(indptr, indices.to(device), last, args.heads, args.kv_heads, args.head_dim, args.page_size,
                    **options)
        want, want_lse = single.run(q, cache, return_lse=True)
    else:
        want, want_lse = decode_reference(q, *cache, indptr, indices, last, qo_indptr=qo, mask=args.mask,
                                          mask_params=params)
    if args.output == "heads" and distributed:
        part = args.heads // world
        want, want_lse = want[:, rank * part:(rank + 1) * part], want_lse[:, rank * part:(rank + 1) * part]
    error = (out.float() - want.float()).abs().max().item()
    live = want_lse != float("-inf")
    lse_error = (lse[live] - want_lse[live]).abs().max().item() if live.any() else 0.0
    tolerance = 2e-2 if device.type == "cuda" else 1e-4
    ok = error <= tolerance and lse_error <= tolerance and torch.equal(lse == float("-inf"), want_lse == float("-inf"))

    step_us = timed(lambda: parallel.run(q, cache), args.iters, device)
    shard_us = float("nan")
    if device.type == "cuda":
        alone = flashjit.BatchDecode(device=device)
        mine = shards[rank] if distributed else shards[0]
        shard = parallel._shard if distributed else parallel._shards[0]  # the local mask it planned
        mask_params = None
        if shard.mask.mask == "key_range":
            from flashjit.masks.key_range import key_range_params

            mask_params = key_range_params(shard.mask.qo_indptr, shard.mask.begin, shard.mask.end, device=device)
        alone.plan(mine.indptr, mine.indices, mine.last_page_len, args.heads, args.kv_heads, args.head_dim,
                   args.page_size, qo_indptr=qo, mask=shard.mask.mask, mask_params=mask_params)
        shard_us = timed(lambda: alone.run(q, cache, return_lse=True), args.iters, device)
    if distributed:
        verdict = torch.tensor([int(ok)], device=device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        ok = bool(verdict.item())
    if rank == 0:
        mode = f"{world} ranks ({'nccl' if device.type == 'cuda' else 'gloo'})" if distributed else f"{world} shards, one process"
        print(f"context-parallel decode: {mode}, {args.batch} x {args.tokens} keys, {args.layout} layout, mask "
              f"{args.mask}, output {args.output}")
        print(f"  max abs error vs single-device decode: out {error:.3g}, lse {lse_error:.3g} -> {'PASS' if ok else 'FAIL'}")
        if device.type == "cuda":
            print(f"  step {step_us:.1f} us; rank 0's shard decode alone {shard_us:.1f} us "
                  f"(collective + merge: {step_us - shard_us:.1f} us)")
    if distributed:
        dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
