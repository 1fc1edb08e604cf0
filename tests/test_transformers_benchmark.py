"""benchmarks/transformers_generate.py's pure parts on the CPU: the implementations it resolves
(no hub kernels), its time budget, and the tokens/s table docs/performance.md shows."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

from benchmarks import transformers_generate as tg  # noqa: E402


def entry(all_rate, decode_rate, tokens):
    return {"seconds": 1.0, "tokens_per_s": all_rate, "decode_tokens_per_s": decode_rate, "tokens": tokens}


def test_the_table_has_each_flashjit_path_against_sdpa_and_best():
    rows = {"64x4096": {"flashjit_graph": entry(300.0, 2000.0, [[1, 2], [3, 4]]),
                        "sdpa": entry(100.0, 500.0, [[1, 2], [3, 5]]),
                        "best": {"error": "not run: the 230 s budget would pass (--budget-s)"}},
            "32x8192": {"skipped": "its KV cache (120 GB) exceeds the 96 GB budget"}}
    lines = tg.markdown(rows, ["flashjit_graph", "sdpa", "best"]).splitlines()
    assert lines[0].count("|") == 8 and "flashjit_graph ÷ sdpa (all / decode)" in lines[0]
    assert lines[2] == "| 64x4096 | 300 / 2000 | 100 / 500 | not run | 3.00x / 4.00x | n/a | 1/2 |"
    assert lines[3].startswith("| 32x8192 | skipped: its KV cache")


def test_best_is_never_a_hub_kernel_and_unknown_names_are_refused():
    from flashjit.integrations.transformers import paged_name

    table, notes = tg.implementations(["best", "sdpa", "flashjit_graph"], None)
    attn, graphs = table["best"]
    assert attn in (paged_name("sdpa"), paged_name("flash_attention_2"), paged_name("flash_attention_3")) and graphs
    assert table["flashjit_graph"] == (paged_name("fjit_graph"), True) and table["sdpa"] == (paged_name("sdpa"), False)
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
