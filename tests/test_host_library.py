"""host_library: the C helper is built once into the cache, reused, rebuilt when damaged, and
missed gracefully (None, one warning) without a compiler or when switched off."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from flashjit.jit import host_library
from flashjit.serving.host_plan import load_host_plan
from flashjit.worklist.record import HOST_PLAN_DEFINES, HOST_PLAN_SOURCE
from flashjit.jit.cache import KernelCache

pytestmark = pytest.mark.skipif(host_library.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test loads as a new process would: nothing kept from earlier loads."""
    monkeypatch.setattr(host_library, "_loaded", {})
    monkeypatch.delenv("FLASHJIT_HOST_NATIVE", raising=False)


def built(cache: KernelCache) -> list:
    return sorted(p.name for p in (cache.base / "host").glob("*.so"))


def test_builds_into_the_cache_then_loads_from_it_without_building(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path)
    assert load_host_plan(cache) is not None
    assert len(built(cache)) == 1 and built(cache)[0].startswith("host_plan-")

    monkeypatch.setattr(host_library, "_loaded", {})
    monkeypatch.setattr(host_library, "_build", lambda *a: pytest.fail("built again"))
    library = load_host_plan(cache)
    assert library is not None and library.fj_plan is not None
    assert load_host_plan(cache) is library  # kept for the process


def test_a_damaged_library_is_rebuilt(tmp_path, caplog):
    cache = KernelCache(tmp_path)
    source = HOST_PLAN_SOURCE.read_bytes()
    target = cache.base / "host" / f"host_plan-{host_library.library_key(source, host_library.compiler(), HOST_PLAN_DEFINES)}.so"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\x7fELF half a library")  # what a crashed disk or a foreign writer leaves
    assert load_host_plan(cache) is not None
    assert "does not load" in caplog.text and target.stat().st_size > 1000


def test_the_key_follows_the_source_and_the_compiler():
    key = host_library.library_key
    assert key(b"int a;", ["/usr/bin/cc"]) != key(b"int b;", ["/usr/bin/cc"])
    assert key(b"int a;", ["/usr/bin/cc"]) != key(b"int a;", ["/usr/bin/clang"])
    assert key(b"int a;", ["/usr/bin/cc"]) != key(b"int a;", ["/usr/bin/cc", "-m64"])
    assert key(b"int a;", ["/usr/bin/cc"]) == key(b"int a;", ["/opt/bin/cc"])


def test_cc_may_carry_a_wrapper_and_flags(tmp_path, monkeypatch):
    """CC as build tools take it ("ccache gcc -m64"): the first word is the program, the rest passed on."""
    wrapper = tmp_path / "wrap-cc"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\nexec \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", f"{wrapper} {host_library.compiler()[0]} -DFJ_FROM_CC")
    assert load_host_plan(KernelCache(tmp_path / "cache")) is not None
    assert "-DFJ_FROM_CC" in (tmp_path / "args").read_text()


@pytest.mark.parametrize("how", ["no compiler", "compiler fails", "switched off"])
def test_without_the_library_load_warns_once_and_returns_none(tmp_path, monkeypatch, caplog, how):
    caplog.set_level(logging.WARNING, logger="flashjit")
    if how == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    elif how == "compiler fails":
        failing = tmp_path / "failing-cc"
        failing.write_text("#!/bin/sh\necho 'cc: fatal error: out of cheese' >&2\nexit 3\n")
        failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("CC", str(failing))
    else:
        monkeypatch.setenv("FLASHJIT_HOST_NATIVE", "0")
    cache = KernelCache(tmp_path / "cache")
    assert load_host_plan(cache) is None
    assert load_host_plan(cache) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if how == "switched off":
        assert warnings == []  # asked for: nothing to warn about
    else:
        assert len(warnings) == 1 and "numpy version" in warnings[0]
        assert ("no C compiler" if how == "no compiler" else "out of cheese") in warnings[0]
    assert not (cache.base / "host").exists() or built(cache) == []


def test_a_cache_it_cannot_write_builds_in_a_private_folder(tmp_path):
    cache = KernelCache(tmp_path)
    cache.writable = False  # as a read-only or unusable root leaves it
    assert load_host_plan(cache) is not None
    assert not (cache.base / "host").exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_a_hung_compiler_is_killed_with_its_children_at_the_build_timeout(tmp_path, monkeypatch, caplog):
    """A compiler that never finishes (and leaves children behind) holds the build for
    BUILD_TIMEOUT_S at most: then it and everything it started are killed and numpy is used."""
    caplog.set_level(logging.WARNING, logger="flashjit")
    pid_file = tmp_path / "child.pid"
    hung = tmp_path / "hung-cc"
    hung.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    hung.chmod(hung.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(hung))
    monkeypatch.setattr(host_library, "BUILD_TIMEOUT_S", 1.0)
    start = time.monotonic()
    try:
        assert load_host_plan(KernelCache(tmp_path / "cache")) is None
        elapsed = time.monotonic() - start
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the compiler's child outlived the build timeout"
    finally:
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), 9)
    assert elapsed < 5.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "timed out" in warnings[0] and "numpy" in warnings[0], warnings
