"""Manifests from HuggingFace config.json: the shipped examples, the sliding-window conventions of
Mistral, Gemma 2/3 and Qwen2, the attention features refused, and errors that name the config field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashjit.deploy.hf_config import manifest_from_hf_config, read_hf_config
from flashjit.deploy.hf_mla import is_mla_config, read_mla_config
from flashjit.deploy.manifest import ManifestError

from cli_runner import run
from repo_paths import HF_EXAMPLES

LLAMA = json.loads((HF_EXAMPLES / "llama-3-8b" / "config.json").read_text())


@pytest.mark.parametrize("folder, heads, kv_heads, head_dim, masks, window, sliding_layers, variant", [
    ("llama-3-8b", 32, 8, 128, ("none", "causal"), None, 0, "none"),
    ("qwen2.5-7b", 28, 4, 128, ("none", "causal"), None, 0, "none"),           # use_sliding_window is false
    ("mistral-7b", 32, 8, 128, ("none", "causal", "sliding_window"), 4096, 32, "none"),
    ("qwen3-8b", 32, 8, 128, ("none", "causal"), None, 0, "none"),             # head_dim field; sliding_window null
    ("llama-3.1-8b", 32, 8, 128, ("none", "causal"), None, 0, "none"),
    ("llama-3.3-70b", 64, 8, 128, ("none", "causal"), None, 0, "none"),
    ("llama-2-7b", 32, 32, 128, ("none", "causal"), None, 0, "none"),          # MHA, float16 checkpoint
    ("phi-3-mini-4k", 32, 32, 96, ("none", "causal", "sliding_window"), 2047, 32, "none"),  # 3072 / 32
    ("gemma-3-1b", 4, 1, 256, ("none", "causal", "sliding_window"), 512, 22, "none"),      # every 6th layer global
    ("gemma-3-12b", 16, 8, 256, ("none", "causal", "sliding_window"), 1024, 40, "none"),   # head_dim: Gemma 3's default
    ("gemma-3-27b", 32, 16, 128, ("none", "causal", "sliding_window"), 1024, 52, "none"),  # multimodal text_config
    ("mistral-nemo-12b", 32, 8, 128, ("none", "causal"), None, 0, "none"),     # head_dim 128, not 5120 / 32
    ("gemma-2-9b", 16, 8, 256, ("none", "causal", "sliding_window"), 4096, 21, "soft_cap"),  # every other layer
    ("gemma-2-27b", 32, 16, 128, ("none", "causal", "sliding_window"), 4096, 23, "soft_cap"),
    ("gpt-oss-20b", 64, 8, 64, ("none", "causal", "sliding_window"), 128, 12, "sinks"),  # layer_types
    ("gpt-oss-120b", 64, 8, 64, ("none", "causal", "sliding_window"), 128, 18, "sinks"),
])
def test_shipped_examples(folder, heads, kv_heads, head_dim, masks, window, sliding_layers, variant):
    model = read_hf_config(HF_EXAMPLES / folder / "config.json")
    assert model.variant == variant
    assert (model.name, model.num_qo_heads, model.num_kv_heads, model.head_dim) == (folder, heads, kv_heads, head_dim)
    assert model.dtype == ("float16" if folder == "llama-2-7b" else "bfloat16") and model.masks == masks
    assert (model.sliding_window, model.sliding_layers) == (window, sliding_layers)
    specs = manifest_from_hf_config(HF_EXAMPLES / folder).specs(["sm_90"])  # a folder holding config.json works too
    assert [s.mask for s in specs] == list(masks) and all(s.variant == variant for s in specs)
    assert all(s.head_dim == head_dim and s.group_size == heads // kv_heads and s.page_size == 16 for s in specs)
    assert all(s.arch == "sm_90" for s in specs)


def test_variant_summaries():
    """What an operator reads for gpt-oss and Gemma 2: the plan() arguments of their variants."""
    gpt = read_hf_config(HF_EXAMPLES / "gpt-oss-20b")
    assert (gpt.sinks, gpt.logits_soft_cap) == (True, None)
    assert "window_left=127" in gpt.summary() and "sinks=" in gpt.summary()
    gemma = read_hf_config(HF_EXAMPLES / "gemma-2-27b")
    assert gemma.logits_soft_cap == 50.0 and "logits_soft_cap=50.0" in gemma.summary()
    assert gemma.notes[-1] == "query_pre_attn_scalar=144: pass sm_scale=144**-0.5 to BatchDecode.plan"


@pytest.mark.parametrize("folder, heads", [("deepseek-v3", 128), ("kimi-k2", 64)])
def test_shipped_latent_attention_examples(folder, heads):
    """Latent attention: refused by the decode kernels' reader, served as MLA specs (tests/test_mla.py)."""
    with pytest.raises(ManifestError, match="multi-head latent attention"):
        read_hf_config(HF_EXAMPLES / folder)
    assert is_mla_config(HF_EXAMPLES / folder) and read_mla_config(HF_EXAMPLES / folder).num_heads == heads


def test_every_shipped_example_is_tested():
    tested = {row[0] for mark in (test_shipped_examples, test_shipped_latent_attention_examples)
              for row in mark.pytestmark[0].args[1]}
    assert tested == {path.parent.name for path in HF_EXAMPLES.glob("*/config.json")}


@pytest.mark.parametrize("path", sorted(HF_EXAMPLES.glob("*/config.json")), ids=lambda path: path.parent.name)
def test_prewarm_every_shipped_example(path, cache_dir, fake_nvrtc):
    """`flashjit prewarm --hf-config examples/hf/<model> --arch sm_90`: the kernels, or exit 2 naming the field."""
    code, out, err = run("prewarm", "--hf-config", path.parent, "--arch", "sm_90", "--cache-dir", cache_dir)
    try:
        specs = (read_mla_config(path).specs(["sm_90"]) if is_mla_config(path)
                 else manifest_from_hf_config(path).specs(["sm_90"]))
    except ManifestError as refused:
        assert code == 2 and f"field {refused.field!r}" in err and not fake_nvrtc
        return
    assert code == 0, err
    assert f"total: {len(specs)} kernels" in out and all(spec.name in out for spec in specs)


def test_example_notes():
    gemma = read_hf_config(HF_EXAMPLES / "gemma-3-27b")
    assert gemma.notes == ("query_pre_attn_scalar=168: pass sm_scale=168**-0.5 to BatchDecode.plan",)
    assert "52 of 62 layers" in gemma.summary() and "window_left=1023" in gemma.summary()
    assert read_hf_config(HF_EXAMPLES / "gemma-3-12b").notes == ()  # query_pre_attn_scalar 256 = head_dim
    qwen = read_hf_config(HF_EXAMPLES / "qwen2.5-7b")
    assert any("use_sliding_window is false" in n for n in qwen.notes)
    assert read_hf_config(HF_EXAMPLES / "llama-3-8b").notes == ()


def write(tmp_path, **fields) -> Path:
    config = {k: v for k, v in dict(LLAMA, **fields).items() if v != "DELETE"}
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("fields, window, sliding_layers", [
    ({"sliding_window": 4096}, 4096, 32),                                                  # Mistral: every layer
    ({"sliding_window": None}, None, 0),                                                   # Mistral v0.2+
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 20}, 4096, 12),  # Qwen2: layers 20..31
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 32}, None, 0),
    ({"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 0}, None, 0),
    ({"sliding_window": 4096, "model_type": "gemma2", "num_hidden_layers": 5}, 4096, 3),   # layers 0, 2, 4
    ({"sliding_window": 1024, "sliding_window_pattern": 6, "num_hidden_layers": 12}, 1024, 10),  # Gemma 3
    ({"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 3}, 512, 3),
    ({"sliding_window": 512, "layer_types": ["full_attention"] * 4}, None, 0),
    ({"model_type": "gemma3_text", "num_hidden_layers": 12}, 4096, 10),  # Gemma 3's default window and pattern
    ({"attn_logit_softcapping": None, "sliding_window": 4096}, 4096, 32),  # null soft-capping: none
], ids=["mistral", "no-window", "qwen-on", "qwen-past-last-layer", "qwen-off", "gemma2", "gemma3", "layer-types",
        "layer-types-all-full", "gemma3-defaults", "softcap-null"])
def test_sliding_window_conventions(tmp_path, fields, window, sliding_layers):
    model = read_hf_config(write(tmp_path, **fields))
    assert (model.sliding_window, model.sliding_layers) == (window, sliding_layers)
    assert ("sliding_window" in model.masks) == bool(sliding_layers)


def test_derived_fields(tmp_path):
    model = read_hf_config(write(tmp_path, num_key_value_heads="DELETE", torch_dtype="DELETE", dtype="float16"))
    assert model.num_kv_heads == 32 and model.dtype == "float16"  # MHA; `dtype`, the newer name of torch_dtype
    assert read_hf_config(write(tmp_path, torch_dtype="DELETE")).dtype == "bfloat16"
    assert read_hf_config(write(tmp_path), dtype="fp16").dtype == "float16"  # --dtype wins
    assert read_hf_config(write(tmp_path, _name_or_path="org/My-Model")).name == "My-Model"
    text = {"text_config": {k: LLAMA[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")},
            "torch_dtype": "float16"}
    (tmp_path / "mm.json").write_text(json.dumps(text))
    multimodal = read_hf_config(tmp_path / "mm.json")
    assert (multimodal.name, multimodal.head_dim, multimodal.dtype) == ("mm", 128, "float16")


def test_manifest_options(tmp_path):
    specs = manifest_from_hf_config(write(tmp_path), page_sizes=(16, 32), kv_dtype="fp16", max_q_lens=(1, 4)).specs(
        ["sm_80", "sm_90"])
    assert len(specs) == 2 * 2 * 2 * 2
    assert {s.page_size for s in specs} == {16, 32} and {s.kv_dtype for s in specs} == {"float16"}
    assert {s.max_q_len for s in specs} == {1, 4} and {s.arch for s in specs} == {"sm_80", "sm_90"}


@pytest.mark.parametrize("fields, field, problem", [
    ({"num_attention_heads": "DELETE"}, "num_attention_heads", "is required"),
    ({"num_key_value_heads": 6}, "num_key_value_heads", "must divide num_attention_heads=32"),
    ({"hidden_size": 2560}, "head_dim", "80 (from hidden_size 2560 / num_attention_heads 32) is not supported"),
    ({"head_dim": 112}, "head_dim", "112 (from head_dim) is not supported"),
    ({"hidden_size": 4100}, "hidden_size", "not a multiple of num_attention_heads"),
    ({"num_attention_heads": 0}, "num_attention_heads", "must be an integer in 1..2147483647, got 0"),
    ({"torch_dtype": "int8"}, "torch_dtype", "'int8' is not supported"),
    ({"kv_lora_rank": 512}, "kv_lora_rank", "multi-head latent attention"),
    ({"head_dim": 1024}, "head_dim", "1024 (from head_dim) is not supported"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping", "must be a number in 1.18e-38..1.84e+19"),
    ({"alibi": True}, "alibi", "ALiBi position biases on the scores; no built-in variant"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type", "ALiBi"),
    ({"attention_chunk_size": 8192}, "attention_chunk_size", "chunked attention"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types", "'linear_attention' are not supported"),
])
def test_errors_name_the_config_field(tmp_path, fields, field, problem):
    path = write(tmp_path, **fields)
    with pytest.raises(ManifestError) as info:
        read_hf_config(path)
    assert info.value.field == field and problem in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("content, problem", [(None, "cannot be read"), ("{not json", "not valid JSON"),
                                              ("[1]", "not a JSON object")])
def test_unreadable_config(tmp_path, content, problem):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ManifestError, match=problem):
        read_hf_config(path)
