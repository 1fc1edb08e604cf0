"""transformers' continuous batching (model.generate_batch) with flashjit's paged attention against
transformers' own paths, on a random-initialized Llama-3-8B-shaped model (bf16, 32 layers).

    python -m benchmarks.transformers_generate [--quick] [--rows 64x4096,32x8192] [--new-tokens 64]
                                               [--impls flashjit,sdpa,sdpa_graph,flash] [--json out.json]

Each row generates --new-tokens greedy tokens for R random prompts of C tokens. Per implementation
it reports the whole call's tokens/s (prefill included) and the steady decode rate: the tokens
produced after the last request's first token, over the time from that token to the end, when
every request is decoding. Before a row is timed, each implementation runs a short warm-up call
(compiles flashjit's kernels into the disk cache, loads cuBLAS and SDPA kernels). The KV cache is
sized for the row (num_blocks, max_batch_tokens given), so no implementation is limited by
transformers' memory estimate; rows whose cache would not fit are skipped with a note.

Implementations: flashjit ("paged|fjit", eager: transformers 5.17 cannot capture it, see
docs/integrations.md), sdpa ("paged|sdpa", eager: transformers' default for it), sdpa_graph
("paged|sdpa" with use_cuda_graph=True, which transformers allows when asked; its warm-up captures
the largest shapes and costs a minute), flash ("paged|flash_attention_2", when flash-attn imports;
transformers gives its CUDA graphs and block-table decode only to flash names).
All share transformers' per-step host work (it builds each step's key index in Python), so the
ratio understates the attention's own gain; benchmarks/decode.py times the kernels alone.
"""

from __future__ import annotations

import argparse
import json
import math
import time

QUICK_ROWS = ((64, 4096),)
ROWS = ((32, 2048), (64, 4096), (128, 2048), (32, 8192), (64, 8192))
KV_BYTES_BUDGET = 96e9  # of the H200's 141 GB: 16 GB of weights, activations, sdpa's mask and gathers
BLOCK_SIZE = 256
MAX_BATCH_TOKENS = 4096


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


def implementations(names, torch):
    """name -> (attn_implementation, use_cuda_graph), and notes for those left out."""
    from flashjit.integrations.transformers import register

    table, notes = {}, []
    for name in names:
        if name == "flashjit":
            table[name] = (register(), False)
        elif name == "sdpa":
            table[name] = ("paged|sdpa", False)
        elif name == "sdpa_graph":
            table[name] = ("paged|sdpa", True)
        elif name == "flash":
            try:
                import flash_attn  # noqa: F401
                table[name] = ("paged|flash_attention_2", True)
            except ImportError as e:
                notes.append(f"flash left out: {e}")
        else:
            raise SystemExit(f"--impls: unknown {name!r}; known: flashjit, sdpa, sdpa_graph, flash")
    return table, notes


def generate(model, transformers, torch, implementation, use_graph, prompts, new_tokens, num_blocks):
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
            "tokens": [r.generated_tokens for r in results]}


def run_row(model, transformers, torch, impls, requests, context, new_tokens, seed=0):
    config = model.config
    blocks_per_request = math.ceil((context + new_tokens) / BLOCK_SIZE) + 1
    num_blocks = requests * blocks_per_request + 4
    if kv_bytes(config, num_blocks * BLOCK_SIZE) > KV_BYTES_BUDGET:
        return {"skipped": f"its KV cache ({kv_bytes(config, num_blocks * BLOCK_SIZE) / 1e9:.0f} GB) exceeds "
                           f"the {KV_BYTES_BUDGET / 1e9:.0f} GB budget"}
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, config.vocab_size, (context,), generator=g).tolist() for _ in range(requests)]
    row = {}
    for name, (implementation, use_graph) in impls.items():
        try:
            generate(model, transformers, torch, implementation, use_graph, prompts[:2], 4, num_blocks)  # warm-up
            row[name] = generate(model, transformers, torch, implementation, use_graph, prompts, new_tokens, num_blocks)
        except Exception as e:  # reported in the table, the other implementations still run
            row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        torch.cuda.empty_cache()
        print(f"  {requests}x{context} {name}: {fmt(row[name])}", flush=True)
    return row


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


def markdown(rows: dict, names) -> str:
    header = ["requests x context"] + [f"{n} tok/s (all / decode)" for n in names]
    if "flashjit" in names and "sdpa" in names:
        header += ["flashjit ÷ sdpa (all / decode)", "same tokens as sdpa"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, row in rows.items():
        if "skipped" in row:
            lines.append(f"| {key} | skipped: {row['skipped']} |")
            continue
        cells = [key]
        for n in names:
            e = row.get(n, {})
            cells.append("ERR" if "error" in e else
                         f"{e['tokens_per_s']:.0f} / {e['decode_tokens_per_s'] or float('nan'):.0f}")
        if "flashjit" in names and "sdpa" in names:
            f, s = row.get("flashjit", {}), row.get("sdpa", {})
            if "tokens_per_s" in f and "tokens_per_s" in s:
                decode = (f"{f['decode_tokens_per_s'] / s['decode_tokens_per_s']:.2f}x"
                          if f["decode_tokens_per_s"] and s["decode_tokens_per_s"] else "n/a")
                cells += [f"{f['tokens_per_s'] / s['tokens_per_s']:.2f}x / {decode}", agreement(row, "flashjit")]
            else:
                cells += ["n/a", "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_rows(text: str):
    try:
        return tuple(tuple(int(x) for x in part.lower().split("x")) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--rows: expected REQUESTSxCONTEXT[,...] such as 64x4096, got {text!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"one row ({QUICK_ROWS[0][0]}x{QUICK_ROWS[0][1]}), 32 tokens")
    parser.add_argument("--rows", type=parse_rows, default=None, help="REQUESTSxCONTEXT[,...]")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 64; quick 32)")
    parser.add_argument("--impls", default="flashjit,sdpa,flash")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    new_tokens = args.new_tokens or (32 if args.quick else 64)
    impls, notes = implementations(args.impls.split(","), torch)
    print(f"transformers {transformers.__version__}, {torch.cuda.get_device_name()}, Llama-3-8B shape (random bf16), "
          f"{new_tokens} new tokens, blocks of {BLOCK_SIZE}, max_batch_tokens {MAX_BATCH_TOKENS}", flush=True)
    for note in notes:
        print(note)
    model = build_model(transformers, torch)
    results = {}
    for requests, context in rows:
        results[f"{requests}x{context}"] = run_row(model, transformers, torch, impls, requests, context, new_tokens)
    print()
    print(markdown(results, list(impls)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {n: {m: v for m, v in e.items() if m != "tokens"} if isinstance(e, dict) else e
                           for n, e in row.items()} for k, row in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
