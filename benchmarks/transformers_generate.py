"""transformers' continuous batching (model.generate_batch) with flashjit's paged attention against
transformers' own paths, on a random-initialized Llama-3-8B-shaped model (bf16, 32 layers).

    python -m benchmarks.transformers_generate [--quick] [--rows 64x4096,32x8192] [--new-tokens 64]
                                               [--impls flashjit_graph,sdpa,best,flashjit] [--budget-s 230]
                                               [--json out.json]

Each row generates --new-tokens greedy tokens (default 64, --quick too) for R random prompts of C
tokens. Per implementation it reports the whole call's tokens/s (prefill included) and the steady
decode rate: the tokens produced after the last request's first token, over the time from that
token to the end, when every request is decoding. The KV cache is sized for the row (num_blocks,
max_batch_tokens given), so no implementation is limited by transformers' memory estimate; rows
whose cache would not fit are skipped with a note. --quick runs the issue's target row, 64 x 4096,
alone.

Checked before timed: each implementation first generates CHECK_TOKENS tokens for CHECK_REQUESTS
of the row's prompts (which also compiles flashjit's kernels and loads cuBLAS and SDPA kernels),
and every one of those tokens must pass the greedy oracle
(flashjit.integrations.transformers.greedy_oracle): be an argmax of the same model in float32 fed
the same tokens, within 4x the logit error the plain bf16 forward makes there. An implementation
whose tokens fail is reported, not timed; the table gives the positions the oracle decided.

Implementations (named "paged|NAME" up to transformers 5.18, "NAME" from 5.19): flashjit_graph
(fjit_graph, register(cuda_graphs=True) with use_cuda_graph=True: transformers captures every
padded step size, prefill included, and replays it), flashjit (fjit, eager), sdpa (eager:
transformers' default for it), sdpa_graph (sdpa with use_cuda_graph=True: the fastest
configuration transformers offers sdpa, its decode and prefill steps captured and replayed), flash
(flash_attention_2 or _3, when the flash-attn package is installed; kernels from the hub are never
fetched: HF_HUB_OFFLINE is set), and best: flash where installed, else sdpa_graph. A CUDA-graph
call captures its graphs inside the timed generate_batch (transformers makes them per manager), as
a server would at start. Each flashjit column is compared with every peer run and with the fastest
of them in the row.
--budget-s: an implementation is not started when the time spent so far plus the longest one yet
would pass the budget (the table says so); the order of --impls is the order of priority.
All share transformers' per-step host work (it builds each step's key index in Python), so the
ratio understates the attention's own gain; benchmarks/decode.py times the kernels alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

QUICK_ROWS = ((64, 4096),)
ROWS = ((32, 2048), (64, 4096), (128, 2048), (32, 8192), (64, 8192))
KV_BYTES_BUDGET = 96e9  # of the H200's 141 GB: 16 GB of weights, activations, sdpa's mask and gathers
BLOCK_SIZE = 256
MAX_BATCH_TOKENS = 4096
CHECK_REQUESTS, CHECK_TOKENS = 2, 16  # the greedy-oracle check before each implementation is timed


def llama3_8b_config(transformers):
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                                    max_position_embeddings=16384, tie_word_embeddings=False)


def kv_bytes(config, tokens: int) -> int:
    return tokens * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2


def build_model(transformers, torch):
    config = llama3_8b_config(transformers)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


KNOWN_IMPLS = ("flashjit_graph", "flashjit", "sdpa", "sdpa_graph", "flash", "best")
DEFAULT_IMPLS = "flashjit_graph,sdpa_graph,flash,sdpa,flashjit"


def installed_flash():
    """transformers' name of the flash-attn package installed here (no hub kernels), or None."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    from flashjit.integrations.transformers import paged_name

    if is_flash_attn_3_available():
        return paged_name("flash_attention_3")
    if is_flash_attn_2_available():
        return paged_name("flash_attention_2")
    return None


def implementations(names, torch):
    """name -> (attn_implementation, use_cuda_graph), and notes for those left out or resolved."""
    from flashjit.integrations.transformers import paged_name, register

    table, notes = {}, []
    for name in names:
        if name not in KNOWN_IMPLS:
            raise SystemExit(f"--impls: unknown {name!r}; known: {', '.join(KNOWN_IMPLS)}")
        if name == "flashjit_graph":
            table[name] = (register("fjit_graph", cuda_graphs=True), True)
        elif name == "flashjit":
            table[name] = (register(), False)
        elif name == "sdpa":
            table[name] = (paged_name("sdpa"), False)
        elif name == "sdpa_graph":
            table[name] = (paged_name("sdpa"), True)
        elif name in ("flash", "best"):
            flash = installed_flash()
            if flash is not None:
                table[name] = (flash, True)  # transformers' block-table decode and graphs
                notes.append(f"{name}: {flash} with CUDA graphs")
            elif name == "best":
                table[name] = (paged_name("sdpa"), True)
                notes.append("best: no flash-attn package here (hub kernels are not fetched), so paged|sdpa "
                             "with CUDA graphs")
            else:
                notes.append("flash left out: no flash-attn package here (hub kernels are not fetched)")
    return table, notes


def generate(model, transformers, torch, implementation, use_graph, prompts, new_tokens, num_blocks):
    """One timed generate_batch: tokens/s of the call and of its steady decode, and each request's
    (prompt, generated tokens) under "outputs"."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation(implementation)
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    batching = ContinuousBatchingConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_batch_tokens=MAX_BATCH_TOKENS,
                                        use_cuda_graph=use_graph)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                               record_timestamps=True, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    results = list(out.values())
    missing = len(prompts) - sum(len(r.generated_tokens) == new_tokens for r in results)
    if missing:
        return {"error": f"{missing} of {len(prompts)} requests did not finish (see the log)"}
    tokens = sum(len(r.generated_tokens) for r in results)
    steady_from = max(r.timestamps[0] for r in results)
    end = max(r.timestamps[-1] for r in results)
    steady = sum(sum(t > steady_from for t in r.timestamps) for r in results)
    return {"seconds": wall, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": steady / (end - steady_from) if end > steady_from else None,
            "tokens": [r.generated_tokens for r in results],
            "outputs": {key: (list(r.prompt_ids), list(r.generated_tokens)) for key, r in out.items()}}


def float32_copy(model, transformers, torch):
    """The model in float32 on its device, with plain (not paged) sdpa attention: the oracle's reference."""
    with torch.device(model.device):
        exact = type(model)._from_config(model.config, dtype=torch.float32)
    exact.load_state_dict(model.state_dict())
    exact.set_attn_implementation("sdpa")
    return exact.eval()


def oracle_verdicts(model, transformers, torch, checks: dict) -> dict:
    """name -> None (every checked token is a float32 argmax) or what failed, for each implementation's
    check outputs; and "decided" of each: 'decisive/positions'. One float32 copy for them all."""
    from flashjit.integrations.transformers.greedy_oracle import check_sequences

    exact = float32_copy(model, transformers, torch)
    model.set_attn_implementation("sdpa")  # the plain bf16 forward whose error sets the tolerance
    verdicts = {}
    try:
        for name, outputs in checks.items():
            decisive, positions, failures = check_sequences(exact, model, outputs)
            verdicts[name] = {"decided": f"{decisive}/{positions}",
                              "problem": (f"greedy oracle: {len(failures)} of {positions} checked tokens are no "
                                          f"float32 argmax ({failures[0]})") if failures else None}
    finally:
        del exact
        torch.cuda.empty_cache()
    return verdicts


def run_row(model, transformers, torch, impls, requests, context, new_tokens, clock, seed=0):
    """Each implementation's check (CHECK_REQUESTS prompts, CHECK_TOKENS tokens, judged by the greedy
    oracle), then the timed call of the row for those whose tokens passed."""
    config = model.config
    blocks_per_request = math.ceil((context + new_tokens) / BLOCK_SIZE) + 1
    num_blocks = requests * blocks_per_request + 4
    if kv_bytes(config, num_blocks * BLOCK_SIZE) > KV_BYTES_BUDGET:
        return {"skipped": f"its KV cache ({kv_bytes(config, num_blocks * BLOCK_SIZE) / 1e9:.0f} GB) exceeds "
                           f"the {KV_BYTES_BUDGET / 1e9:.0f} GB budget"}
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, config.vocab_size, (context,), generator=g).tolist() for _ in range(requests)]
    row, checks, started = {}, {}, {}
    check_blocks = CHECK_REQUESTS * (math.ceil((context + CHECK_TOKENS) / BLOCK_SIZE) + 1) + 4
    for name, (implementation, use_graph) in impls.items():
        if not clock.allows():
            row[name] = {"error": f"not run: the {clock.budget_s:.0f} s budget would pass (--budget-s)"}
            continue
        started[name] = time.perf_counter()
        try:
            checks[name] = generate(model, transformers, torch, implementation, use_graph, prompts[:CHECK_REQUESTS],
                                    CHECK_TOKENS, check_blocks)["outputs"]
        except Exception as e:  # reported in the table, the other implementations still run
            row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        torch.cuda.empty_cache()
    verdicts = oracle_verdicts(model, transformers, torch, checks) if checks else {}
    for name in started.keys() - verdicts.keys():  # failed in its check run
        clock.took(time.perf_counter() - started[name])
    for name, verdict in verdicts.items():
        implementation, use_graph = impls[name]
        if verdict["problem"] is not None:
            row[name] = {"error": verdict["problem"], "oracle": verdict["decided"]}
        else:
            try:
                row[name] = generate(model, transformers, torch, implementation, use_graph, prompts, new_tokens,
                                     num_blocks)
                row[name]["oracle"] = verdict["decided"]
            except Exception as e:  # reported in the table, the other implementations still run
                row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            torch.cuda.empty_cache()
        clock.took(time.perf_counter() - started[name])
    for name in impls:
        print(f"  {requests}x{context} {name}: {fmt(row[name])}"
              + (f" (oracle decided {row[name]['oracle']} checked tokens)" if "oracle" in row[name] else ""), flush=True)
    return row


class Clock:
    """The benchmark's time budget: an implementation starts when the longest one yet still fits."""

    def __init__(self, budget_s: float | None):
        self.budget_s, self.start, self.longest = budget_s, time.perf_counter(), 0.0

    def allows(self) -> bool:
        return self.budget_s is None or time.perf_counter() - self.start + self.longest <= self.budget_s

    def took(self, seconds: float):
        self.longest = max(self.longest, seconds)


def fmt(entry) -> str:
    if "error" in entry:
        return f"ERR({entry['error'][:60]})"
    decode = entry["decode_tokens_per_s"]
    return f"{entry['tokens_per_s']:.0f} tok/s all, {decode:.0f} tok/s decode" if decode else \
        f"{entry['tokens_per_s']:.0f} tok/s all"


def agreement(row, name, base="sdpa") -> str:
    """Share of requests whose greedy tokens equal the base implementation's."""
    a, b = row.get(name, {}).get("tokens"), row.get(base, {}).get("tokens")
    if not a or not b:
        return "n/a"
    return f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"


def ratio(row, name, base="sdpa") -> str:
    """name's tokens/s over base's, whole call and steady decode."""
    f, s = row.get(name, {}), row.get(base, {})
    if "tokens_per_s" not in f or "tokens_per_s" not in s:
        return "n/a"
    decode = (f"{f['decode_tokens_per_s'] / s['decode_tokens_per_s']:.2f}x"
              if f["decode_tokens_per_s"] and s["decode_tokens_per_s"] else "n/a")
    return f"{f['tokens_per_s'] / s['tokens_per_s']:.2f}x / {decode}"


def fastest_peer(row, names) -> str | None:
    """The peer (not flashjit) with the most tokens/s over the whole call in the row, None if none ran."""
    ran = [n for n in names if not n.startswith("flashjit") and "tokens_per_s" in row.get(n, {})]
    return max(ran, key=lambda n: row[n]["tokens_per_s"], default=None)


def markdown(rows: dict, names) -> str:
    """The docs' table: tokens/s per implementation, each flashjit one against every peer and the
    fastest peer of the row, and the positions the greedy oracle decided per implementation."""
    header = ["requests x context"] + [f"{n} tok/s (all / decode)" for n in names]
    mine = [n for n in names if n.startswith("flashjit")]
    peers = [n for n in names if not n.startswith("flashjit")]
    pairs = [(n, b) for n in mine for b in peers]
    header += [f"{n} ÷ {b} (all / decode)" for n, b in pairs]
    header += [f"{n} ÷ fastest peer" for n in mine if peers]
    header += ["oracle decided (per implementation)"]
    if mine and "sdpa" in names:
        header += [f"{n}: same tokens as sdpa" for n in mine]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, row in rows.items():
        if "skipped" in row:
            lines.append(f"| {key} | skipped: {row['skipped']} |")
            continue
        cells = [key]
        for n in names:
            e = row.get(n, {})
            cells.append(("not run" if e["error"].startswith("not run") else "ERR") if "error" in e else
                         f"{e['tokens_per_s']:.0f} / {e['decode_tokens_per_s'] or float('nan'):.0f}")
        cells += [ratio(row, n, b) for n, b in pairs]
        fastest = fastest_peer(row, names)
        cells += [f"{ratio(row, n, fastest)} ({fastest})" if fastest else "n/a" for n in mine if peers]
        cells.append(", ".join(f"{n} {row[n]['oracle']}" for n in names if "oracle" in row.get(n, {})) or "n/a")
        if mine and "sdpa" in names:
            cells += [agreement(row, n) for n in mine]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_rows(text: str):
    try:
        return tuple(tuple(int(x) for x in part.lower().split("x")) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--rows: expected REQUESTSxCONTEXT[,...] such as 64x4096, got {text!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"the target row alone ({QUICK_ROWS[0][0]}x{QUICK_ROWS[0][1]}), same tokens and layers")
    parser.add_argument("--rows", type=parse_rows, default=None, help="REQUESTSxCONTEXT[,...]")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--impls", default=DEFAULT_IMPLS,
                        help=f"comma-separated, in order of priority (default {DEFAULT_IMPLS}); known: "
                             f"{', '.join(KNOWN_IMPLS)}")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no implementation that would pass this many seconds (default: quick 230, else none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens: expected at least 2 (a decode rate needs two tokens), got {args.new_tokens}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must not fetch attention kernels from the hub
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    new_tokens = args.new_tokens
    clock = Clock(args.budget_s if args.budget_s is not None else (230.0 if args.quick else None))
    impls, notes = implementations(args.impls.split(","), torch)
    print(f"transformers {transformers.__version__}, {torch.cuda.get_device_name()}, Llama-3-8B shape (random bf16), "
          f"{new_tokens} new tokens, blocks of {BLOCK_SIZE}, max_batch_tokens {MAX_BATCH_TOKENS}", flush=True)
    for note in notes:
        print(note)
    model = build_model(transformers, torch)
    results = {}
    for requests, context in rows:
        results[f"{requests}x{context}"] = run_row(model, transformers, torch, impls, requests, context, new_tokens, clock)
    print()
    print(markdown(results, list(impls)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {n: {m: v for m, v in e.items() if m not in ("tokens", "outputs")} if isinstance(e, dict)
                               else e for n, e in row.items()} for k, row in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
