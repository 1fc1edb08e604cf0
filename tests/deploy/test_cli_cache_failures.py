"""Operator commands that cannot do what they were asked say so and exit non-zero: prune and clear
on a read-only cache, clear through a linked v1/, prune --old-versions on a folder that is not a
cache, prewarm into a full disk, and export of a cache holding entries it cannot ship.

Read-only caches are real ones: the command runs in a forked child that drops to another user
(root ignores permission bits), so these tests run, unskipped, where the suite runs as root.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import traceback
from pathlib import Path

import pytest
import tqdm  # noqa: F401  (imported before forking: the child may not be able to read the interpreter's files)

from flashjit import DecodeSpec
from flashjit.deploy import bundle, cli_cache, manifest  # noqa: F401  (as above)
from flashjit.jit import cache as cache_module
from flashjit.jit import trusted_writes
from flashjit.jit.cache import SCHEMA, KernelCache

from child_processes import run_children
from cli_runner import run
from test_cli_cache import MISTRAL

FORK = multiprocessing.get_context("fork")
NOBODY = 65534


def _run_as_nobody(argv, results):
    try:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        results.put(run(*argv))
    except BaseException:
        results.put((None, "", traceback.format_exc()))


def run_as_another_user(*argv) -> tuple[int | None, str, str]:
    """cli.main(argv) in a forked child that cannot write files it does not own; (code, out, err)."""
    results = FORK.Queue()
    child = FORK.Process(target=_run_as_nobody, args=([str(a) for a in argv], results))
    [result] = run_children([child], results, timeout=120)
    return result


@pytest.fixture
def read_only_cache(shared_tmp, fake_nvrtc) -> Path:
    """Mistral's three sm_90 kernels in a cache another user may read but not change."""
    cache_dir = shared_tmp / "cache"
    code, _, err = run("prewarm", "--hf-config", MISTRAL, "--arch", "sm_90", "--cache-dir", cache_dir)
    assert code == 0, err
    for folder, _, files in os.walk(cache_dir):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    return cache_dir


def test_prune_on_a_read_only_cache(read_only_cache):
    code, out, err = run_as_another_user("cache", "prune", "--max-size", "1", "--cache-dir", read_only_cache)
    assert code == 1, (out, err)
    assert "read-only" in err and "nothing was removed" in err and "removed 3 entries" not in out
    assert len(KernelCache(read_only_cache).entries()) == 3
    code, out, err = run_as_another_user("cache", "prune", "--max-size", "1", "--dry-run",
                                         "--cache-dir", read_only_cache)
    assert code == 0 and "would remove 3 entries" in out, (out, err)


def test_clear_on_a_read_only_cache(read_only_cache):
    code, out, err = run_as_another_user("clear", "--cache-dir", read_only_cache)
    assert code == 1, (out, err)
    assert "read-only" in err and "Traceback" not in err and "removed" not in out
    assert len(KernelCache(read_only_cache).entries()) == 3


def test_clear_through_a_linked_v1(tmp_path, fake_nvrtc):
    """v1/ moved to another disk and linked back: clear empties it and keeps the link."""
    root, disk = tmp_path / "cache", tmp_path / "big-disk"
    assert run("prewarm", "--hf-config", MISTRAL, "--arch", "sm_90", "--cache-dir", root)[0] == 0
    disk.mkdir()
    shutil.move(root / f"v{SCHEMA}", disk / "flashjit-kernels")
    (root / f"v{SCHEMA}").symlink_to(disk / "flashjit-kernels")
    assert len(KernelCache(root).entries()) == 3
    (disk / "flashjit-kernels" / "notes.txt").write_text("not the cache's")
    code, out, err = run("clear", "--cache-dir", root)
    assert code == 0, err
    assert "removed 3 entries" in out and KernelCache(root).entries() == []
    assert (root / f"v{SCHEMA}").is_symlink() and (disk / "flashjit-kernels" / "notes.txt").exists()


@pytest.mark.parametrize("layout", ["data files", "entries and data files", "a link"])
def test_prune_old_versions_keeps_folders_that_are_not_a_cache(tmp_path, layout):
    data = tmp_path / "data"
    old = data / "v0"
    if layout == "a link":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "entries").mkdir()
        data.mkdir()
        old.symlink_to(tmp_path / "elsewhere")
    else:
        old.mkdir(parents=True)
        (old / "results.csv").write_text("1,2,3\n")
        if layout == "entries and data files":
            (old / "entries").mkdir()
    code, out, err = run("cache", "prune", "--old-versions", "--cache-dir", data)
    assert code == 0, err
    assert old.exists() and "0 old versions" in out and "not a flashjit cache" in out
    assert (tmp_path / "elsewhere" / "entries").exists() if layout == "a link" else (old / "results.csv").exists()
    code, out, _ = run("cache", "info", "--cache-dir", data)
    assert "not a flashjit cache" in out and "prune --old-versions` removes it" not in out


def test_prewarm_into_a_full_disk_says_not_saved(tmp_path, monkeypatch, fake_nvrtc):
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(trusted_writes, "write_file", full)
    spec = DecodeSpec(64, mask="causal", arch="sm_90")
    code, out, err = run("prewarm", "--spec", spec.name, "--cache-dir", tmp_path / "cache")
    assert code == 1, (out, err)
    assert "compiled, not saved" in out and "1 kernels compiled but not saved" in err
    assert KernelCache(tmp_path / "cache").entries() == []


def test_export_reports_entries_it_cannot_ship(tmp_path, monkeypatch, fake_nvrtc):
    """A full disk during prewarm left two entries without meta.json: export names what it skipped."""
    real_write = trusted_writes.write_file
    specs = [DecodeSpec(64, mask=mask, arch="sm_90") for mask in ("none", "causal", "sliding_window")]
    cache_dir = tmp_path / "cache"
    assert run("prewarm", "--spec", specs[0].name, "--cache-dir", cache_dir)[0] == 0

    def meta_fails(path, data):
        if path.name == "meta.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, data)

    monkeypatch.setattr(trusted_writes, "write_file", meta_fails)
    assert run("prewarm", "--spec", specs[1].name, "--spec", specs[2].name, "--cache-dir", cache_dir)[0] == 1
    monkeypatch.setattr(trusted_writes, "write_file", real_write)
    code, out, err = run("cache", "export", tmp_path / "b.tar.gz", "--cache-dir", cache_dir)
    assert code == 1, (out, err)
    assert "exported 1 entries" in out and "skipped 2 entries" in err and "incomplete" in err
    assert (tmp_path / "b.tar.gz").exists()
