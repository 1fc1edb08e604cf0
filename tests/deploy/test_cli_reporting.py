"""How the `flashjit` commands report: help for every command and argument, -v on either side of
the subcommand, --json on every command that reports, `explain`, "did you mean", the progress bar
only on a terminal, and the spec-name grammar docs/cli.md gives."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import re

import pytest

from flashjit import DecodeSpec
from flashjit.deploy import cli, cli_kernels
from flashjit.deploy.cli_explain import GRAMMAR
from flashjit.deploy.mask_check import CompileResult, Report
from flashjit.jit import host_library
from flashjit.jit.family import spec_from_name
from flashjit.kernels.merge_states.spec import MergeSpec
from flashjit.kernels.mla.spec import MLASpec

from cli_runner import run
from repo_paths import ROOT
from test_cli import SPEC, TINY_MANIFEST



def commands(parser, prefix=()) -> list[tuple[tuple, argparse.ArgumentParser]]:
    """(command words, parser) of every subcommand, nested ones (cache export, ...) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((prefix + (name,), sub))
                found += commands(sub, prefix + (name,))
    return found


COMMANDS = commands(cli.build_parser())
REPORTING = [("prewarm",), ("doctor",), ("check-mask",), ("cache", "prune"), ("cache", "export"), ("cache", "import"),
             ("list",), ("cache", "info"), ("explain",)]


@pytest.mark.parametrize("words, parser", COMMANDS, ids=[" ".join(w) for w, _ in COMMANDS])
def test_every_command_has_a_description_and_every_argument_help(words, parser):
    assert parser.description and len(parser.description) > 30, words
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            assert action.help, f"{' '.join(words)}: {action.dest} has no help"


@pytest.mark.parametrize("words", REPORTING, ids=[" ".join(w) for w in REPORTING])
def test_every_reporting_command_takes_json(words):
    parser = dict(COMMANDS)[words]
    assert any("--json" in action.option_strings for action in parser._actions)


@pytest.mark.parametrize("argv, verbose", [
    (["prewarm", "x.toml"], False), (["-v", "prewarm", "x.toml"], True), (["prewarm", "-v", "x.toml"], True),
    (["prewarm", "x.toml", "--verbose"], True), (["cache", "info", "-v"], True), (["-v", "cache", "prune"], True),
    (["check-mask", "causal", "-v"], True), (["list"], False),
])
def test_verbose_on_either_side_of_the_subcommand(argv, verbose):
    assert cli.build_parser().parse_args(argv).verbose is verbose


def test_verbose_after_the_subcommand_logs_the_compiles(tmp_path, fake_nvrtc):
    code, _, err = run("prewarm", "--spec", SPEC.name, "-v", "--cache-dir", tmp_path / "cache")
    assert code == 0 and f"flashjit: compiling {SPEC.name} for sm_90 (cache miss)" in err


@pytest.mark.parametrize("argv", [["prewarm", "--spec", SPEC.name, "--jobs", "0"],
                                  ["prewarm", "--spec", SPEC.name, "-j", "-2"],
                                  ["cache", "import", "x.tar.gz", "--max-members", "9" * 40],
                                  ["check-mask", "causal", "--seed", "-1"]])
def test_counts_out_of_range_are_usage_errors(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2 and "expected a" in err.getvalue()


def test_a_huge_max_size_is_one_line(tmp_path):
    code, _, err = run("cache", "prune", "--max-size", "9" * 400 + "GB", "--cache-dir", tmp_path)
    assert code == 2 and err.count("\n") == 1 and "at most 1 EiB" in err and len(err) < 200


@pytest.mark.parametrize("argv, words", [
    (["check-mask", "soft_cap", "--params", "logits_soft_cap=x"], "a finite float value for 'logits_soft_cap'"),
    (["check-mask", "soft_cap", "--params", "logits_soft_cap=1e999"], "a finite float value for 'logits_soft_cap'"),
    (["check-mask", "sliding_window", "--params", "window_left=" + "9" * 40], "an int in 0..2147483647 value"),
    (["prewarm", "--spec", "9" * 5000], "characters)"),
    (["prewarm", "--hf-config", ROOT / "examples/hf/llama-3-8b", "--page-size", "\x1b[31m"], "--page-size \\x1b[31m"),
])
def test_bad_command_line_values_are_one_printable_line(tmp_path, argv, words):
    code, _, err = run(*argv, "--cache-dir", tmp_path)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert words in err and err.strip().isprintable() and len(err) < 1100, err


# ---- --json -----------------------------------------------------------------------------------

def json_of(*argv, code=0) -> object:
    got, out, err = run(*argv)
    assert got == code, err
    return json.loads(out)


def test_prewarm_json(tmp_path, fake_nvrtc):
    first = json_of("prewarm", "--spec", SPEC.name, "--json", "--cache-dir", tmp_path / "cache")
    assert first["kernels"] == [{"spec": SPEC.name, "arch": "sm_90", "result": "compiled", "saved": True,
                                 "seconds": first["kernels"][0]["seconds"]}]
    assert first["total"]["kernels"] == 1 and first["total"]["compiled"] == 1
    assert first["cache"] == {"root": str(tmp_path / "cache"), "writable": True}
    again = json_of("prewarm", "--spec", SPEC.name, "--json", "--cache-dir", tmp_path / "cache")
    assert again["kernels"][0]["result"] == "disk" and again["total"]["disk"] == 1


def test_export_import_prune_json(tmp_path, fake_nvrtc):
    cache, host, bundle = tmp_path / "cache", tmp_path / "host", tmp_path / "b.tar.gz"
    assert run("prewarm", "--spec", SPEC.name, "--cache-dir", cache)[0] == 0
    exported = json_of("cache", "export", bundle, "--json", "--cache-dir", cache)
    assert [e["name"] for e in exported["entries"]] == [SPEC.name] and exported["skipped"] == []
    assert exported["path"] == str(bundle) and exported["bytes"] == bundle.stat().st_size
    imported = json_of("cache", "import", bundle, "--json", "--cache-dir", host)
    assert imported["imported"] == [SPEC.name] and imported["rejected"] == [] and imported["present"] == []
    # the C planner a strict server loads is built beside the kernels, as without --json
    assert imported["host_planner"] == ("built (C)" if host_library.compiler() else "numpy (no C helper: see the warning)")
    pruned = json_of("cache", "prune", "--max-size", "0", "--dry-run", "--json", "--cache-dir", host)
    assert pruned["dry_run"] is True and [e["name"] for e in pruned["removed"]] == [SPEC.name]
    assert pruned["kept"] == 0 and pruned["not_removed"] == []


def test_doctor_json(tmp_path):
    report = json_of("doctor", "--json", "--cache-dir", tmp_path / "c")
    assert report["ok"] is True and report["test compile"].startswith("ok: decode_d64")
    assert {"flashjit", "python", "torch", "cupy", "nvrtc", "gpu", "cache dir", "env"} <= set(report)


def test_check_mask_json(monkeypatch, tmp_path):
    from flashjit.deploy import mask_check

    report = Report("causal", compiled=[CompileResult(SPEC.name, "sm_90", "FAIL", 0.5, "no_such_symbol")],
                    notes=["host check: skipped"])
    monkeypatch.setattr(mask_check, "check_mask", lambda *args, **kwargs: report)
    found = json_of("check-mask", "causal", "--json", "--cache-dir", tmp_path, code=1)
    assert found["passed"] is False and found["notes"] == ["host check: skipped"]
    assert found["tables"][0]["rows"] == [{"spec": SPEC.name, "arch": "sm_90", "result": "FAIL", "seconds": "0.50"}]
    assert found["failures"] == [f"FAIL compile {SPEC.name}: no_such_symbol"]


# ---- explain ----------------------------------------------------------------------------------

def test_explain_says_what_each_part_means():
    code, out, _ = run("explain", "decode_d64_bf16_kvbf16_sliding_window-sinks_p16_g8_q2_hnd_sm90_tc")
    assert code == 0
    rows = {line.split()[1]: line for line in out.splitlines()[3:-1]}
    assert "window_left" in rows["mask"] and "sinks" in rows["variant"] and rows["group_size"].split()[0] == "g8"
    assert "[kv_heads, page_size, head_dim]" in rows["kv_layout"] and "tensor-core" in rows["tensor_cores"]
    assert out.splitlines()[-1].startswith("picked by: BatchDecode.plan(num_qo_heads=8*n, num_kv_heads=n, head_dim=64")


def test_explain_says_when_plan_would_pick_another_kernel():
    found = json_of("explain", "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90", "--json")
    assert found["spec"]["tensor_cores"] is False
    assert found["picked_by"].endswith("only with tensor_cores=False: by default it picks "
                                       "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc")


def test_explain_names_e4m3_queries_and_the_plan_that_picks_them():
    found = json_of("explain", "decode_d128_bf16_kve4m3_causal_p16_g4_q1_nhd_sm90_tc_fp8q", "--json")
    assert found["spec"]["query_fp8"] is True
    assert "q_dtype='float8_e4m3fn', out_dtype='bfloat16'" in found["picked_by"]


@pytest.mark.parametrize("name", ["mla_c512_r64_h16_bf16_kvbf16_p64_q1_sm90", "merge_states_f32_sm80"])
def test_explain_mla_and_merge_names(name):
    found = json_of("explain", name, "--json")
    assert found["name"] == name and all(field["meaning"] for field in found["fields"])


@pytest.mark.parametrize("name, message", [
    ("decode_d100_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90", r"field head_dim \('d100'\): 100 is not supported; "
                                                          r"accepted: 64, 96, 128, 256, 512$"),
    ("decode_d128_bf16_kvbf16_causal_p16_q1_nhd_sm90", r"field group_size \('p16'\): expected g<group_size>"),
    ("decode_d128_bf16_kvbf16_casual_p16_g4_q1_nhd_sm90", r"field mask \('casual'\): .*did you mean 'causal'\?$"),
    ("decode_d128_bf16_kvbf16_causal-sink_p16_g4_q1_nhd_sm90", r"field variant \('sink'\): .*did you mean 'sinks'"),
    ("decode_d128_bf16_kvbf16_p16_g4_q1_nhd_sm90", r"field mask \(nothing\): expected a mask name"),
    ("decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tp", r"field arch \('tp'\): expected sm<arch>"),
    ("decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc_fp8q", r"field query_fp8 \('fp8q'\): True is not "
                                                                  r"supported; accepted: .*e4m3 cache"),
    ("decode_d128_bf16_kve4m3_causal_p16_g4_q1_nhd_sm90_fp8q_tc", r"expected _tc, _sp, _fp8q in that order"),
    ("mla_c512_r64_h16_bf16_kvbf16_p64_sm90", r"field max_q_len \('sm90'\): expected q<max_q_len>"),
    ("merge_states_f64_sm90", r"field dtype \('f64'\): expected f16, bf16 or f32"),
    ("flash_d128", r"a spec name starts with decode_, mla_ or merge_states_"),
])
def test_explain_names_the_bad_part(name, message):
    code, out, err = run("explain", name)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert re.search(message, err.strip()), err


# ---- did you mean -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, suggestion", [
    (["prewarm", "--spec", SPEC.name.replace("_none_", "_casual_")], "did you mean 'causal'?"),
    (["prewarm", "--spec", SPEC.name.replace("_none_", "_none-softcap_")], "did you mean 'soft_cap'"),
    (["check-mask", "sliding_windw"], "did you mean 'sliding_window'"),
    (["check-mask", "causal", "--variant", "sink"], "did you mean 'sinks'"),
])
def test_a_mistyped_mask_or_variant_gets_a_suggestion(tmp_path, argv, suggestion):
    code, _, err = run(*argv, "--cache-dir", tmp_path)
    assert code == 2 and suggestion in err


def test_a_mistyped_mask_in_a_manifest_gets_a_suggestion(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(TINY_MANIFEST.replace('masks = ["none"]', 'masks = ["sliding-window"]'))
    code, _, err = run("prewarm", path, "--cache-dir", tmp_path / "c")
    assert code == 2 and "field 'masks'" in err and "did you mean 'sliding_window'" in err


# ---- progress ---------------------------------------------------------------------------------

class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_a_progress_bar_on_a_terminal_and_one_summary_line_otherwise(tmp_path, fake_nvrtc, terminal):
    err = Terminal() if terminal else io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert cli.main(["prewarm", "--spec", SPEC.name, "--cache-dir", str(tmp_path)]) == 0
    text = err.getvalue()
    summary = [line for line in text.splitlines() if line.startswith("flashjit: prewarm: ")]
    if terminal:
        assert "\r" in text and "kernel" in text and not summary  # tqdm's bar
    else:
        assert text.splitlines() == summary and len(summary) == 1 and "\r" not in text
        assert re.fullmatch(r"flashjit: prewarm: 1 kernels, 1 compiled, 0 disk hits, 0 memory hits in [\d.]+ s",
                            summary[0])


def test_library_callers_of_prewarm_specs_can_ask_for_silence(tmp_path, fake_nvrtc):
    from flashjit import Engine

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cli_kernels.prewarm_specs(Engine(tmp_path), [SPEC], 1, progress=False)
    assert err.getvalue() == ""


# ---- the spec-name grammar of docs/cli.md -----------------------------------------------------

def from_grammar(grammar: str, spec) -> str:
    """The name the grammar gives for spec: each {field} its short form, optional parts where set."""
    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
    values = {k: short.get(v, v) for k, v in spec.to_dict().items()}
    values["arch"] = spec.arch.removeprefix("sm_")
    text = grammar.replace("{nhd|hnd}", getattr(spec, "kv_layout", "").lower())
    text = text.replace("[-{variant}]", "" if values.get("variant") == "none" else "-{variant}")
    text = text.replace("[_tc]", "_tc" if values.get("tensor_cores") else "")
    text = text.replace("[_sp]", "_sp" if values.get("shared_prefix") else "")
    text = text.replace("[_fp8q]", "_fp8q" if values.get("query_fp8") else "")
    return text.format(**values)


SPECS = [DecodeSpec(d, dtype=dt, kv_dtype=kv, mask=m, page_size=p, group_size=g, max_q_len=q, kv_layout=layout,
                    arch=arch, tensor_cores=tc, variant=v, shared_prefix=sp)
         for (d, dt, kv, m, p, g, q, layout, arch, tc, v, sp) in [
             (128, "bf16", "bf16", "causal", 16, 4, 1, "NHD", "sm_90", None, "none", False),
             (128, "bf16", "bf16", "causal", 16, 4, 1, "NHD", "sm_90", False, "none", False),
             (64, "fp16", "e4m3", "sliding_window", 1, 8, 4, "HND", "sm_80", None, "soft_cap_sinks", False),
             (256, "bf16", "e5m2", "block_sparse", 64, 1, 16, "NHD", "sm_90a", True, "sinks", False),
             (128, "bf16", "bf16", "none", 16, 4, 2, "NHD", "sm_90", True, "none", True)]]
SPECS += [DecodeSpec(128, dtype="bf16", kv_dtype="e4m3", mask="causal", group_size=8, arch="sm_90", query_fp8=True)]
SPECS += [MLASpec(num_heads=16, arch="sm_90"), MLASpec(num_heads=128, kv_dtype="e4m3", page_size=1, arch="sm_90"),
          MergeSpec("float32", "sm_80")]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_the_documented_grammar_gives_each_spec_its_name(spec):
    family = "decode" if isinstance(spec, DecodeSpec) else "mla" if isinstance(spec, MLASpec) else "merge_states"
    assert from_grammar(GRAMMAR[family], spec) == spec.name
    assert f"`{GRAMMAR[family]}`" in (ROOT / "docs" / "cli.md").read_text()


DOCUMENTED = sorted({name for path in itertools.chain((ROOT / "docs").glob("*.md"), [ROOT / "README.md"])
                     for name in re.findall(r"\b(?:decode_d|mla_c|merge_states_)[\w\-]+", path.read_text())})


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_spec_name_in_the_docs_parses_back_to_itself(name):
    assert spec_from_name(name).name == name
    assert run("explain", name)[0] == 0


def test_the_docs_show_spec_names():
    assert len(DOCUMENTED) >= 5
