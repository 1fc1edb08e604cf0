"""flashjit's vLLM backend against the FA3 call vLLM makes on Hopper: per-layer attention time.

    python -m benchmarks.serving_backends [--specs 8q1s1k 64q1s4k ...] [--kv bf16 fp8] [--iters 50]
                                          [--no-graph] [--json out.json]

Each spec (vLLM's batch grammar, benchmarks/serving_specs.py) is laid out as vLLM lays out a step:
decode rows first, shuffled blocks from 1 on (block 0 is the null block), a cache in vLLM's
default LBNHC layout (K and V side by side per token and head), the step's new K/V written through
the backend's writer. Per layer (32 q / 8 kv heads, head_dim 128, blocks of 16 by default):

- flashjit: the backend's forward (flashjit.integrations.core.LayerAttention, what FlashJITImpl
  runs): the decode rows on flashjit, planned once per step (its host time is printed, not counted
  per layer), the prefill rows on FA3's flash_attn_with_kvcache over the same cache. The graph
  column replays a CUDA graph of the forward over a graph decoder, re-planned before the replays;
  vLLM replays FULL graphs for decode-only steps only (UNIFORM_BATCH), so mixed specs have none.
- fa3: vLLM's FLASH_ATTN path on Hopper: one flash_attn_with_kvcache (tokenspeed-fa3's
  flash_attn_interface, the FA3 kernels vLLM ships) over every row, with scheduler metadata
  computed once per step (vLLM's AOT schedule), so before every timed call or replay and outside
  its timing; eager with FA3's own split choice, in a graph with vLLM's split cap (32).

With an fp8 cache both get e4m3 queries, quantized before the timed call, as vLLM's attention layer
quantizes them (fused by torch.compile into the op before it) for FA3 and for flashjit's backend
(FLASHJIT_VLLM_FP8_QUERIES, on by default).

The read floor streams the bytes of every request's keys and values once (benchmarks/read_floor.py,
same flush and timing): no kernel that reads each request's cache can beat it, so FA3 ÷ floor is
the largest ratio over FA3 any such kernel reaches (a shared prompt read once goes below it). Steps
mixing prefill rows also time their parts: flashjit's decode rows, its prefill rows (FA3 into the
output), and FA3 alone on the prefill rows.

Every implementation's output is checked request by request against the float32 reference
before it is timed, and each graph's again after its timed replays; a wrong one is reported, not
timed (benchmarks/timing.py: L2 flushed before each timed call, CUDA events, median).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.serving_specs import block_table, check_rows, parse_spec, requests_of, slot_mapping

SPECS = ("8q1s1k", "64q1s4k", "2q2k_32q1s1k", "1q1s32k_63q1s2k", "16q1s9kp8k")
FA3_GRAPH_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph
TOLERANCE = {"bf16": {"decode": 1e-2, "prefill": 1e-2}, "fp8": {"decode": 2e-2, "prefill": 8e-2}}
FA3_FP8_TOLERANCE = {"decode": 8e-2, "prefill": 8e-2}  # FA3 multiplies P V in e4m3 too
K_SCALE, V_SCALE = 0.02, 0.015


class Shape:
    def __init__(self, args):
        self.heads, self.kv_heads, self.head_dim, self.block = args.heads, args.kv_heads, args.head_dim, args.block_size


def make_cache(torch, shape: Shape, num_blocks: int, kind: str):
    """(vLLM's per-layer cache view [blocks, kv_heads, block, 2 * head_dim], its scales or None, vLLM's dtype name)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randn(num_blocks, shape.block, shape.kv_heads, 2 * shape.head_dim, generator=g, device="cuda")
    if kind == "fp8":
        d = shape.head_dim
        scaled = torch.cat([raw[..., :d] / K_SCALE, raw[..., d:] / V_SCALE], dim=-1).clamp(-448, 448)
        raw = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        scales = (torch.tensor([K_SCALE], device="cuda"), torch.tensor([V_SCALE], device="cuda"))
        return raw.permute(0, 2, 1, 3), scales, "fp8"
    return raw.bfloat16().permute(0, 2, 1, 3), (None, None), "auto"


def kv_bytes(requests, shape: Shape, kind: str) -> int:
    """The bytes of every request's keys and values, read once."""
    return int(sum(requests.seq_lens)) * shape.kv_heads * shape.head_dim * 2 * (1 if kind == "fp8" else 2)


def step_inputs(torch, requests, table):
    qsl = np.concatenate([[0], np.cumsum(requests.query_lens)]).astype(np.int32)
    return dict(query_start_loc=torch.from_numpy(qsl).cuda(), query_start_loc_cpu=torch.from_numpy(qsl),
                seq_lens=torch.tensor(requests.seq_lens, dtype=torch.int32, device="cuda"),
                block_table=torch.from_numpy(table).cuda(), num_reqs=len(requests.seq_lens),
                num_actual_tokens=int(sum(requests.query_lens)), max_seq_len=max(requests.seq_lens))


def reference(torch, pair, scales, inputs, q, sm_scale):
    from flashjit.integrations.core import host_page_table
    from flashjit.serving.quantize import dequantize_kv
    from flashjit.serving.reference import decode_reference

    k, v = pair.k, pair.v
    if scales[0] is not None:
        k, v = dequantize_kv(k, scales[0]), dequantize_kv(v, scales[1])
    table = host_page_table(inputs["block_table"], inputs["seq_lens"].cpu(), inputs["query_start_loc_cpu"],
                            inputs["num_reqs"], pair.k.shape[1])
    out, _ = decode_reference(q, k, v, table.indptr, table.indices, table.last_page_len, qo_indptr=table.qo_indptr,
                              mask="causal", sm_scale=sm_scale)
    return out


def fa3_calls(torch, fa3, pair, scales, inputs, q, shape: Shape, graph: bool):
    """vLLM's FA3 call over every row and the step's scheduling: (call, schedule). schedule()
    computes the scheduler metadata into the buffer call() reads, as vLLM does once per step; a call
    that reuses it unscheduled (a second replay) may skip work, so every timed call gets one."""
    fp8 = scales[0] is not None
    rows = inputs["num_reqs"]
    splits = FA3_GRAPH_SPLITS if graph else 0
    extra = {}
    if fp8:  # q is e4m3 already, as vLLM hands it over
        shape2 = (rows, shape.kv_heads)
        extra = dict(q_descale=torch.ones(shape2, device="cuda"), k_descale=scales[0].expand(shape2),
                     v_descale=scales[1].expand(shape2))
    max_q = int(max(np.diff(inputs["query_start_loc_cpu"].numpy())))

    def scheduled():
        return fa3.get_scheduler_metadata(rows, max_q, inputs["max_seq_len"], shape.heads, shape.kv_heads,
                                          shape.head_dim, inputs["seq_lens"], qkv_dtype=q.dtype,
                                          cu_seqlens_q=inputs["query_start_loc"], page_size=shape.block,
                                          causal=True, num_splits=splits)

    metadata = scheduled()

    def schedule():
        metadata.copy_(scheduled())

    def call():
        return fa3.flash_attn_with_kvcache(q, pair.k, pair.v, cache_seqlens=inputs["seq_lens"],
                                           page_table=inputs["block_table"], cu_seqlens_q=inputs["query_start_loc"],
                                           max_seqlen_q=max_q, softmax_scale=shape.head_dim ** -0.5, causal=True,
                                           scheduler_metadata=metadata, num_splits=splits, **extra)

    return call, schedule


def checked_replay(name: str, graph, out, check, tolerance: dict, before=None) -> float:
    """One replay (after before(), the step's scheduling, if given) into out, filled with NaN first,
    checked row by row: its largest row error, or AssertionError naming it."""
    if before is not None:
        before()
    out.fill_(float("nan"))
    graph.replay()
    return check(name, out, tolerance)


def fa3_prefill_alone(fa3, pair, scales, prefill, q, shape: Shape):
    """FA3 on a step's prefill rows only (e4m3 queries over an fp8 cache, as bench_spec makes them)."""
    from flashjit.integrations.core.prefill import fa3_descales

    extra = fa3_descales(prefill, shape.kv_heads, None, *scales) if scales[0] is not None else {}
    return lambda: fa3.flash_attn_with_kvcache(  # noqa: E731
        q, pair.k, pair.v, cache_seqlens=prefill.seqused_k, page_table=prefill.block_table,
        cu_seqlens_q=prefill.cu_seqlens_q, max_seqlen_q=prefill.max_seqlen_q, softmax_scale=shape.head_dim ** -0.5,
        causal=True, **extra)


def time_parts(row, timer, layer, step, q, pair, out, scales, fa3, shape: Shape) -> None:
    """A mixed step's parts into row: decode_us, prefill_us (flashjit's), fa3_prefill_us (FA3 alone)."""
    n, p, sm_scale = step.decode_tokens, step.prefill, shape.head_dim ** -0.5
    decoder = next(iter(step.decoders.values()))
    rows = slice(p.token_begin, p.token_end)
    row["decode_us"] = timer.median_us(lambda: decoder.run(q[:n], pair, out=out[:n], k_scale=scales[0],
                                                           v_scale=scales[1]))
    row["prefill_us"] = timer.median_us(lambda: layer.prefill(q[rows], pair, out[rows], p, sm_scale=sm_scale,
                                                              k_scale=scales[0], v_scale=scales[1]))
    row["fa3_prefill_us"] = timer.median_us(fa3_prefill_alone(fa3, pair, scales, p, q[rows], shape))


def bench_spec(torch, fa3, engine, spec: str, kind: str, shape: Shape, timer, floor, graphs: bool) -> dict:
    from benchmarks.timing import capture, host_us
    from flashjit.integrations.core import DecodeForm, Fa3KVCachePrefill, LayerAttention, StepPlanner, split_kv_cache

    segments = parse_spec(spec)
    decode_q_len = max([1] + [s.q_len for s in segments if s.q_len <= 16])
    requests = requests_of(segments, decode_q_len)
    num_blocks = sum(-(-s // shape.block) for s in requests.seq_lens) + 64
    kv_cache, scales, cache_dtype = make_cache(torch, shape, num_blocks, kind)
    table = block_table(requests, shape.block, num_blocks, np.random.default_rng(1))
    inputs = step_inputs(torch, requests, table)
    tokens = inputs["num_actual_tokens"]
    sm_scale = shape.head_dim ** -0.5
    form = DecodeForm(shape.heads, shape.kv_heads, shape.head_dim, shape.block, "bfloat16",
                      "float8_e4m3fn" if kind == "fp8" else "bfloat16", sm_scale, fp8_queries=kind == "fp8")
    layer = LayerAttention(form, cache_dtype=cache_dtype, prefill=Fa3KVCachePrefill(fa3))
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(tokens, shape.heads, shape.head_dim, generator=g, device="cuda").bfloat16()
    if kind == "fp8":  # as vLLM's layer hands them over (scale 1), and the reference on their values
        from flashjit.integrations.core.prefill import quantized_query

        q = quantized_query(q, torch.float8_e4m3fn, None)
    new_k = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=g, device="cuda").bfloat16()
    slots = torch.from_numpy(slot_mapping(requests, table, shape.block)).cuda()
    layer.write_kv(kv_cache, new_k, torch.randn_like(new_k), slots, *scales)
    pair = split_kv_cache(kv_cache, shape.head_dim, cache_dtype)
    ref = reference(torch, pair, scales, inputs, q.float() if kind == "fp8" else q, sm_scale)
    sync = torch.cuda.synchronize
    planner = StepPlanner([form], "cuda", block_size=shape.block, max_decode_q_len=decode_q_len, engine=engine,
                          max_graph_tokens=tokens, max_pages=tokens * table.shape[1])
    planner.prewarm(f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    step = planner.plan(**inputs, seq_lens_cpu=inputs["seq_lens"].cpu(), graph=False)
    out = torch.empty_like(q, dtype=torch.bfloat16)
    forward = lambda: layer.forward(step, q, kv_cache, out, k_scale=scales[0], v_scale=scales[1])  # noqa: E731
    qsl, decode_tokens = inputs["query_start_loc_cpu"], step.rows.num_decode_tokens
    check = lambda name, got, tol: check_rows(name, got, ref, qsl, decode_tokens, tol)  # noqa: E731
    row = {"spec": spec, "kv": kind, "decode_rows": step.rows.num_decodes, "prefill_rows": step.rows.num_prefills,
           "shared_prefix": bool(step.decoders) and step.decoders[form].spec.shared_prefix}
    forward()
    row["flashjit_error"] = check("flashjit", out, TOLERANCE[kind])
    row["flashjit_us"] = timer.median_us(forward)
    row["floor_us"] = floor.us(timer, kv_bytes(requests, shape, kind))
    if step.prefill is not None and step.rows.num_decodes:
        time_parts(row, timer, layer, step, q, pair, out, scales, fa3, shape)
        forward()
        check("flashjit, after timing its parts", out, TOLERANCE[kind])
    row["plan_host_us"] = host_us(lambda: planner.plan(**inputs, seq_lens_cpu=inputs["seq_lens"].cpu(), graph=False),
                                  sync, calls=200)
    tolerance = FA3_FP8_TOLERANCE if kind == "fp8" else TOLERANCE[kind]
    fa3_eager, fa3_schedule = fa3_calls(torch, fa3, pair, scales, inputs, q, shape, graph=False)
    row["fa3_error"] = check("fa3", fa3_eager(), tolerance)
    row["fa3_us"] = timer.median_us(fa3_eager, before=fa3_schedule)
    if graphs:
        fa3_call, fa3_schedule = fa3_calls(torch, fa3, pair, scales, inputs, q, shape, graph=True)
        fa3_graph, fa3_out = capture(torch, fa3_call)
        row["fa3_graph_error"] = checked_replay("fa3 graph", fa3_graph, fa3_out, check, tolerance, fa3_schedule)
        row["fa3_graph_us"] = timer.median_us(fa3_graph.replay, before=fa3_schedule)
        checked_replay("fa3 graph, after the timed replays", fa3_graph, fa3_out, check, tolerance, fa3_schedule)
        if step.rows.pure_decode:
            plan = lambda: planner.plan(**inputs, seq_lens_cpu=inputs["seq_lens"].cpu(), graph=True)  # noqa: E731
            graph_step = plan()
            graph_out = torch.empty_like(out)
            graph, _ = capture(torch, lambda: layer.forward(graph_step, q, kv_cache, graph_out, k_scale=scales[0],
                                                            v_scale=scales[1]))
            plan()  # a step's build() before its replay
            row["flashjit_graph_error"] = checked_replay("flashjit graph", graph, graph_out, check, TOLERANCE[kind])
            row["flashjit_graph_us"] = timer.median_us(graph.replay)
            checked_replay("flashjit graph, after the timed replays", graph, graph_out, check, TOLERANCE[kind])
    return row


def ratio(row, ours: str, theirs: str):
    return row[theirs] / row[ours] if ours in row and theirs in row else None


def report(row):
    eager, graph = ratio(row, "flashjit_us", "fa3_us"), ratio(row, "flashjit_graph_us", "fa3_graph_us")
    cells = [row["spec"], row["kv"], f"{row['flashjit_us']:.1f}", f"{row.get('flashjit_graph_us', float('nan')):.1f}",
             f"{row['fa3_us']:.1f}", f"{row.get('fa3_graph_us', float('nan')):.1f}",
             "-" if eager is None else f"{eager:.2f}x", "-" if graph is None else f"{graph:.2f}x",
             f"{row['floor_us']:.1f} ({row['floor_us'] / row['flashjit_us']:.0%})",
             f"{row['fa3_us'] / row['floor_us']:.2f}x", "yes" if row["shared_prefix"] else "no",
             f"{row['plan_host_us']:.0f}"]
    print("| " + " | ".join(cells) + " |", flush=True)
    if "decode_us" in row:
        print(f"|   parts of {row['spec']} {row['kv']}: flashjit decode rows {row['decode_us']:.1f} µs + prefill rows "
              f"{row['prefill_us']:.1f} µs; FA3 alone on the prefill rows {row['fa3_prefill_us']:.1f} µs |",
              flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--specs", nargs="+", default=list(SPECS))
    parser.add_argument("--kv", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-graph", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for spec in args.specs:
        parse_spec(spec)  # a bad spec fails before any GPU work

    import torch
    import flash_attn_interface as fa3  # tokenspeed-fa3

    import flashjit
    from benchmarks.read_floor import ReadFloor
    from benchmarks.timing import Timer

    shape, timer, engine, floor = Shape(args), Timer(torch, args.iters), flashjit.Engine(), ReadFloor(torch)
    print(f"{torch.cuda.get_device_name()}: {shape.heads} q / {shape.kv_heads} kv heads, head_dim {shape.head_dim}, "
          f"blocks of {shape.block}; per-layer µs, median of {args.iters}")
    print("| spec | kv | flashjit | flashjit graph | fa3 | fa3 graph (splits 32) | eager ratio | graph ratio | "
          "read floor (÷ flashjit) | fa3 ÷ floor | shared | plan host µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for spec in args.specs:
        for kind in args.kv:
            try:
                row = bench_spec(torch, fa3, engine, spec, kind, shape, timer, floor, graphs=not args.no_graph)
            except AssertionError as wrong:  # check_rows: an implementation's output is wrong
                print(f"| {spec} | {kind} | wrong output, not timed: {wrong} |", flush=True)
                row = {"spec": spec, "kv": kind, "wrong": str(wrong)}
            else:
                report(row)
            rows.append(row)
            if args.json:  # after every row: a later crash keeps the rows measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
