"""flashjit.deploy.manifest: TOML -> DecodeSpecs. Pure parsing and expansion: no compile here."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashjit import DecodeSpec, SpecError
from flashjit.deploy import manifest as mf
from flashjit.deploy.manifest import ManifestError, load_manifest, resolve_archs, specs_from_manifest

from repo_paths import EXAMPLES


MODEL = """
[[model]]
name = "tiny"
num_qo_heads = 8
num_kv_heads = 2
head_dim = 64
dtype = "bf16"
page_sizes = [16]
masks = ["none"]
"""


def write(tmp_path, text: str, name: str = "m.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_llama_example_expands_to_the_cross_product():
    specs = specs_from_manifest(EXAMPLES / "llama-3-8b.toml")
    assert len(specs) == 8  # 1 page size x 2 masks x 2 query lengths x 2 archs
    assert len(set(specs)) == len(specs)
    assert {s.arch for s in specs} == {"sm_80", "sm_90"}
    assert {s.mask for s in specs} == {"none", "causal"}
    assert {s.max_q_len for s in specs} == {1, 4}
    assert {(s.head_dim, s.dtype, s.kv_dtype, s.group_size, s.page_size, s.kv_layout) for s in specs} == {
        (128, "bfloat16", "bfloat16", 4, 16, "NHD")}
    assert DecodeSpec.from_name("decode_d128_bf16_kvbf16_causal_p16_g4_q4_nhd_sm90_tc") in specs


@pytest.mark.parametrize("name, group, masks", [
    ("qwen2.5-7b.toml", 7, {"none", "causal"}),
    ("mistral-7b.toml", 4, {"causal", "sliding_window"}),
])
def test_other_examples(name, group, masks):
    specs = specs_from_manifest(EXAMPLES / name)
    assert 0 < len(specs) <= 8  # a handful: each is a real compile in `flashjit prewarm`
    assert {s.group_size for s in specs} == {group}
    assert {s.mask for s in specs} == masks


def test_optional_fields_and_defaults(tmp_path):
    path = write(tmp_path, 'archs = ["sm_90"]\n' + MODEL)
    (spec,) = specs_from_manifest(path)
    assert spec == DecodeSpec(head_dim=64, dtype="bf16", kv_dtype="bf16", mask="none", page_size=16, group_size=4,
                              max_q_len=1, kv_layout="NHD", arch="sm_90")
    text = MODEL + 'kv_dtype = "fp16"\nmax_q_lens = [1, 2]\nkv_layouts = ["NHD", "hnd"]\n'
    specs = specs_from_manifest(write(tmp_path, text), ["sm_80", "sm_90"])
    assert len(specs) == 2 * 2 * 2
    assert {s.kv_dtype for s in specs} == {"float16"}
    assert {s.kv_layout for s in specs} == {"NHD", "HND"}


def test_e4m3_queries_over_an_e4m3_cache_prewarm_their_kernels(tmp_path):
    """A vLLM deployment with --kv-cache-dtype fp8 plans e4m3 queries: q_dtype names them."""
    text = 'archs = ["sm_90"]\n' + MODEL + 'kv_dtype = "fp8"\nq_dtype = "e4m3"\n'
    (spec,) = specs_from_manifest(write(tmp_path, text))
    assert spec.query_fp8 and spec.dtype == "bfloat16" and spec.name.endswith("_fp8q")
    (same,) = specs_from_manifest(write(tmp_path, text.replace('q_dtype = "e4m3"', 'q_dtype = "bf16"')))
    assert not same.query_fp8


def test_models_sharing_kernels_are_built_once(tmp_path):
    second = MODEL.replace('"tiny"', '"tiny-twin"').replace("masks = [\"none\"]", 'masks = ["none", "causal"]')
    specs = specs_from_manifest(write(tmp_path, MODEL + second), "sm_90")
    assert [s.mask for s in specs] == ["none", "causal"]


def test_manifest_object_keeps_models_and_archs(tmp_path):
    m = load_manifest(write(tmp_path, 'archs = ["sm_80"]\n' + MODEL))
    assert m.archs == ("sm_80",)
    assert [model.name for model in m.models] == ["tiny"]
    assert m.models[0].group_size == 4


# ---- arch resolution --------------------------------------------------------------------------

def test_cli_archs_override_manifest_archs(tmp_path):
    path = write(tmp_path, 'archs = ["sm_80"]\n' + MODEL)
    assert {s.arch for s in specs_from_manifest(path)} == {"sm_80"}
    assert {s.arch for s in specs_from_manifest(path, "sm_90, sm_89")} == {"sm_90", "sm_89"}
    assert {s.arch for s in specs_from_manifest(path, ["90"])} == {"sm_90"}


def test_archs_are_normalized_and_deduplicated():
    assert resolve_archs("sm_90,90,sm90,sm_80") == ("sm_90", "sm_80")


def test_arch_falls_back_to_the_current_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(mf, "current_arch", lambda: "sm_89")
    assert {s.arch for s in specs_from_manifest(write(tmp_path, MODEL))} == {"sm_89"}


def test_no_arch_anywhere_asks_for_arch(tmp_path, monkeypatch):
    monkeypatch.setattr(mf, "current_arch", lambda: None)
    path = write(tmp_path, MODEL)
    with pytest.raises(ManifestError, match="pass --arch") as info:
        specs_from_manifest(path)
    assert str(path) in str(info.value)


def test_bad_cli_arch_names_the_option():
    with pytest.raises(SpecError, match=r"'--arch': 'sm_99' is not a known arch; accepted: .*sm_90"):
        resolve_archs("sm_99")


# ---- bad manifests ----------------------------------------------------------------------------

def _replace(old: str, new: str) -> str:
    assert old in MODEL
    return 'archs = ["sm_90"]\n' + MODEL.replace(old, new)


BAD = {
    "heads not divisible": (_replace("num_kv_heads = 2", "num_kv_heads = 3"), "tiny", "num_kv_heads", "must divide"),
    "missing field": (_replace("head_dim = 64\n", ""), "tiny", "head_dim", "required"),
    "unknown key (typo)": (_replace("page_sizes = [16]", "page_size = [16]"), "tiny", "page_size", "unknown key"),
    "scalar for a list": (_replace("page_sizes = [16]", "page_sizes = 16"), "tiny", "page_sizes", "non-empty list"),
    "empty list": (_replace('masks = ["none"]', "masks = []"), "tiny", "masks", "non-empty list"),
    "string heads": (_replace("num_qo_heads = 8", 'num_qo_heads = "8"'), "tiny", "num_qo_heads", "positive integer"),
    "bool heads": (_replace("num_qo_heads = 8", "num_qo_heads = true"), "tiny", "num_qo_heads", "positive integer"),
    "unsupported head_dim": (_replace("head_dim = 64", "head_dim = 80"), "tiny", "head_dim", "80 is not supported; accepted:"),
    "unknown mask": (_replace('masks = ["none"]', 'masks = ["nope"]'), "tiny", "masks", "'nope'"),
    "unknown dtype": (_replace('dtype = "bf16"', 'dtype = "fp8"'), "tiny", "dtype", "'fp8'"),
    "e5m2 queries": (_replace("page_sizes", 'kv_dtype = "fp8"\nq_dtype = "e5m2"\npage_sizes'), "tiny", "q_dtype",
                     "'e5m2' is not supported"),
    "queries of another 16-bit dtype": (_replace("page_sizes", 'q_dtype = "f16"\npage_sizes'), "tiny", "q_dtype",
                                        "accepted: the dtype (bf16) or e4m3"),
    "e4m3 queries over a bf16 cache": (_replace("page_sizes", 'q_dtype = "e4m3"\npage_sizes'), "tiny", "q_dtype",
                                       "'e4m3' is not supported; accepted: False, or True for tensor cores over an "
                                       "e4m3 cache"),
    "bad layout": (_replace("page_sizes", 'kv_layouts = ["NDH"]\npage_sizes'), "tiny", "kv_layouts", "'NDH'"),
    "group too large": (_replace("num_qo_heads = 8\nnum_kv_heads = 2", "num_qo_heads = 128\nnum_kv_heads = 1"),
                        "tiny", "num_qo_heads/num_kv_heads", "128"),
    "page size zero": (_replace("page_sizes = [16]", "page_sizes = [0]"), "tiny", "page_sizes", "0"),
    "duplicate model": ('archs = ["sm_90"]\n' + MODEL + MODEL, "tiny", "name", "appears twice"),
    "nameless model": (_replace('name = "tiny"\n', ""), "#1", "name", "non-empty string"),
    "no model": ('archs = ["sm_90"]\n', None, "model", "at least one [[model]]"),
    "model not a table list": ('model = "llama"\n', None, "model", "at least one [[model]]"),
    "unknown top-level key": ('arch = ["sm_90"]\n' + MODEL, None, "arch", "unknown top-level key"),
    "archs not a list": ('archs = "sm_90"\n' + MODEL, None, "archs", "list of arch names"),
    "unknown arch": ('archs = ["sm_99"]\n' + MODEL, None, "archs", "not a known arch"),
    "not TOML": ("[[model]\nname = ", None, "<file>", "not valid TOML"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_manifest_names_file_model_and_field(tmp_path, case):
    text, model, field, problem = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        specs_from_manifest(path)
    err = info.value
    assert isinstance(err, SpecError) and isinstance(err, ValueError)
    message = str(err)
    assert message.startswith(f"{path}: ")
    assert f"field {field!r}" in message
    assert problem in message
    if model is not None:
        assert f"model {model!r}" in message
    assert err.field == field and err.model == model


def test_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="cannot be read"):
        load_manifest(tmp_path / "absent.toml")
