"""scripts/ptx_compare.py: two checkouts' kernels compiled to PTX and compared, spec by spec."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT

SCRIPT = ROOT / "scripts" / "ptx_compare.py"
SPEC = "merge_states_f32_sm80"  # one small kernel: the golden list's f32 merge for sm_80


def _checkout_copy(tmp_path: Path) -> Path:
    """What a tree needs to render the golden specs: the package, its templates, the spec list and
    the examples it reads."""
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("flashjit", "templates", "examples"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=ignore)
    (tree / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "golden_sources.py", tree / "tests")
    return tree


def _compare(baseline: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(baseline), "--match", SPEC, "--jobs", "1", *extra],
                          capture_output=True, text=True, timeout=600)


def test_a_checkout_that_changes_no_kernel_compares_equal(tmp_path):
    tree = _checkout_copy(tmp_path)
    (tree / "templates" / "merge_states" / "merge_states.cuh").write_text(
        (tree / "templates" / "merge_states" / "merge_states.cuh").read_text() + "\n// a comment moves no kernel\n")
    result = _compare(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 specs with the same PTX, 0 different, 0 on one side only" in result.stdout


def test_a_changed_kernel_is_named_with_its_opcodes(tmp_path):
    tree = _checkout_copy(tmp_path)
    header = tree / "templates" / "merge_states" / "merge_states.cuh"
    text = header.read_text()
    assert "__expf(" in text
    header.write_text(text.replace("__expf(", "exp2f(", 1))  # the baseline computes another exponential
    result = _compare(tree, "--keep", str(tmp_path / "kept"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{SPEC}: " in result.stdout and "0 specs with the same PTX, 1 different" in result.stdout
    assert (tmp_path / "kept" / f"{SPEC}.ptx").is_file() and (tmp_path / "kept" / f"{SPEC}.base.ptx").is_file()


def test_a_folder_that_is_no_checkout_is_refused(tmp_path):
    result = _compare(tmp_path)
    assert result.returncode != 0 and "is not a checkout of this repository" in result.stderr
