"""The operations commands: `prewarm --hf-config`, `cache export/import/info/prune`, and the
`flashjit prewarm` line that strict mode prints. NVRTC is faked (fake_nvrtc): these tests are about
the commands, not the cubins."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import pytest

from flashjit import DecodeSpec, Engine, KernelNotPrewarmed
from flashjit.jit.cache import SCHEMA, KernelCache
from flashjit.deploy.cli_cache import parse_size

from cli_runner import run
from repo_paths import EXAMPLES

MISTRAL = EXAMPLES / "hf" / "mistral-7b" / "config.json"


# ---- prewarm --hf-config ----------------------------------------------------------------------

def test_prewarm_hf_config(cache_dir, fake_nvrtc):
    code, out, err = run("prewarm", "--hf-config", MISTRAL, "--arch", "sm_90", "--page-size", "16,32",
                         "--cache-dir", cache_dir)
    assert code == 0, err
    assert "total: 6 kernels, 6 compiled" in out and "decode_d128_bf16_kvbf16_sliding_window_p32_g4_q1_nhd_sm90" in out
    assert "mistral-7b: 32 query / 8 KV heads (group 4), head_dim 128" in err and "window_left=4095" in err
    code, out, _ = run("prewarm", "--hf-config", MISTRAL.parent, "--arch", "sm_90", "--page-size", "16,32",
                       "--cache-dir", cache_dir)
    assert code == 0 and "6 disk hits" in out and len(fake_nvrtc) == 6


def test_prewarm_hf_config_options(cache_dir, fake_nvrtc):
    code, out, err = run("prewarm", "--hf-config", EXAMPLES / "hf" / "gemma-3-12b", "--arch", "sm_80",
                         "--dtype", "fp16", "--kv-dtype", "fp16", "--max-q-len", "1,2", "--cache-dir", cache_dir)
    assert code == 0, err
    assert "total: 6 kernels" in out and "decode_d256_f16_kvf16_sliding_window_p16_g2_q2_nhd_sm80" in out
    assert "head_dim 256, float16; sliding window 1024 on 40 of 48 layers" in err  # --dtype replaced bfloat16


@pytest.mark.parametrize("argv, message", [
    (("--hf-config", MISTRAL), "--arch"),                                       # no GPU here to detect an arch
    (("--hf-config", MISTRAL, "--arch", "sm_90", "--page-size", "16,x"), "comma-separated integers"),
    (("--spec", DecodeSpec(64, arch="sm_90").name, "--page-size", "32"), "apply to --hf-config only"),
    (("--hf-config", "/nonexistent/config.json", "--arch", "sm_90"), "cannot be read"),
])
def test_prewarm_hf_config_errors(cache_dir, argv, message):
    code, _, err = run("prewarm", *argv, "--cache-dir", cache_dir)
    assert code == 2 and message in err


def test_prewarm_hf_config_refuses_alibi(cache_dir, tmp_path):
    config = json.loads(MISTRAL.read_text()) | {"alibi": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run("prewarm", "--hf-config", tmp_path, "--arch", "sm_90", "--cache-dir", cache_dir)
    assert code == 2 and "field 'alibi'" in err and "ALiBi" in err


def test_prewarm_hf_config_with_a_variant(cache_dir, fake_nvrtc):
    code, out, err = run("prewarm", "--hf-config", EXAMPLES / "hf" / "gpt-oss-20b", "--arch", "sm_90",
                         "--cache-dir", cache_dir)
    assert code == 0, err
    assert "decode_d64_bf16_kvbf16_sliding_window-sinks_p16_g8_q1_nhd_sm90_tc" in out and "sinks=" in err


# ---- strict mode's prewarm line ---------------------------------------------------------------

def run_shell_line(line: str, monkeypatch) -> int:
    """Run a printed `[VAR=value ...] flashjit ARGS` line through cli.main, as a shell would."""
    words = shlex.split(line)
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    assert words[0] == "flashjit"
    return run(*words[1:])[0]


def test_printed_prewarm_line_works_verbatim(tmp_path, monkeypatch, fake_nvrtc):
    cache_dir = tmp_path / "kernel cache; with spaces"  # the line must quote it
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")  # a production shell: prewarm must still compile
    spec = DecodeSpec(128, mask="sliding_window", group_size=4, arch="sm_90")
    strict = Engine(cache_dir=cache_dir)
    with pytest.raises(KernelNotPrewarmed) as info:
        strict.get_kernel(spec)
    line = str(info.value).rsplit("build it with: ", 1)[1]
    assert line.startswith(f"flashjit prewarm --spec {spec.name} --cache-dir ")
    assert run_shell_line(line, monkeypatch) == 0 and fake_nvrtc == [spec.name]
    assert Engine(cache_dir=cache_dir).get_kernel(spec).spec == spec  # strict mode serves what the line built


def test_printed_prewarm_line_for_a_template_folder_mask(tmp_path, monkeypatch, fake_nvrtc, isolated_masks, mask_file):
    mask_file(tmp_path / "my masks", "skip_odd", "return (kv_pos & 1) == 0;")
    engine = Engine(cache_dir=tmp_path / "cache", template_dirs=[tmp_path / "my masks"], allow_compile=False)
    spec = DecodeSpec(64, mask="skip_odd", arch="sm_90")
    with pytest.raises(KernelNotPrewarmed) as info:
        engine.get_kernel(spec)
    line = str(info.value).rsplit("build it with: ", 1)[1]
    assert line.startswith("FLASHJIT_TEMPLATE_PATH=")
    isolated_masks._masks.pop("skip_odd")  # a fresh `flashjit` process would not know the mask yet
    assert run_shell_line(line, monkeypatch) == 0 and fake_nvrtc == [spec.name]
    assert engine.get_kernel(spec).spec == spec


# ---- cache export / import --------------------------------------------------------------------

@pytest.fixture
def prewarmed(tmp_path, fake_nvrtc) -> Path:
    """A cache holding Mistral's three kernels for sm_80 and sm_90 (fake cubins)."""
    cache_dir = tmp_path / "build"
    assert run("prewarm", "--hf-config", MISTRAL, "--arch", "sm_80,sm_90", "--cache-dir", cache_dir)[0] == 0
    return cache_dir


def test_export_import_then_strict_prewarm(prewarmed, tmp_path, monkeypatch, fake_nvrtc):
    bundle = tmp_path / "out" / "mistral.tar.gz"
    code, out, err = run("cache", "export", bundle, "--hf-config", MISTRAL, "--arch", "sm_90", "--cache-dir", prewarmed)
    assert code == 0, err
    assert "exported 3 entries and 3 index files" in out and "sm_80" not in out
    code, out, err = run("cache", "import", bundle, "--cache-dir", tmp_path / "host")
    assert code == 0, err
    assert "imported 3 entries (0 already present, 0 rejected) and 3 index files" in out
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")
    compiled = len(fake_nvrtc)
    code, out, _ = run("prewarm", "--hf-config", MISTRAL, "--arch", "sm_90", "--cache-dir", tmp_path / "host")
    assert code == 0 and "0 compiled, 3 disk hits" in out and len(fake_nvrtc) == compiled


def test_export_everything_or_by_arch(prewarmed, tmp_path):
    code, out, _ = run("cache", "export", tmp_path / "all.tar.gz", "--cache-dir", prewarmed)
    assert code == 0 and "exported 6 entries" in out
    code, out, _ = run("cache", "export", tmp_path / "a.tar.gz", "--arch", "sm_80", "--cache-dir", prewarmed)
    assert code == 0 and "exported 3 entries" in out and "sm_90" not in out.split("exported")[0]


def test_export_of_a_manifest_not_prewarmed(prewarmed, tmp_path):
    manifest = EXAMPLES / "llama-3-8b.toml"
    code, _, err = run("cache", "export", tmp_path / "b.tar.gz", "--manifest", manifest, "--arch", "sm_90",
                       "--cache-dir", prewarmed)
    assert code == 1 and "2 of 4 specs are not in the kernel cache" in err  # llama shares two with mistral
    assert f"flashjit prewarm {manifest} --arch sm_90 --cache-dir {prewarmed}" in err
    assert not (tmp_path / "b.tar.gz").exists()


def test_import_of_a_bad_bundle(tmp_path):
    (tmp_path / "b.tar.gz").write_text("nope")
    code, _, err = run("cache", "import", tmp_path / "b.tar.gz", "--cache-dir", tmp_path / "cache")
    assert code == 1 and "not a readable flashjit bundle" in err


# ---- cache info / prune / clear ---------------------------------------------------------------

def age(cache: KernelCache, name: str, seconds_ago: float):
    key = next(e["key"] for e in cache.entries() if e["name"] == name)
    stamp = time.time() - seconds_ago
    os.utime(cache.entry_dir(key), (stamp, stamp))


def test_info(prewarmed):
    old = prewarmed / "v0" / "entries" / ("0" * 64)
    old.mkdir(parents=True)
    (old / "kernel.cubin").write_bytes(b"x" * 2048)
    code, out, _ = run("cache", "info", "--cache-dir", prewarmed)
    assert code == 0
    assert f"schema v{SCHEMA}: 6 entries" in out and "0 incomplete, 6 index files (0 stale)" in out
    assert "sm_80  3" in out and "sm_90  3" in out
    assert "other version v0: 1 entries, 2.0 KiB" in out and "prune --old-versions" in out
    code, out, _ = run("cache", "info", "--json", "--cache-dir", prewarmed)
    info = json.loads(out)
    assert info["entries"] == 6 and info["by_arch"]["sm_80"]["entries"] == 3
    assert [v["version"] for v in info["other_versions"]] == [0] and info["total_bytes"] > info["bytes"]


def test_prune_least_recently_used_first(prewarmed):
    cache = KernelCache(prewarmed)
    entries = cache.entries()
    names = sorted(e["name"] for e in entries)
    for i, name in enumerate(names):  # names[0] is the least recently used
        age(cache, name, 1000 - i)
    size = max(e["path"] and sum(f.stat().st_size for f in Path(e["path"]).iterdir()) for e in entries)
    code, out, _ = run("cache", "prune", "--max-size", str(size * 4 + 10), "--dry-run", "--cache-dir", prewarmed)
    assert code == 0 and out.count("would remove decode_") == 2 and len(cache.entries()) == 6
    code, out, _ = run("cache", "prune", "--max-size", str(size * 4 + 10), "--cache-dir", prewarmed)
    assert code == 0 and "removed 2 entries" in out and "2 index files" in out
    assert sorted(e["name"] for e in cache.entries()) == names[2:]
    assert len(cache.index()) == 4


def test_prune_old_versions_and_clear(prewarmed):
    (prewarmed / "v0" / "entries").mkdir(parents=True)
    (prewarmed / f"v{SCHEMA + 1}" / "entries").mkdir(parents=True)  # a newer flashjit's: kept
    code, out, _ = run("cache", "prune", "--old-versions", "--cache-dir", prewarmed)
    assert code == 0 and "removed schema v0" in out and "1 old versions" in out
    assert not (prewarmed / "v0").exists() and (prewarmed / f"v{SCHEMA + 1}").exists()
    assert len(KernelCache(prewarmed).entries()) == 6
    code, out, _ = run("clear", "--cache-dir", prewarmed)
    assert code == 0 and "removed 6 entries" in out and KernelCache(prewarmed).entries() == []


@pytest.mark.parametrize("argv, message", [((), "nothing to prune"), (("--max-size", "lots"), "--max-size")])
def test_prune_argument_errors(cache_dir, argv, message):
    code, _, err = run("cache", "prune", *argv, "--cache-dir", cache_dir)
    assert code == 2 and message in err


@pytest.mark.parametrize("text, expected", [("2GB", 2 * 10**9), ("500MiB", 500 << 20), ("1.5G", 3 << 29),
                                            ("0", 0), ("123", 123), ("10 kb", 10_000), ("4TiB", 4 << 40)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected
