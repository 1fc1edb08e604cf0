"""A small Llama-style decode loop over a real paged KV cache, with flashjit doing the attention.

    python examples/serve_decode.py [--steps 8] [--layers 4]

What a serving engine does each step, in miniature:
  * a page allocator hands out KV pages; two requests share their prompt's pages (prefix sharing,
    reference-counted; shared pages are full, so appends never write into them);
  * each step appends the new token's K and V into the requests' pages (a page is allocated when
    the last one is full), plans once (BatchDecode.plan), and runs every layer (BatchDecode.run);
  * the whole step (projections, the K/V append, attention, MLP) is captured in one CUDA graph and
    replayed after each new plan.
Each step is checked against the same model run eagerly with flashjit.serving.reference.decode_reference
on a copy of the cache. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flashjit  # noqa: E402
from flashjit.serving.reference import decode_reference  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
HIDDEN = HEADS * HEAD_DIM


class PageAllocator:
    """Free list of page ids with reference counts (shared prefix pages are counted once per user)."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, -1, -1))
        self.refs = [0] * num_pages

    def allocate(self) -> int:
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> int:
        self.refs[page] += 1
        return page


class Model:
    """Random weights; per layer: RMSNorm, QKV projection, attention, output projection, MLP."""

    def __init__(self, layers: int, gen: torch.Generator):
        def weight(*shape):
            return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).bfloat16().cuda()

        qkv = HIDDEN + 2 * KV_HEADS * HEAD_DIM
        self.layers = [dict(wqkv=weight(HIDDEN, qkv), wo=weight(HIDDEN, HIDDEN), w1=weight(HIDDEN, 512),
                            w2=weight(512, HIDDEN)) for _ in range(layers)]

    def step(self, x, slots, k_caches, v_caches, attend):
        """One token per request. slots: flat cache slot (page * PAGE + offset) of the new token."""
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            h = torch.nn.functional.rms_norm(x, (HIDDEN,))
            q, k, v = (h @ layer["wqkv"]).split([HIDDEN, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            k_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k.view(-1, KV_HEADS, HEAD_DIM))
            v_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v.view(-1, KV_HEADS, HEAD_DIM))
            attn = attend(q.reshape(-1, HEADS, HEAD_DIM), k_cache, v_cache)
            x = x + attn.reshape(-1, HIDDEN) @ layer["wo"]
            x = x + torch.relu(torch.nn.functional.rms_norm(x, (HIDDEN,)) @ layer["w1"]) @ layer["w2"]
        return x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("serve_decode: needs a CUDA GPU; nothing run")
        return 0

    gen = torch.Generator().manual_seed(0)
    model = Model(args.layers, gen)
    pool = PageAllocator(4096)
    shape = (4096, PAGE, KV_HEADS, HEAD_DIM)
    k_caches = [torch.randn(shape, generator=gen).bfloat16().cuda() for _ in range(args.layers)]
    v_caches = [torch.randn(shape, generator=gen).bfloat16().cuda() for _ in range(args.layers)]

    # Prompts: requests 0 and 1 share a 512-token prefix (32 full pages); the prompts' K/V are the
    # random cache contents, as a prefill would have left them.
    prefix = [pool.allocate() for _ in range(512 // PAGE)]
    prompt_lens = [512 + 37, 512 + 100, 1000, 3000]
    tables, lengths = [], list(prompt_lens)
    for r, n in enumerate(prompt_lens):
        shared = [pool.share(p) for p in prefix] if r < 2 else []
        own = -(-(n - len(shared) * PAGE) // PAGE)
        tables.append(shared + [pool.allocate() for _ in range(own)])
    batch = len(prompt_lens)

    decoder = flashjit.BatchDecode(device="cuda", use_cuda_graph=True, max_batch_size=batch, max_num_pages=4096)
    x_static = torch.randn(batch, HIDDEN, generator=gen).bfloat16().cuda()
    slots_static = torch.zeros(batch, dtype=torch.int64, device="cuda")
    attn_out = [torch.empty(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]

    def plan_step():
        """Grow page tables for the new token, fill the slot buffer, plan once for all layers."""
        slots = []
        for r in range(batch):
            lengths[r] += 1
            if lengths[r] > len(tables[r]) * PAGE:
                tables[r].append(pool.allocate())
            slots.append(tables[r][(lengths[r] - 1) // PAGE] * PAGE + (lengths[r] - 1) % PAGE)
        slots_static.copy_(torch.tensor(slots))
        indptr = torch.tensor([0] + [len(t) for t in tables]).cumsum(0).to(torch.int32)
        indices = torch.tensor([p for t in tables for p in t], dtype=torch.int32, device="cuda")
        last = torch.tensor([n - (len(t) - 1) * PAGE for n, t in zip(lengths, tables)], dtype=torch.int32)
        decoder.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_dtype=torch.bfloat16)
        return indptr, indices, last

    layer_calls = iter(())

    def flashjit_attend(q, k_cache, v_cache):
        return decoder.run(q, (k_cache, v_cache), out=next(layer_calls))

    def graph_body():
        nonlocal layer_calls
        layer_calls = iter(attn_out)
        return model.step(x_static, slots_static, k_caches, v_caches, flashjit_attend)

    tables_now = plan_step()
    graph_body()  # warm-up outside capture: kernels compiled and loaded (the replay rewrites its K/V)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = graph_body()

    worst = 0.0
    for step in range(args.steps):
        if step:
            tables_now = plan_step()
        x_static.copy_(torch.randn(batch, HIDDEN, generator=gen).bfloat16())
        k_ref, v_ref = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
        graph.replay()

        def reference_attend(q, k_cache, v_cache):
            out, _ = decode_reference(q, k_cache, v_cache, *tables_now)
            return out.bfloat16()

        y_ref = model.step(x_static, slots_static, k_ref, v_ref, reference_attend)
        err = ((y_static.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        worst = max(worst, err)
        print(f"step {step}: lengths {lengths}  pages in use {sum(len(t) for t in tables) - len(prefix)} "
              f"(+{len(prefix)} shared)  rel error vs reference {err:.2e}")
    ok = worst <= 2e-2
    print(f"serve_decode: {args.steps} graph-replayed steps, {args.layers} layers, "
          f"{'PASS' if ok else 'FAIL'} (worst rel error {worst:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
