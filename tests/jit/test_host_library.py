"""host_library: the C helper is built once into the cache, reused, rebuilt when damaged, and
missed gracefully (None, one warning) without a compiler or when switched off."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import stat
import tempfile
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


# ---- a library that lacks its symbols; strict mode; a build killed with its process ----------------

def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashjit" and r.levelno == logging.WARNING]


def recording_cc(tmp_path) -> Path:
    """A C compiler that notes each run in tmp_path/'cc-runs', then runs the real one."""
    script = tmp_path / "recording-cc"
    script.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'cc-runs'}\nexec {host_library.compiler()[0]} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_library_whose_symbols_are_hidden_is_refused_for_numpy_with_one_warning(tmp_path, monkeypatch, caplog):
    """CC="gcc -fvisibility=hidden" builds a library that loads but exports nothing plan() calls."""
    import torch

    from flashjit import BatchDecode, Engine
    from flashjit.deploy.cli_kernels import host_planner_status

    caplog.set_level(logging.WARNING, logger="flashjit")
    monkeypatch.setenv("CC", f"{host_library.compiler()[0]} -fvisibility=hidden")
    engine = Engine(cache_dir=tmp_path / "cache")
    decoder = BatchDecode(engine, torch.device("cpu"), arch="sm_90")
    assert decoder._host_planner.library is None
    (warning,) = warnings_of(caplog)
    assert "fj_read" in warning and "numpy" in warning, warning
    assert host_planner_status(engine.cache).startswith("numpy")
    assert built(engine.cache) == []  # not kept: every process would load it only to refuse it


def test_strict_mode_builds_nothing_and_uses_a_library_the_cache_holds(tmp_path, monkeypatch, caplog):
    """The container recipe: a strict server runs no compiler at start and leaves nothing in the
    temp folder; with the helper in the cache (built at import time) it uses it."""
    import torch

    from flashjit import BatchDecode, Engine

    caplog.set_level(logging.WARNING, logger="flashjit")
    monkeypatch.setenv("CC", str(recording_cc(tmp_path)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    strict = Engine(cache_dir=tmp_path / "cache", allow_compile=False)
    assert BatchDecode(strict, torch.device("cpu"), arch="sm_90")._host_planner.library is None
    assert not (tmp_path / "cc-runs").exists() and os.listdir(tmp_path / "tmp") == []
    (warning,) = warnings_of(caplog)
    assert "strict" in warning and "numpy" in warning and "flashjit prewarm" in warning, warning

    monkeypatch.setattr(host_library, "_loaded", {})
    assert load_host_plan(KernelCache(tmp_path / "cache")) is not None  # as import or prewarm do
    monkeypatch.setattr(host_library, "_loaded", {})
    (tmp_path / "cc-runs").unlink()
    assert BatchDecode(strict, torch.device("cpu"), arch="sm_90")._host_planner.library is not None
    assert not (tmp_path / "cc-runs").exists() and os.listdir(tmp_path / "tmp") == []


def test_a_private_build_leaves_nothing_in_the_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cache = KernelCache(tmp_path / "cache")
    cache.writable = False  # as a read-only root leaves it
    library = load_host_plan(cache)
    assert library is not None and library.fj_plan is not None
    assert os.listdir(tmp_path / "tmp") == []


def _build_then_wait(cache_dir, tmp, cc):
    os.environ["CC"] = cc
    tempfile.tempdir = tmp
    load_host_plan(KernelCache(cache_dir))


def test_a_build_whose_process_is_killed_leaves_no_compiler_and_no_scratch(tmp_path):
    """SIGKILL cannot be caught: the compiler must not outlive its caller, nor its scratch folder."""
    pid_file = tmp_path / "child.pid"
    hung = tmp_path / "hung-cc"
    hung.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    hung.chmod(hung.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "tmp").mkdir()
    child = multiprocessing.get_context("fork").Process(
        target=_build_then_wait, args=(tmp_path / "cache", str(tmp_path / "tmp"), str(hung)), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_file.exists(), "the compiler never started"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        compiler_child = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while (_alive(compiler_child) or os.listdir(tmp_path / "tmp")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(compiler_child), "the compiler outlived the process that started it"
        assert os.listdir(tmp_path / "tmp") == [], "its scratch folder was left behind"
    finally:
        if pid_file.exists() and pid_file.read_text().strip() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_stale_scratch_folders_of_this_user_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    old, new = tmp_path / "tmp" / "flashjit-build-old", tmp_path / "tmp" / "flashjit-build-new"
    for folder in (old, new):
        folder.mkdir(parents=True)
        (folder / "host_plan.so").write_bytes(b"half")
    long_ago = time.time() - 2 * 3600
    os.utime(old, (long_ago, long_ago))
    assert load_host_plan(KernelCache(tmp_path / "cache")) is not None
    assert not old.exists() and new.exists()  # a build at work right now keeps its folder


def test_the_container_recipe_serves_the_c_planner_strictly_without_a_compiler_run(warm, tmp_path, monkeypatch):
    """`flashjit cache import` at image build time builds the helper beside the kernels; the strict
    server then loads it and runs no compiler."""
    import torch

    from flashjit import BatchDecode, Engine
    from flashjit.deploy.bundle import export_bundle
    from cli_runner import run

    bundle = export_bundle(tmp_path / "kernels.tar.gz", warm.cache_dir).path
    code, out, err = run("cache", "import", bundle, "--cache-dir", tmp_path / "image-cache")
    assert code == 0 and "host planner: built (C)" in out, (out, err)
    monkeypatch.setattr(host_library, "_loaded", {})  # the server is another process
    monkeypatch.setattr(host_library, "_build", lambda *a: pytest.fail("the strict server ran the compiler"))
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")
    decoder = BatchDecode(Engine(cache_dir=tmp_path / "image-cache"), torch.device("cpu"), arch="sm_90")
    assert decoder._host_planner.library is not None
