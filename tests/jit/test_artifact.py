"""artifact.obtain: try-load, then lock, load again, build, store, load; and both users of it."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time

import pytest

from flashjit.jit import cache as cache_module
from flashjit.jit import host_library
from flashjit.serving.host_plan import load_host_plan
from flashjit.worklist.record import HOST_PLAN_DEFINES, HOST_PLAN_SOURCE
from flashjit.jit.artifact import obtain
from flashjit.jit.cache import KernelCache


class Recorded:
    """An artifact that records its steps; `stored` plays the disk, `loads` scripts what loads find."""

    def __init__(self, loads=(), fail_build=None, lock=None):
        self.steps: list[str] = []
        self.loads = list(loads)
        self.fail_build = fail_build
        self.stored = None
        self._lock = lock or contextlib.nullcontext

    def load(self):
        self.steps.append("load")
        return self.loads.pop(0) if self.loads else self.stored

    @contextlib.contextmanager
    def lock(self):
        self.steps.append("lock")
        try:
            with self._lock():
                yield
        finally:
            self.steps.append("unlock")

    def build(self):
        self.steps.append("build")
        if self.fail_build:
            raise self.fail_build
        return "built bytes"

    def store(self, built):
        self.steps.append("store")
        self.stored = f"loaded {built}"

    def load_built(self, built):
        self.steps.append("load_built")
        return f"loaded {built}"


def test_a_stored_artifact_is_loaded_without_locking():
    artifact = Recorded(loads=["on disk"])
    assert obtain(artifact) == ("on disk", False)
    assert artifact.steps == ["load"]


def test_a_miss_builds_under_the_lock_then_stores_then_loads():
    artifact = Recorded()
    assert obtain(artifact) == ("loaded built bytes", True)
    assert artifact.steps == ["load", "lock", "load", "build", "store", "unlock", "load_built"]
    assert obtain(artifact) == ("loaded built bytes", False)  # the next call loads what was stored


def test_what_another_process_built_while_waiting_is_loaded_not_rebuilt():
    artifact = Recorded(loads=[None, "built elsewhere"])
    assert obtain(artifact) == ("built elsewhere", False)
    assert artifact.steps == ["load", "lock", "load", "unlock"]


def test_a_failed_build_releases_the_lock_and_stores_nothing():
    artifact = Recorded(fail_build=RuntimeError("compiler says no"))
    with pytest.raises(RuntimeError, match="compiler says no"):
        obtain(artifact)
    assert artifact.steps == ["load", "lock", "load", "build", "unlock"] and artifact.stored is None


def test_threads_on_one_cache_lock_build_once(tmp_path):
    """Two artifacts (as two processes would hold) on one key of one cache folder: one build."""
    caches = [KernelCache(tmp_path), KernelCache(tmp_path)]
    disk = {}
    builds = []

    class OnDisk(Recorded):
        def __init__(self, cache):
            super().__init__(lock=lambda: cache.compile_lock("k" * 64))

        def load(self):
            return disk.get("k")

        def build(self):
            builds.append(1)
            time.sleep(0.2)  # long enough for the other thread to wait on the lock
            return "cubin"

        def store(self, built):
            disk["k"] = f"loaded {built}"

    barrier, results = threading.Barrier(2), []

    def one(cache):
        barrier.wait(5)
        results.append(obtain(OnDisk(cache)))

    threads = [threading.Thread(target=one, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert builds == [1]
    assert sorted(results) == [("loaded cubin", False), ("loaded cubin", True)]


def _hold_lock(cache_dir, key, ready):
    """Forked: take a compile lock and hang, as a process stuck in a hung compiler would."""
    with KernelCache(cache_dir).compile_lock(key):
        ready.set()
        time.sleep(600)


@pytest.mark.skipif(host_library.compiler() is None, reason="no C compiler on this machine")
def test_the_host_library_waits_briefly_for_a_held_lock_then_uses_numpy(tmp_path, monkeypatch, caplog):
    """The host library takes the cache's compile lock, but a holder stuck for longer than
    HOST_LOCK_WAIT_S (a hung compiler) costs other processes that long, not the lock timeout: they
    keep the numpy planner, with one warning naming the lock."""
    caplog.set_level(logging.WARNING, logger="flashjit")
    monkeypatch.setattr(host_library, "_loaded", {})
    monkeypatch.delenv("FLASHJIT_HOST_NATIVE", raising=False)
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 30.0)
    monkeypatch.setattr(host_library, "HOST_LOCK_WAIT_S", 0.5)
    cache = KernelCache(tmp_path)
    source = HOST_PLAN_SOURCE.read_bytes()
    stem = f"host_plan-{host_library.library_key(source, host_library.compiler(), HOST_PLAN_DEFINES)}"
    ready = multiprocessing.get_context("fork").Event()
    holder = multiprocessing.get_context("fork").Process(target=_hold_lock, args=(str(tmp_path), stem, ready),
                                                         daemon=True)
    holder.start()
    try:
        assert ready.wait(30)
        start = time.monotonic()
        library = load_host_plan(cache)
        waited = time.monotonic() - start
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
    assert library is None and 0.4 <= waited < 5.0
    warnings = [w.getMessage() for w in caplog.records if w.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{stem}.lock" in warnings[0] and "numpy" in warnings[0], warnings
    assert not (cache.base / "host" / f"{stem}.so").exists()
