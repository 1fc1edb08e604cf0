"""The operator's input files (manifests and config.json) on the command line: whatever they hold,
one error line naming the file and the field and exit status 2 — no traceback, no hang on a FIFO or
a device, no wrong-typed field dropped, no control character reaching the terminal."""

from __future__ import annotations

import copy
import json
import os
import threading

import pytest

from flashjit.deploy.hf_config import read_hf_config
from flashjit.deploy.hf_mla import read_mla_config
from flashjit.deploy.input_files import HugeNumber, ManifestError, printable, quote

from cli_runner import run
from repo_paths import ROOT
from test_cli import TINY_MANIFEST

LLAMA = json.loads((ROOT / "examples/hf/llama-3-8b/config.json").read_text())
QWEN = json.loads((ROOT / "examples/hf/qwen2.5-7b/config.json").read_text())
DEEPSEEK = json.loads((ROOT / "examples/hf/deepseek-v3/config.json").read_text())


def assert_one_line(code: int, out: str, err: str, path, field: str | None, *words):
    """Exit 2 and one error line naming the file (and the field) and holding every word."""
    lines = [line for line in err.splitlines() if line.startswith("flashjit: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith(f"flashjit: error: {path}: "), line
    if field is not None:
        assert f"field '{field}'" in line, line
    for word in words:
        assert word in line, line
    assert len(line) < 400 and line.isprintable(), line


def with_field(config: dict, key: str, value) -> dict:
    config = copy.deepcopy(config)
    config[key] = value
    return config


# ---- manifests ------------------------------------------------------------------------------------

MANIFESTS = {
    "not utf-8": (TINY_MANIFEST.encode().replace(b'"tiny"', b'"t\xffny"'), "<file>", "not UTF-8 text (byte 0xff"),
    "nested 3000 deep": (b"a = " + b"[" * 3000 + b"]" * 3000, "<file>", "nests too deeply"),
    "a 5000-digit number": (TINY_MANIFEST.replace("num_qo_heads = 4", "num_qo_heads = " + "9" * 5000).encode(),
                            "<file>", "not valid TOML"),
    "heads past int32": (TINY_MANIFEST.replace("num_qo_heads = 4", "num_qo_heads = " + "9" * 40).encode(),
                         "num_qo_heads", "up to 2147483647, got 99999"),
    "a page size of 400 digits": (TINY_MANIFEST.replace("[16]", "[" + "9" * 400 + "]").encode(), "page_sizes",
                                 "characters) is not supported"),
    "a string for a list": (TINY_MANIFEST.replace('["none"]', '"none"').encode(), "masks", "non-empty list of strs"),
    "a table for archs": (TINY_MANIFEST.replace('archs = ["sm_80"]', "archs = {a = 1}").encode(), "archs",
                          "list of arch names"),
    "a control character in a name": (TINY_MANIFEST.replace('"tiny"', '"ti\\u001b[31mny"').replace(
        "num_kv_heads = 4", "num_kv_heads = 3").encode(), "num_kv_heads", "model 'ti\\x1b[31mny'"),
}


@pytest.mark.parametrize("content, field, words", MANIFESTS.values(), ids=MANIFESTS.keys())
def test_a_bad_manifest_is_one_line_naming_file_and_field(tmp_path, content, field, words):
    path = tmp_path / "m.toml"
    path.write_bytes(content)
    assert_one_line(*run("prewarm", path, "--cache-dir", tmp_path / "cache"), path, field, words)


# ---- config.json ----------------------------------------------------------------------------------

CONFIGS = {
    "not utf-8": (b'{"a": "\xfe"}', "<file>", "not UTF-8 text (byte 0xfe at offset 7)"),
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, "<file>", "nests too deeply"),
    "a 5000-digit head count": (json.dumps(LLAMA).replace('"num_attention_heads": 32', '"num_attention_heads": '
                                                          + "9" * 5000).encode(),
                                "num_attention_heads", "got a number of 5000 digits"),
    "heads past int32": (json.dumps(with_field(LLAMA, "num_key_value_heads", 2**40)).encode(),
                         "num_key_value_heads", "integer in 1..2147483647"),
    "layers as a string": (json.dumps(with_field(LLAMA, "num_hidden_layers", "32")).encode(), "num_hidden_layers",
                           "got '32'"),
    "window as a float": (json.dumps(with_field(LLAMA, "sliding_window", 4096.5)).encode(), "sliding_window",
                          "got 4096.5"),
    "layer types as a string": (json.dumps(with_field(with_field(LLAMA, "sliding_window", 512), "layer_types",
                                                      "sliding_attention")).encode(), "layer_types",
                                "list of strings"),
    "max_window_layers as a string": (json.dumps(with_field(with_field(QWEN, "use_sliding_window", True),
                                                            "max_window_layers", "x")).encode(),
                                      "max_window_layers", "got 'x'"),
    "use_sliding_window as a string": (json.dumps(with_field(QWEN, "use_sliding_window", "false")).encode(),
                                       "use_sliding_window", "true or false"),
    "model_type as a list": (json.dumps(with_field(LLAMA, "model_type", ["llama"])).encode(), "model_type",
                             "must be a string"),
    "torch_dtype as a list": (json.dumps(with_field(LLAMA, "torch_dtype", ["bfloat16"])).encode(), "torch_dtype",
                              "must be a string"),
    "text_config as a number": (json.dumps(with_field({"text_config": 5}, "torch_dtype", "bfloat16")).encode(),
                                "text_config", "must be an object"),
    "soft cap 1e999": (json.dumps(LLAMA)[:-1].encode() + b', "attn_logit_softcapping": 1e999}',
                       "attn_logit_softcapping", "got inf"),
    "soft cap without a normal reciprocal": (json.dumps(with_field(LLAMA, "attn_logit_softcapping", 1e-39)).encode(),
                                             "attn_logit_softcapping", "1.18e-38..1.84e+19"),
    "query_pre_attn_scalar NaN": (json.dumps(LLAMA)[:-1].encode() + b', "query_pre_attn_scalar": NaN}',
                                  "query_pre_attn_scalar", "got nan"),
    "a name that is not a string": (json.dumps(with_field(LLAMA, "_name_or_path", {"a": 1})).encode(),
                                    "_name_or_path", "must be a string"),
    "MLA rope_scaling factor as a string": (json.dumps(with_field(DEEPSEEK, "rope_scaling", {
        "type": "yarn", "factor": "40", "mscale_all_dim": 1.0})).encode(), "rope_scaling.factor", "got '40'"),
    "MLA mscale_all_dim 1e308": (json.dumps(with_field(DEEPSEEK, "rope_scaling", {
        "type": "yarn", "factor": 40, "mscale_all_dim": 1e308})).encode(), "rope_scaling.mscale_all_dim",
        "YaRN mscale"),
    "MLA rope_scaling as a list": (json.dumps(with_field(DEEPSEEK, "rope_scaling", [1])).encode(), "rope_scaling",
                                   "must be an object"),
}


@pytest.mark.parametrize("content, field, words", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_bad_config_is_one_line_naming_file_and_field(tmp_path, content, field, words):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    assert_one_line(*run("prewarm", "--hf-config", path, "--arch", "sm_90", "--cache-dir", tmp_path / "cache"),
                    path, field, words)


def test_wrong_typed_fields_are_refused_not_dropped(tmp_path):
    """A window the config states in the wrong type used to be dropped: a model planned without it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(with_field(LLAMA, "sliding_window", "4096")))
    with pytest.raises(ManifestError, match=r"field 'sliding_window': must be an integer in 0\.\.2147483647, "
                                            r"got '4096'$"):
        read_hf_config(path)
    path.write_text(json.dumps(with_field(LLAMA, "sliding_window", None)))  # null: no window, as transformers reads it
    assert read_hf_config(path).sliding_window is None


def test_a_yarn_config_still_scales_sm_scale(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK))
    mla = read_mla_config(path)
    assert mla.sm_scale > 192 ** -0.5  # DeepSeek-V3's YaRN mscale squared


# ---- special files: refused without blocking -----------------------------------------------------

def run_with_deadline(*argv, seconds=20):
    """run(*argv) in a thread: a command blocked on a FIFO fails the test instead of hanging it."""
    result = []
    thread = threading.Thread(target=lambda: result.append(run(*argv)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"flashjit {' '.join(map(str, argv))} still runs after {seconds} s (blocked on a special file?)"
    return result[0]


@pytest.mark.parametrize("as_option", [False, True], ids=["manifest", "--hf-config"])
def test_a_fifo_is_refused_without_blocking(tmp_path, as_option):
    fifo = tmp_path / "input.fifo"
    os.mkfifo(fifo)
    argv = ("--hf-config", fifo, "--arch", "sm_90") if as_option else (fifo,)
    assert_one_line(*run_with_deadline("prewarm", *argv, "--cache-dir", tmp_path / "cache"), fifo, "<file>",
                    "is not a regular file (a FIFO)")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_refused(tmp_path):
    assert_one_line(*run_with_deadline("prewarm", "--hf-config", "/dev/zero", "--arch", "sm_90", "--cache-dir",
                                       tmp_path / "cache"), "/dev/zero", "<file>", "a character device")


def test_a_folder_without_config_json_names_the_missing_file(tmp_path):
    assert_one_line(*run("prewarm", "--hf-config", tmp_path, "--arch", "sm_90", "--cache-dir", tmp_path / "c"),
                    tmp_path / "config.json", "<file>", "cannot be read")


# ---- what reaches the terminal --------------------------------------------------------------------

def test_control_characters_in_a_model_name_are_escaped(tmp_path, fake_nvrtc):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(with_field(LLAMA, "_name_or_path", "org/evil\x1b[2J\x07\nname")))
    model = read_hf_config(path)
    assert model.name == "evil\\x1b[2J\\x07\\nname" and model.summary().isprintable()
    code, out, err = run("prewarm", "--hf-config", path, "--arch", "sm_90", "--cache-dir", tmp_path / "cache")
    assert code == 0 and "\x1b" not in err + out and "\x07" not in err + out and "evil\\x1b[2J" in err


def test_quote_shortens_and_escapes():
    assert quote("a\x1bb") == "'a\\x1bb'"
    long = quote("x" * 10_000)
    assert len(long) < 100 and long.endswith("(10002 characters)")
    assert quote(HugeNumber("9" * 5000)) == "a number of 5000 digits"
    assert printable("plain é") == "plain é" and printable("\x9b") == "\\x9b"
