"""benchmarks/transformers_generate.py's pure parts on the CPU: the implementations it resolves
(no hub kernels), its time budget, and the tokens/s table docs/performance.md shows."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import transformers_generate as tg  # noqa: E402


def entry(all_rate, decode_rate, tokens, oracle="20/32"):
    return {"seconds": 1.0, "tokens_per_s": all_rate, "decode_tokens_per_s": decode_rate, "tokens": tokens,
            "oracle": oracle}


def test_the_table_has_each_flashjit_path_against_every_peer_and_the_fastest():
    rows = {"64x4096": {"flashjit_graph": entry(300.0, 2000.0, [[1, 2], [3, 4]]),
                        "sdpa_graph": entry(150.0, 800.0, [[1, 2], [3, 4]], "18/32"),
                        "sdpa": entry(100.0, 500.0, [[1, 2], [3, 5]]),
                        "best": {"error": "not run: the 230 s budget would pass (--budget-s)"}},
            "32x8192": {"skipped": "its KV cache (120 GB) exceeds the 96 GB budget"}}
    lines = tg.markdown(rows, ["flashjit_graph", "sdpa_graph", "sdpa", "best"]).splitlines()
    assert "flashjit_graph ÷ sdpa_graph (all / decode)" in lines[0] and "flashjit_graph ÷ fastest peer" in lines[0]
    assert lines[0].count("|") == lines[2].count("|") == 12
    assert lines[2] == ("| 64x4096 | 300 / 2000 | 150 / 800 | 100 / 500 | not run | 2.00x / 2.50x | 3.00x / 4.00x | "
                        "n/a | 2.00x / 2.50x (sdpa_graph) | flashjit_graph 20/32, sdpa_graph 18/32, sdpa 20/32 | 1/2 |")
    assert lines[3].startswith("| 32x8192 | skipped: its KV cache")
    assert tg.fastest_peer(rows["64x4096"], ["flashjit_graph", "sdpa", "sdpa_graph"]) == "sdpa_graph"


class FakeModel:
    config = tg.llama3_8b_config(pytest.importorskip("transformers"))


def test_an_implementation_whose_tokens_fail_the_oracle_is_not_timed(monkeypatch):
    import torch

    calls = []

    def generate(model, transformers, torch, implementation, use_graph, prompts, new_tokens, num_blocks):
        calls.append((implementation, len(prompts), new_tokens))
        return {"tokens_per_s": 10.0, "decode_tokens_per_s": 20.0, "tokens": [],
                "outputs": {i: (p, [1] * new_tokens) for i, p in enumerate(prompts)}}

    def verdicts(model, transformers, torch, checks):
        assert set(checks) == {"good", "bad"} and all(len(o) == tg.CHECK_REQUESTS for o in checks.values())
        return {"good": {"decided": "30/32", "problem": None},
                "bad": {"decided": "30/32", "problem": "greedy oracle: 3 of 32 checked tokens are no float32 argmax"}}

    monkeypatch.setattr(tg, "generate", generate)
    monkeypatch.setattr(tg, "oracle_verdicts", verdicts)
    impls = {"good": ("paged|good", True), "bad": ("paged|bad", False)}
    row = tg.run_row(FakeModel(), None, torch, impls, 8, 512, 64, tg.Clock(None))
    assert row["bad"] == {"error": "greedy oracle: 3 of 32 checked tokens are no float32 argmax", "oracle": "30/32"}
    assert row["good"]["oracle"] == "30/32" and row["good"]["tokens_per_s"] == 10.0
    checks, timed = calls[:2], calls[2:]  # every check runs before any timed call
    assert checks == [("paged|good", tg.CHECK_REQUESTS, tg.CHECK_TOKENS), ("paged|bad", tg.CHECK_REQUESTS, tg.CHECK_TOKENS)]
    assert timed == [("paged|good", 8, 64)]


def test_best_is_never_a_hub_kernel_and_unknown_names_are_refused():
    from flashjit.integrations.transformers import paged_name

    table, notes = tg.implementations(["best", "sdpa", "sdpa_graph"], None)
    assert table["sdpa_graph"] == (paged_name("sdpa"), True)  # transformers' fastest sdpa: CUDA graphs
    assert "sdpa_graph" in tg.DEFAULT_IMPLS.split(",")
    attn, graphs = table["best"]
    assert attn in (paged_name("sdpa"), paged_name("flash_attention_2"), paged_name("flash_attention_3")) and graphs
    assert table["sdpa"] == (paged_name("sdpa"), False)
    if torch.cuda.is_available():
        assert tg.implementations(["flashjit_graph"], None)[0]["flashjit_graph"] == (paged_name("fjit_graph"), True)
    else:  # flashjit's attention says what is missing when it is registered
        with pytest.raises(RuntimeError, match="no CUDA device: flashjit's paged attention needs one"):
            tg.implementations(["flashjit_graph"], None)
    assert "/" not in attn and any(n.startswith("best") for n in notes)
    with pytest.raises(SystemExit, match="unknown 'flash_attention'"):
        tg.implementations(["flash_attention"], None)


def test_the_budget_starts_no_implementation_the_longest_so_far_would_push_past_it():
    clock = tg.Clock(100.0)
    assert clock.allows()
    clock.took(60.0)
    clock.start -= 30.0  # 30 s spent: 30 + 60 <= 100
    assert clock.allows()
    clock.start -= 20.0  # 50 s spent: 50 + 60 > 100
    assert not clock.allows()
    assert tg.Clock(None).allows()


def test_the_cli_refuses_a_decode_rate_it_cannot_measure():
    with pytest.raises(SystemExit, match="new-tokens"):
        tg.main(["--new-tokens", "1"])
    assert os.environ.get("HF_HUB_OFFLINE") in (None, "1")


def test_the_oracle_passes_float32_argmaxes_and_fails_the_runner_up():
    """oracle_verdicts on a tiny bf16 Llama on the CPU: greedy float32 tokens pass, and the same
    sequence with its first token replaced by the float32 runner-up fails."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    exact = tg.float32_copy(model, transformers, torch)
    prompt, generated = [5, 9, 200, 17, 3], []
    with torch.no_grad():
        for _ in range(12):
            logits = exact(input_ids=torch.tensor([prompt + generated])).logits[0, -1]
            generated.append(int(logits.argmax()))
        runner_up = exact(input_ids=torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:-1]
    runner_up = runner_up.topk(2, dim=-1).indices[:, 1].tolist()
    wrong = [runner_up[t] if t == 0 else token for t, token in enumerate(generated)]
    verdicts = tg.oracle_verdicts(model, transformers, torch, {"right": {0: (prompt, generated)},
                                                                "wrong": {0: (prompt, wrong)}})
    assert verdicts["right"]["problem"] is None and verdicts["right"]["decided"].endswith("/12")
    assert int(verdicts["right"]["decided"].split("/")[0]) > 0
    assert "no float32 argmax (0: position 0, token" in verdicts["wrong"]["problem"]
