"""The cache mends what goes wrong under it: a cache folder that comes back after a `clear` or a
move, a meta.json that became a folder, leftovers of killed writers and pruners, and a compile lock
that cannot be taken (the kernel is still saved, and the warning says so)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from flashjit import DecodeSpec, Engine, KernelNotPrewarmed
from flashjit.jit import cache_root
from flashjit.jit.cache import SCHEMA, KernelCache
from flashjit.jit.engine import _entry_key

HOUR = 3600.0


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashjit" and r.levelno == logging.WARNING]


def test_an_engine_made_while_its_cache_was_away_uses_it_once_it_is_back(warm, tmp_path, monkeypatch):
    """A strict server started while `clear` (or a remount) had the cache's v1/ away serves the
    cache once it is back, without a restart."""
    monkeypatch.setattr(cache_root, "RETRY_S", 0.0)
    root = tmp_path / "cache"
    warm.copy_entry_to(root)
    away = tmp_path / "away"
    os.rename(root / f"v{SCHEMA}", away)
    (root / f"v{SCHEMA}").write_text("in the way: no folder can be made here")
    engine = Engine(cache_dir=root, allow_compile=False)
    with pytest.raises(KernelNotPrewarmed):
        engine.get_kernel(warm.spec)
    (root / f"v{SCHEMA}").unlink()
    os.rename(away, root / f"v{SCHEMA}")
    assert engine.get_kernel(warm.spec).cubin == warm.kernel.cubin


def test_a_meta_json_that_became_a_folder_is_repaired(warm, cache_dir, fake_nvrtc):
    entry = warm.copy_entry_to(cache_dir)
    (entry / "meta.json").unlink()
    (entry / "meta.json").mkdir()
    (entry / "meta.json" / "junk").write_text("x")
    Engine(cache_dir=cache_dir).get_kernel(warm.spec)  # a miss: compiled (fake NVRTC) and stored
    assert fake_nvrtc == [warm.spec.name]
    assert (entry / "meta.json").is_file()
    Engine(cache_dir=cache_dir).get_kernel(warm.spec)  # a later process finds it on disk
    assert fake_nvrtc == [warm.spec.name]


def test_a_lock_that_cannot_be_taken_still_saves_the_kernel_and_says_so(cache_dir, tmp_path, fake_nvrtc, caplog):
    caplog.set_level(logging.WARNING, logger="flashjit")
    spec = DecodeSpec(64, arch="sm_90")
    engine = Engine(cache_dir=cache_dir)
    key = _entry_key(spec, engine.source(spec))
    victim = tmp_path / "victim.txt"
    victim.write_text("never written")
    (engine.cache.base / "locks" / f"{key}.lock").symlink_to(victim)  # a lock file is never opened through a link
    engine.get_kernel(spec)
    assert KernelCache(cache_dir).load(key) is not None  # saved
    (warning,) = warnings_of(caplog)
    assert "lock" in warning and "memory only" not in warning, warning
    assert victim.read_text() == "never written"


def test_prune_removes_old_leftovers_of_killed_pruners_and_probes(cache_dir):
    cache = KernelCache(cache_dir)
    entries = cache.base / "entries"
    old_trash, new_trash = entries / f".trash-{'1' * 64}-77-88", entries / f".trash-{'2' * 64}-77-89"
    for trash in (old_trash, new_trash):
        trash.mkdir()
        (trash / "kernel.cubin").write_bytes(bytes(1000))
    old_probe, new_probe = entries / ".probe-77-88", entries / ".probe-77-89"
    for probe in (old_probe, new_probe):
        probe.write_bytes(b"")
    long_ago = time.time() - 2 * HOUR
    for path in (old_trash, old_probe):
        os.utime(path, (long_ago, long_ago))
    report = cache.prune()
    assert not old_trash.exists() and not old_probe.exists()
    assert new_trash.exists() and new_probe.exists()  # a pruner or probe at work right now
    assert report["freed_bytes"] >= 1000
