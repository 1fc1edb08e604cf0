"""The layer row: the step time a server sees around decode attention. One CUDA graph per
implementation holds the QKV projection (one bf16 GEMM, hidden 4096 -> q, k and v), attention over
the paged cache with q read in place from the projection's output, and the output projection
(4096 -> 4096): Llama-3-8B's shapes (32 query / 8 KV heads, head_dim 128, pages of 16).

    python -m benchmarks.layer [--batches 1,16,64] [--kv-len 8192] [--peers REGEX] [--iters N] [--json out.json]

Each graph is built as the decode benchmark's graph column builds its step (benchmarks/peers.py:
flashjit and FlashInfer in their CUDA-graph modes, planned before the capture and again before the
replays), replayed under the same L2 flush and timing, and its output checked against the same
layer with the float32 attention reference. A "GEMMs only" graph of the two projections shows what
attention adds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from benchmarks.cases import Case
from benchmarks.inputs import build_inputs, reference
from benchmarks.measure import ROW_TOLERANCE, measure_graph
from flashjit.serving.exactness import Tolerance
from benchmarks.peers import Step, candidates
from benchmarks.timing import Timer, capture

GEMMS_ONLY = "GEMMs only"


class Projections:
    """The layer's weights and activations: x [b, hidden] -> qkv [b, (qo + 2 kv heads) x d], whose
    q columns attention reads in place; attention's output [b, hidden] -> y [b, hidden]."""

    def __init__(self, torch, case: Case, seed: int = 0, device="cuda"):
        gen = torch.Generator(device=device).manual_seed(seed)
        d, hidden = case.head_dim, case.heads_qo * case.head_dim
        width = (case.heads_qo + 2 * case.heads_kv) * d
        normal = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
        self.x = normal(case.batch, hidden).to(torch.bfloat16)
        # Scaled so that q and y have unit-size entries, as after a model's norms.
        self.w_qkv = (normal(hidden, width) / hidden ** 0.5).to(torch.bfloat16)
        self.w_o = (normal(hidden, hidden) / hidden ** 0.5).to(torch.bfloat16)
        self.qkv = torch.empty(case.batch, width, dtype=torch.bfloat16, device=device)
        self.q = self.qkv[:, :hidden].view(case.batch, case.heads_qo, d)
        self.y = torch.empty(case.batch, hidden, dtype=torch.bfloat16, device=device)
        self.torch, self.hidden = torch, hidden

    def project_qkv(self):
        self.torch.matmul(self.x, self.w_qkv, out=self.qkv)

    def project_out(self, attention_out):
        return self.torch.matmul(attention_out.reshape(-1, self.hidden), self.w_o, out=self.y)

    def reference(self, attention_out):
        """The layer's output in float32 from an attention output (float32 or the step's own)."""
        return attention_out.float().reshape(-1, self.hidden) @ self.w_o.float()


# A layer's token rows carry the attention's rounding through the output GEMM, which rounds again.
LAYER_TOLERANCE = Tolerance(out=2 * ROW_TOLERANCE.out, lse=ROW_TOLERANCE.lse)


def layer_step(proj: Projections, attention: Step | None) -> Step:
    """The captured layer: QKV GEMM, attention (none: the GEMMs alone), output GEMM."""
    def call():
        proj.project_qkv()
        return proj.project_out(proj.q if attention is None else attention.call())

    return Step(call, before_replay=None if attention is None else attention.before_replay,
                info=None if attention is None else attention.info)


def bench_batch(torch, b: int, kv_len: int, timer, peers: str) -> dict:
    import flashjit

    case = Case(f"layer b{b} L{kv_len}", b, kv_len)
    proj = Projections(torch, case)
    batch = dataclasses.replace(build_inputs(torch, case), q=proj.q)  # attention reads the GEMM's q columns
    proj.project_qkv()
    ref_attention = reference(batch, case, None)
    found, notes = candidates(torch, batch, case, flashjit.Engine(), None, live_q=True)
    row = {"case": case.name, "impls": {}, "notes": notes}
    sync, capture_step = torch.cuda.synchronize, lambda step: capture(torch, step)

    gemms = measure_graph(lambda: layer_step(proj, None), proj.reference(proj.q), timer, sync=sync,
                          capture=capture_step, tol=LAYER_TOLERANCE)
    row["impls"][GEMMS_ONLY] = gemms.get("graph_us", gemms.get("graph_error"))
    expected = proj.reference(ref_attention)
    for name, make in found.items():
        if name != "flashjit" and not re.search(peers, name):
            continue
        try:
            impl = make()
        except Exception as exc:  # noqa: BLE001 - a peer that cannot build is reported in the row
            row["impls"][name] = f"failed: {type(exc).__name__}: {exc}"[:200]
            continue
        if impl.graph is None:
            row["impls"][name] = "not capturable"
            continue
        entry = measure_graph(lambda: layer_step(proj, impl.graph()), expected, timer, sync=sync,
                              capture=capture_step, tol=LAYER_TOLERANCE)
        row["impls"][name] = entry.get("graph_us", entry.get("graph_error"))
        print(f"    {name}: {row['impls'][name]}", flush=True)
    return row


def speedups(row: dict) -> dict:
    """flashjit's speed over each peer's in the row's layer graphs (above 1: flashjit is faster)."""
    impls = row["impls"]
    ours = impls.get("flashjit")
    return {name: round(us / ours, 3) for name, us in impls.items()
            if name not in ("flashjit", GEMMS_ONLY) and isinstance(us, float) and isinstance(ours, float)}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layer", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--kv-len", type=int, default=8192)
    parser.add_argument("--peers", default=".", metavar="REGEX", help="the peers to time (default: all; '^$': none)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--flush", choices=["dirty", "clean"], default="dirty")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if min(batches) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--batches {args.batches!r}: expected comma-separated positive ints, e.g. 1,16,64")
    import torch

    timer, rows = Timer(torch, args.iters, args.flush), []
    for b in batches:
        print(f"layer b{b} L{args.kv_len}:", flush=True)
        row = bench_batch(torch, b, args.kv_len, timer, args.peers)
        row["flashjit_speedup"] = speedups(row)
        rows.append(row)
        cells = ", ".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row["impls"].items())
        print(f"{row['case']}: {cells} | flashjit speed-up {row['flashjit_speedup']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
