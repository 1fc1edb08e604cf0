"""The `flashjit` command, run in-process through cli.main (plus one `python -m flashjit` subprocess).

A real NVRTC compile costs about 0.4 s, so the suite compiles twice: the module's `seeded` cache
(the first `prewarm`) and `doctor`'s test compile. Other tests copy the seeded cache and see disk
hits.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashjit import CompileError, DecodeSpec, __version__
from flashjit.deploy import cli_kernels, smoke_test
from flashjit.jit import host_library
from flashjit.jit.cache import KernelCache

from cli_runner import run
from repo_paths import ROOT

SPEC = DecodeSpec(head_dim=64, dtype="bf16", mask="none", page_size=16, group_size=1, arch="sm_90")

TINY_MANIFEST = """
archs = ["sm_80"]

[[model]]
name = "tiny"
num_qo_heads = 4
num_kv_heads = 4
head_dim = 64
dtype = "bf16"
page_sizes = [16]
masks = ["none"]
"""


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A cache dir holding SPEC, made by a first `flashjit prewarm` (the one compile most tests share)."""
    cache_dir = tmp_path_factory.mktemp("seeded")
    code, out, err = run("prewarm", "--spec", SPEC.name, "--cache-dir", cache_dir)
    assert code == 0, err
    return cache_dir, out


@pytest.fixture
def cache(seeded, tmp_path) -> Path:
    """A private copy of the seeded cache."""
    target = tmp_path / "cache"
    shutil.copytree(seeded[0], target)
    return target


@pytest.fixture
def tiny_manifest(tmp_path) -> Path:
    """A manifest whose one spec is SPEC (once --arch sm_90 retargets it)."""
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_MANIFEST)
    return path


# ---- prewarm ----------------------------------------------------------------------------------

def test_prewarm_compiles_then_hits_disk(seeded):
    cache_dir, first = seeded
    assert SPEC.name in first and "compiled" in first
    assert "total: 1 kernels, 1 compiled, 0 disk hits" in first
    code, second, _ = run("prewarm", "--spec", SPEC.name, "--cache-dir", cache_dir)
    assert code == 0
    row = next(line for line in second.splitlines() if line.startswith(SPEC.name))
    assert row.split()[1:4] == ["sm_90", "hit", "(disk)"]
    assert "total: 1 kernels, 0 compiled, 1 disk hits, 0 memory hits" in second
    if host_library.compiler() is not None:  # plan()'s C helper is built with the kernels
        assert "host planner: built (C)" in first and list(Path(cache_dir, "v1", "host").glob("host_plan-*.so"))


def test_prewarm_manifest_with_arch_override(cache, tiny_manifest):
    code, out, _ = run("prewarm", tiny_manifest, "--arch", "sm_90", "--jobs", 1, "--cache-dir", cache)
    assert code == 0
    assert f"{SPEC.name}  sm_90  hit (disk)" in out
    assert "0 compiled, 1 disk hits" in out


def test_prewarm_manifest_and_spec_names_are_merged(cache, tiny_manifest):
    code, out, _ = run("prewarm", tiny_manifest, "--arch", "sm_90", "--spec", SPEC.name, "--cache-dir", cache)
    assert code == 0
    assert "total: 1 kernels" in out  # the same spec twice is built once


def test_prewarm_needs_something():
    code, _, err = run("prewarm")
    assert code == 2
    assert "give a MANIFEST.toml and/or --spec" in err


def test_prewarm_bad_manifest_is_one_clear_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(TINY_MANIFEST.replace("num_kv_heads = 4", "num_kv_heads = 3"))
    code, out, err = run("prewarm", path, "--cache-dir", tmp_path / "c")
    assert code == 2 and out == ""
    assert err.strip() == (f"flashjit: error: {path}: model 'tiny', field 'num_kv_heads': "
                           "must divide num_qo_heads=4 (GQA group size), got 3")


@pytest.mark.parametrize("argv, message", [
    (["--spec", "decode_nonsense"], "DecodeSpec.name='decode_nonsense'"),
    (["--spec", SPEC.name, "--arch", "sm_99"], "'sm_99' is not a known arch"),
])
def test_prewarm_bad_spec_or_arch(tmp_path, argv, message):
    code, _, err = run("prewarm", *argv, "--cache-dir", tmp_path / "c")
    assert code == 2
    assert err.startswith("flashjit: error: ") and message in err


def test_prewarm_compile_error_shows_log_and_source(tmp_path, monkeypatch):
    def broken(source, arch, name, **kwargs):
        raise CompileError(name, "kernel.cu(1): error: expected a ';'", tmp_path / f"{name}.cu")

    monkeypatch.setattr("flashjit.jit.engine.compile_source", broken)
    code, out, err = run("prewarm", "--spec", SPEC.name, "--cache-dir", tmp_path / "c")
    assert code == 1 and out == ""
    first, *rest = err.splitlines()
    assert first == f"flashjit: error: NVRTC failed to compile {SPEC.name}; rendered source saved at {tmp_path / SPEC.name}.cu"
    assert "expected a ';'" in "\n".join(rest)


def test_spec_names_retargeted_by_arch(cache):
    code, out, _ = run("prewarm", "--spec", SPEC.replace(arch="sm_80").name, "--arch", "sm_90", "--cache-dir", cache)
    assert code == 0
    assert SPEC.name in out and "sm_80" not in out


# ---- list / show / clear ----------------------------------------------------------------------

def test_list_json(cache):
    code, out, _ = run("list", "--json", "--cache-dir", cache)
    assert code == 0
    (entry,) = json.loads(out)
    assert entry["name"] == SPEC.name and entry["arch"] == "sm_90"
    assert entry["cubin_bytes"] > 0 and entry["compile_seconds"] >= 0
    assert Path(entry["path"]).is_dir()


def test_list_table(cache):
    code, out, _ = run("list", "--cache-dir", cache)
    assert code == 0
    assert SPEC.name in out and "KiB" in out
    assert out.rstrip().endswith(f"1 entries in {cache}")


def test_list_empty(tmp_path):
    (tmp_path / "empty").mkdir()
    code, out, _ = run("list", "--json", "--cache-dir", tmp_path / "empty")
    assert code == 0 and json.loads(out) == []


def test_show_prints_the_rendered_source():
    name = "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc"
    code, out, _ = run("show", name)
    assert code == 0
    assert name in out and "mask: causal" in out
    assert out == __import__("flashjit.jit.render", fromlist=["render"]).render(DecodeSpec.from_name(name))


def test_show_bad_name():
    code, out, err = run("show", "not_a_spec")
    assert code == 2 and out == ""
    assert "names like decode_" in err


def test_clear(cache):
    code, out, _ = run("clear", "--cache-dir", cache)
    assert code == 0
    assert out.strip() == f"removed 1 entries from {cache}"
    assert KernelCache(cache).entries() == []
    assert run("clear", "--cache-dir", cache)[1].startswith("removed 0 entries")


def test_cache_dir_from_environment(cache, monkeypatch):
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(cache))
    code, out, _ = run("list", "--json")
    assert code == 0 and [e["name"] for e in json.loads(out)] == [SPEC.name]


# ---- doctor / run-example ---------------------------------------------------------------------

def test_doctor(tmp_path):
    code, out, _ = run("doctor", "--cache-dir", tmp_path / "c")
    assert code == 0, out
    lines = dict(line.split(None, 1) for line in out.splitlines() if line.split(None, 1)[0] != "test")
    assert lines["flashjit"] == __version__
    for key in ("python", "torch", "cupy", "jinja2", "nvrtc", "gpu", "torch-cuda", "cupy-packages", "nvrtc-wheels",
                "cuda-flavour"):
        assert key in lines
    assert lines["nvrtc"][0].isdigit()
    assert lines["cuda-flavour"].endswith("torch, CuPy and NVRTC agree")  # this machine: a CPU torch, one CuPy
    assert f"{tmp_path / 'c'} (writable)" in out
    assert re.search(r"^test compile +ok: decode_d64_bf16", out, re.MULTILINE)


def test_run_example_without_gpu_skips_the_gpu_step(cache, tiny_manifest, monkeypatch):
    monkeypatch.setattr(smoke_test, "gpu_available", lambda: False)
    code, out, _ = run("run-example", "--manifest", tiny_manifest, "--arch", "sm_90", "--cache-dir", cache)
    assert code == 0
    assert f"prewarming 1 kernels from {tiny_manifest}" in out
    assert "hit (disk)" in out
    assert out.rstrip().splitlines()[-1].startswith("no CUDA GPU: skipped the GPU decode step")


def test_run_example_default_manifest_is_the_llama_example():
    assert cli_kernels.default_manifest() == ROOT / "examples" / "llama-3-8b.toml"


@pytest.mark.gpu
@pytest.mark.skipif(not smoke_test.gpu_available(), reason="needs a CUDA GPU")
def test_run_example_gpu_step_passes(tmp_path):
    code, out, err = run("run-example", "--cache-dir", tmp_path / "c")
    assert code == 0, out + err
    assert out.rstrip().endswith("PASS")


# ---- plumbing ---------------------------------------------------------------------------------

def test_main_restores_the_flashjit_logger(cache):
    log = logging.getLogger("flashjit")
    before = log.level, log.propagate, list(log.handlers)
    run("-v", "prewarm", "--spec", SPEC.name, "--cache-dir", cache)
    assert (log.level, log.propagate, list(log.handlers)) == before


def test_python_dash_m_flashjit():
    result = subprocess.run([sys.executable, "-m", "flashjit", "--version"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0
    assert result.stdout.strip() == f"flashjit {__version__}"
