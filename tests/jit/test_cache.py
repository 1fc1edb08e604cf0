"""Disk cache: content-only keys, verified entries, corruption as a miss, degraded mode, locking."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import threading
import time

import pytest

from flashjit import DecodeSpec, Engine, __version__
from flashjit.jit import cache as cache_module
from flashjit import env as env_module
from flashjit.jit.cache import SCHEMA, KernelCache, default_cache_dir
from flashjit.jit.keys import cache_key
from flashjit.jit.compile import compile_options, nvrtc_version
from flashjit.masks.registry import register_mask
from flashjit.jit.render import render

from child_processes import collect_flashjit_log, run_children

KEY_ARGS = dict(source="extern \"C\" __global__ void k() {}", arch="sm_90", options=("-arch=sm_90", "--std=c++17"),
                nvrtc_version=(12, 9), flashjit_version="0.1.0")


def key_of(**changes) -> str:
    args = dict(KEY_ARGS, **changes)
    return cache_key(args["source"], args["arch"], args["options"], args["nvrtc_version"], args["flashjit_version"])


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashjit" and r.levelno == logging.WARNING]


# ---- keys ---------------------------------------------------------------------------------------

def test_key_is_a_sha256_hex_digest():
    key = key_of()
    assert len(key) == 64 and int(key, 16) >= 0
    assert key_of() == key


@pytest.mark.parametrize("change", [
    {"source": KEY_ARGS["source"] + " "},
    {"arch": "sm_80"},
    {"options": ("-arch=sm_90", "--std=c++20")},
    {"options": ("-arch=sm_90",)},
    {"nvrtc_version": (12, 8)},
    {"nvrtc_version": (13, 0)},
    {"flashjit_version": "0.1.1"},
], ids=lambda c: next(iter(c)))
def test_key_changes_with_every_input(change):
    assert key_of(**change) != key_of()


def test_key_does_not_depend_on_the_cache_dir(warm, tmp_path):
    source = render(warm.spec)
    expected = cache_key(source, warm.spec.arch, compile_options(warm.spec.arch), nvrtc_version(), __version__)
    assert warm.kernel.key == expected
    # The entry, moved to another folder (as on another host), is served without compiling.
    other = Engine(cache_dir=tmp_path / "elsewhere", allow_compile=False)
    warm.copy_entry_to(tmp_path / "elsewhere", with_index=False)  # found by its content key alone
    kernel = other.get_kernel(warm.spec)
    assert kernel.key == warm.kernel.key and kernel.cubin == warm.kernel.cubin


def test_user_mask_key_does_not_depend_on_its_path(isolated_masks, tmp_path):
    text = '{% extends "masks/base.cuh.j2" %}\n{% block visible %}  return kv_pos != 3;{% endblock %}\n'
    sources = []
    for folder in ("host_a/deep/masks", "host_b"):
        path = tmp_path / folder / "skip3.cuh.j2"
        path.parent.mkdir(parents=True)
        path.write_text(text)
        register_mask("skip3", path, replace=True)
        sources.append(render(DecodeSpec(64, mask="skip3", arch="sm_90")))
    assert sources[0] == sources[1]
    assert str(tmp_path) not in sources[0]


def test_entry_holds_no_absolute_paths(warm):
    for name in ("meta.json", "source.cu"):
        text = (warm.entry / name).read_text()
        assert str(warm.cache_dir) not in text and "/tmp" not in text
    meta = json.loads((warm.entry / "meta.json").read_text())
    assert meta["name"] == warm.spec.name and meta["key"] == warm.kernel.key and meta["schema"] == SCHEMA


def test_layout(warm):
    assert warm.entry == warm.cache_dir / f"v{SCHEMA}" / "entries" / warm.kernel.key
    (index,) = (warm.cache_dir / f"v{SCHEMA}" / "index").iterdir()
    assert index.read_text() == warm.kernel.key and warm.engine.cache.lookup_index(index.name) == warm.kernel.key
    assert sorted(p.name for p in warm.entry.iterdir()) == ["kernel.cubin", "meta.json", "source.cu"]
    assert (warm.entry / "source.cu").read_text() == render(warm.spec)
    assert (warm.entry / "kernel.cubin").read_bytes() == warm.kernel.cubin


# ---- store and load -----------------------------------------------------------------------------

def stored(cache_dir, key="e" * 64, cubin=b"\x7fELF fake cubin bytes", source="// source\n"):
    cache = KernelCache(cache_dir)
    assert cache.store(key, cubin, source, {"name": "fake", "arch": "sm_90"})
    return cache, key


def test_store_then_load_round_trip(cache_dir):
    cache, key = stored(cache_dir)
    cubin, meta = cache.load(key)
    assert cubin == b"\x7fELF fake cubin bytes"
    assert meta["name"] == "fake" and meta["key"] == key and meta["schema"] == SCHEMA
    assert meta["cubin_sha256"] == hashlib.sha256(cubin).hexdigest() and meta["cubin_bytes"] == len(cubin)
    assert (cache.entry_dir(key) / "source.cu").read_text() == "// source\n"
    assert not list(cache.entry_dir(key).glob(".*.tmp"))  # temp files were renamed into place
    assert KernelCache(cache_dir).load(key) == (cubin, meta)  # another instance reads it back


def test_load_missing_key(cache_dir):
    assert KernelCache(cache_dir).load("0" * 64) is None


def truncate_cubin(entry):
    data = (entry / "kernel.cubin").read_bytes()
    (entry / "kernel.cubin").write_bytes(data[: len(data) // 2])


def flip_bit(entry):
    data = bytearray((entry / "kernel.cubin").read_bytes())
    data[len(data) // 3] ^= 0x10
    (entry / "kernel.cubin").write_bytes(bytes(data))


def garble_meta(entry):
    (entry / "meta.json").write_text('{"key": "trunc')


def meta_not_a_dict(entry):
    (entry / "meta.json").write_text("[1, 2, 3]")


def meta_of_another_key(entry):
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps(dict(meta, key="f" * 64)))


def delete_meta(entry):
    (entry / "meta.json").unlink()


def half_written(entry):
    # A writer died after the cubin and before meta.json: its temp file is left behind.
    (entry / "meta.json").rename(entry / ".meta.json.abc123.tmp")


def delete_cubin(entry):
    (entry / "kernel.cubin").unlink()


CORRUPTIONS = [truncate_cubin, flip_bit, garble_meta, meta_not_a_dict, meta_of_another_key, delete_meta,
               half_written, delete_cubin]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_damaged_entry_is_a_miss(cache_dir, corrupt):
    cache, key = stored(cache_dir)
    corrupt(cache.entry_dir(key))
    assert cache.load(key) is None
    assert cache.entries() == []


@pytest.mark.parametrize("corrupt", [truncate_cubin, flip_bit, garble_meta, delete_meta, half_written],
                         ids=lambda f: f.__name__)
def test_engine_rebuilds_damaged_entry(warm, cache_dir, compile_log, corrupt):
    entry = warm.copy_entry_to(cache_dir)
    corrupt(entry)
    kernel = Engine(cache_dir=cache_dir).get_kernel(warm.spec)
    assert len(compile_log()) == 1
    assert kernel.cubin == warm.kernel.cubin  # NVRTC is deterministic: same as the fresh compile
    assert KernelCache(cache_dir).load(warm.kernel.key)[0] == warm.kernel.cubin  # repaired on disk
    assert Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(warm.spec).cubin == warm.kernel.cubin


@pytest.mark.parametrize("content", ["", "abc", "z" * 65, "\x00" * 10])
def test_bad_index_file_is_a_miss(cache_dir, content):
    cache = KernelCache(cache_dir)
    cache.store_index("5" * 64, "e" * 64)
    assert cache.lookup_index("5" * 64) == "e" * 64
    (cache.base / "index" / ("5" * 64)).write_text(content)
    assert cache.lookup_index("5" * 64) is None
    assert cache.lookup_index("missing") is None


def test_engine_repairs_index_to_a_missing_entry(warm, cache_dir, compile_log):
    entry = warm.copy_entry_to(cache_dir)
    shutil.rmtree(entry)  # the index still names it
    assert Engine(cache_dir=cache_dir).get_kernel(warm.spec).cubin == warm.kernel.cubin
    assert len(compile_log()) == 1
    assert KernelCache(cache_dir).load(warm.kernel.key) is not None


# ---- unusable cache dir -------------------------------------------------------------------------

def test_unusable_cache_dir_degrades_to_memory_with_one_warning(tmp_path, caplog, compile_log):
    (tmp_path / "file").write_text("not a folder")
    root = tmp_path / "file" / "cache"  # cannot be created, even by root
    engine = Engine(cache_dir=root)
    assert engine.cache.writable is False
    spec = DecodeSpec(64, mask="causal", arch="sm_90")
    kernel = engine.get_kernel(spec)
    assert kernel.cubin[:4] == b"\x7fELF"
    assert engine.get_kernel(spec) is kernel
    assert engine.cache.store("a" * 64, b"cubin", "src", {}) is False
    assert engine.cache.load(kernel.key) is None
    engine.cache.store_index("5" * 64, kernel.key)
    assert engine.cache.lookup_index("5" * 64) is None
    with engine.cache.compile_lock(kernel.key):
        pass
    assert len(compile_log()) == 1
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert str(root) in warnings[0] and "memory" in warnings[0] and "FLASHJIT_CACHE_DIR" in warnings[0]


def test_cache_root_that_is_a_file(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="flashjit")
    (tmp_path / "file").write_text("x")
    cache = KernelCache(tmp_path / "file")
    assert cache.writable is False
    assert cache.entries() == [] and cache.load("0" * 64) is None
    assert len(warnings_of(caplog)) == 1 and "not a folder" in warnings_of(caplog)[0]
    assert (tmp_path / "file").read_text() == "x"


def test_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(tmp_path / "from_env"))
    assert default_cache_dir() == tmp_path / "from_env"
    assert Engine().cache.root == tmp_path / "from_env"
    assert (tmp_path / "from_env" / f"v{SCHEMA}" / "entries").is_dir()


def test_argument_beats_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(tmp_path / "from_env"))
    assert Engine(cache_dir=tmp_path / "arg").cache.root == tmp_path / "arg"


# ---- locking ------------------------------------------------------------------------------------

def test_compile_lock_serialises_threads(cache_dir):
    """Two caches (as two engines would) on one folder: the second waits for the first."""
    first, second = KernelCache(cache_dir), KernelCache(cache_dir)
    held, events = threading.Event(), []

    def holder():
        with first.compile_lock("k"):
            held.set()
            time.sleep(0.3)
            events.append("first released")

    def waiter():
        held.wait(5)
        with second.compile_lock("k"):
            events.append("second acquired")

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert events == ["first released", "second acquired"]


def test_other_keys_do_not_wait(cache_dir):
    first, second = KernelCache(cache_dir), KernelCache(cache_dir)
    with first.compile_lock("k1"):
        done = threading.Event()
        thread = threading.Thread(target=lambda: (second.compile_lock("k2").__enter__(), done.set()))
        thread.start()
        assert done.wait(5)
        thread.join()


def test_stale_lock_is_waited_out_then_ignored(cache_dir, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="flashjit")
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 0.2)
    first, second = KernelCache(cache_dir), KernelCache(cache_dir)
    entered = []
    with first.compile_lock("k"):
        thread = threading.Thread(target=lambda: second.compile_lock("k").__enter__() or entered.append(1))
        start = time.monotonic()
        thread.start()
        thread.join(5)
        assert entered == [1] and time.monotonic() - start >= 0.15
    assert any("held for over" in w for w in warnings_of(caplog))


def _get_kernel_in_child(cache_dir, spec_name, barrier, results):
    """Runs in a spawned process: reports (origin, number of 'compiling' log lines)."""
    messages = collect_flashjit_log()
    engine = Engine(cache_dir=cache_dir)
    spec = DecodeSpec.from_name(spec_name)
    nvrtc_version()  # load NVRTC before the race, so both processes reach the cache together
    barrier.wait(60)
    (result,) = engine.prewarm([spec], jobs=1)
    results.put((result.source, sum("compiling" in m for m in messages)))


def test_compile_lock_serialises_processes(cache_dir):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    spec = DecodeSpec(64, mask="sliding_window", arch="sm_80")
    children = [context.Process(target=_get_kernel_in_child, args=(str(cache_dir), spec.name, barrier, results))
                for _ in range(2)]
    reports = run_children(children, results)
    assert [child.exitcode for child in children] == [0, 0]
    assert sorted(origin for origin, _ in reports) == ["compiled", "disk"]
    assert sum(count for _, count in reports) == 1
    assert [e["name"] for e in KernelCache(cache_dir).entries()] == [spec.name]


# ---- entries and clear --------------------------------------------------------------------------

def test_entries_and_clear(warm, cache_dir):
    warm.copy_entry_to(cache_dir)
    cache = KernelCache(cache_dir)
    broken = cache.entry_dir("b" * 64)
    shutil.copytree(warm.entry, broken)  # meta.json names another key: not a verified entry
    entries = cache.entries()
    assert len(entries) == 1
    assert entries[0]["name"] == warm.spec.name and entries[0]["key"] == warm.kernel.key
    assert entries[0]["path"] == str(cache.entry_dir(warm.kernel.key))
    assert entries[0]["spec"] == warm.spec.to_dict()
    assert cache.clear() == 2
    assert cache.entries() == [] and not broken.exists()
    assert cache.writable and (cache.base / "entries").is_dir()
    assert cache.store("c" * 64, b"x", "s", {}) and len(cache.entries()) == 1


def test_entries_of_empty_cache(cache_dir):
    cache = KernelCache(cache_dir)
    assert cache.entries() == [] and cache.clear() == 0


# ---- lock timeout, last use, usage and prune ----------------------------------------------------

@pytest.mark.parametrize("env, expected", [(None, 120.0), ("2.5", 2.5), ("0", 0.0), ("soon", 120.0), ("-1", 120.0)])
def test_lock_timeout_is_read_at_lock_time(monkeypatch, caplog, env, expected):
    caplog.set_level(logging.WARNING, logger="flashjit")
    if env is None:
        monkeypatch.delenv("FLASHJIT_LOCK_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("FLASHJIT_LOCK_TIMEOUT", env)
    monkeypatch.setattr(env_module, "_warned", set())
    assert cache_module.lock_timeout() == expected and cache_module.lock_timeout() == expected
    assert len(warnings_of(caplog)) == (env in ("soon", "-1"))  # once per bad value
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 0.5)  # the module setting wins (tests)
    assert cache_module.lock_timeout() == 0.5


def test_disk_load_records_last_use_and_memory_hits_touch_nothing(warm, cache_dir, monkeypatch):
    entry = warm.copy_entry_to(cache_dir)
    os.utime(entry, (1000, 1000))
    engine = Engine(cache_dir=cache_dir)
    engine.get_kernel(warm.spec)
    assert entry.stat().st_mtime > time.time() - 60  # a disk load is a use
    os.utime(entry, (1000, 1000))
    monkeypatch.setattr(os, "utime", lambda *a, **k: pytest.fail("a memory hit must not touch the disk"))
    engine.get_kernel(warm.spec)
    assert entry.stat().st_mtime == 1000


def test_touch_never_fails(cache_dir):
    KernelCache(cache_dir).touch("0" * 64)  # no such entry


def test_usage_and_prune(warm, cache_dir):
    cache = KernelCache(cache_dir)
    for i, key in enumerate(("1" * 64, "2" * 64, "3" * 64)):
        cache.store(key, bytes(1000), "src", {"name": f"k{i}", "arch": "sm_80" if i else "sm_90"})
        cache.store_index(str(i) * 64, key)
        os.utime(cache.entry_dir(key), (1000 + i, 1000 + i))  # "1"*64 is the least recently used
    partial = cache.entry_dir("4" * 64)  # a writer died before meta.json, long ago
    partial.mkdir()
    (partial / "kernel.cubin").write_bytes(bytes(500))
    os.utime(partial, (1000, 1000))
    fresh = cache.entry_dir("5" * 64)  # ... or is writing it right now: kept
    fresh.mkdir()
    cache.store_index("9" * 64, "8" * 64)  # names an entry that is gone

    usage = cache.usage()
    assert usage["entries"] == 3 and usage["incomplete"] == 2
    assert usage["by_arch"]["sm_80"]["entries"] == 2 and usage["by_arch"]["sm_90"]["entries"] == 1
    assert usage["index_files"] == 4 and usage["index_stale"] == 1
    assert usage["bytes"] >= 3500 and usage["other_versions"] == []

    report = cache.prune(max_bytes=2 * (usage["entry_bytes"] // 3) + 1)
    assert [e["key"] for e in report["removed"]] == ["1" * 64] and report["incomplete"] == 1
    assert report["index_removed"] == 2 and report["kept"] == 2
    assert sorted(e["key"] for e in cache.entries()) == ["2" * 64, "3" * 64]
    assert not partial.exists() and fresh.exists()
    assert sorted(cache.index()) == ["1" * 64, "2" * 64]
    assert not list((cache.base / "entries").glob(".trash-*"))
    assert cache.prune(max_bytes=0)["removed"] and cache.entries() == [] and cache.index() == {}
