"""Faults a serving fleet meets, reproduced on the CPU: many processes and threads prewarming at
once, processes SIGKILLed mid-compile and mid-write, a full or read-only disk, and a lock held by a
hung process. Damaged entries (truncated or bit-flipped cubins, garbled meta.json) are covered in
test_cache.py.

Children that are killed are forked (cheap; they only fake NVRTC and write files); the
processes-and-threads test spawns fresh interpreters and compiles for real.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import multiprocessing
import os
import random
import signal
import tempfile
import time

import pytest

import flashjit.jit.engine as engine_module
from flashjit import DecodeSpec, Engine, KernelNotPrewarmed
from flashjit.jit import cache as cache_module
from flashjit.jit import trusted_writes
from flashjit.jit.cache import KernelCache
from flashjit.jit.keys import cache_key
from flashjit.jit.compile import CompiledKernel, compile_options, nvrtc_version
from flashjit.jit.render import render
from flashjit import __version__

from child_processes import collect_flashjit_log, run_children
from fake_cubins import fake_cubin

FORK = multiprocessing.get_context("fork")
BOUND_S = 10.0  # "not blocked": far below the lock timeout the tests set (60 s)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashjit" and r.levelno == logging.WARNING]


def key_of(spec: DecodeSpec) -> str:
    return cache_key(render(spec), spec.arch, compile_options(spec.arch), nvrtc_version(), __version__)


def hang(ready):
    ready.set()
    time.sleep(600)


def start_and_kill(target, args, ready) -> None:
    """Run target in a forked child until it signals `ready`, then SIGKILL it."""
    child = FORK.Process(target=target, args=args, daemon=True)
    child.start()
    try:
        assert ready.wait(30), "the child never reached its kill point"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert child.exitcode == -signal.SIGKILL


@pytest.fixture
def serve_cubin(monkeypatch):
    """NVRTC in this process 'compiles' to the given bytes; returns the names it compiled."""
    compiled = []

    def use(cubin_for):
        def compile_source(source, arch, name, **kwargs):
            compiled.append(name)
            return CompiledKernel(cubin_for(source, arch), "")

        monkeypatch.setattr(engine_module, "compile_source", compile_source)
        return compiled

    return use


# ---- N processes x M threads ------------------------------------------------------------------

SPECS = [DecodeSpec(64, mask="causal", arch="sm_80"), DecodeSpec(64, mask="sliding_window", arch="sm_80"),
         DecodeSpec(64, mask="none", page_size=8, arch="sm_80"), DecodeSpec(96, mask="none", arch="sm_80")]


def _prewarm_in_child(cache_dir, names, barrier, results):
    """Spawned: prewarm `names` with 2 threads; report the 'compiling' lines and each cubin's hash."""
    messages = collect_flashjit_log()
    engine = Engine(cache_dir=cache_dir)
    specs = [DecodeSpec.from_name(name) for name in names]
    nvrtc_version()  # load NVRTC before the race, so the processes reach the cache together
    barrier.wait(60)
    engine.prewarm(specs, jobs=2)
    results.put((sum("compiling" in m for m in messages),
                 {s.name: hashlib.sha256(engine.get_kernel(s).cubin).hexdigest() for s in specs}))


def test_processes_and_threads_compile_each_spec_once(cache_dir):
    context = multiprocessing.get_context("spawn")
    processes = 3
    barrier, results = context.Barrier(processes), context.Queue()
    # each process prewarms 3 of the 4 specs, in a different order: every spec is wanted by 2-3 processes
    plans = [[SPECS[(i + j) % len(SPECS)].name for j in range(3)] for i in range(processes)]
    children = [context.Process(target=_prewarm_in_child, args=(str(cache_dir), plan, barrier, results))
                for plan in plans]
    reports = run_children(children, results)
    assert [child.exitcode for child in children] == [0] * processes
    assert sum(compiles for compiles, _ in reports) == len(SPECS)  # every spec compiled once overall
    hashes: dict[str, set] = {}
    for _, cubins in reports:
        for name, digest in cubins.items():
            hashes.setdefault(name, set()).add(digest)
    assert sorted(hashes) == sorted(s.name for s in SPECS)
    assert all(len(digests) == 1 for digests in hashes.values())  # everyone got the same cubin
    cache = KernelCache(cache_dir)
    assert sorted(e["name"] for e in cache.entries()) == sorted(s.name for s in SPECS)
    assert {e["name"]: hashlib.sha256(cache.load(e["key"])[0]).hexdigest() for e in cache.entries()} == \
        {name: digests.pop() for name, digests in hashes.items()}


# ---- SIGKILL during compile -------------------------------------------------------------------

def _die_in_compile(cache_dir, spec_name, ready):
    """Forked: hang inside NVRTC (holding the compile lock) until killed."""
    engine_module.compile_source = lambda *args, **kwargs: hang(ready)
    Engine(cache_dir=cache_dir).get_kernel(DecodeSpec.from_name(spec_name))


def test_sigkill_during_compile_leaves_no_entry_and_no_lock(warm, cache_dir, monkeypatch, caplog, compile_log):
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 60.0)
    ready = FORK.Event()
    start_and_kill(_die_in_compile, (str(cache_dir), warm.spec.name, ready), ready)
    cache = KernelCache(cache_dir)
    key = key_of(warm.spec)
    assert (cache.base / "locks" / f"{key}.lock").exists()  # the child held the lock when it died
    assert cache.entries() == [] and cache.load(key) is None

    start = time.monotonic()
    with cache.compile_lock(key):  # flock died with the process: no wait at all
        assert time.monotonic() - start < 1.0
    start = time.monotonic()
    kernel = Engine(cache_dir=cache_dir).get_kernel(warm.spec)  # a real compile
    assert time.monotonic() - start < BOUND_S
    assert kernel.cubin == warm.kernel.cubin and len(compile_log()) == 1
    assert not any("held for over" in w for w in warnings_of(caplog))


# ---- SIGKILL during write ---------------------------------------------------------------------

def _die_while_writing(cache_dir, spec_name, cubin, point, ready):
    """Forked: compile (fake, to the right bytes), then die at `point` of the cache writes.

    point is FILE:partial (half the bytes in the temp file, before os.replace) or FILE:written
    (right after os.replace), FILE one of kernel.cubin, source.cu, meta.json, index.
    """
    engine_module.compile_source = lambda source, arch, name, **kw: CompiledKernel(cubin, "")
    original = trusted_writes.write_file

    def atomic_write(path, data):
        name = "index" if path.parent.name == "index" else path.name
        if point == f"{name}:partial":
            fd, _ = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.write(fd, data[: len(data) // 2])
            hang(ready)
        original(path, data)
        if point == f"{name}:written":
            hang(ready)

    trusted_writes.write_file = atomic_write
    Engine(cache_dir=cache_dir).get_kernel(DecodeSpec.from_name(spec_name))


KILL_POINTS = ["kernel.cubin:partial", "kernel.cubin:written", "source.cu:partial", "source.cu:written",
               "meta.json:partial", "meta.json:written", "index:partial", "index:written"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_during_write(warm, cache_dir, monkeypatch, serve_cubin, point):
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 60.0)
    ready = FORK.Event()
    start_and_kill(_die_while_writing, (str(cache_dir), warm.spec.name, warm.kernel.cubin, point, ready), ready)
    cache = KernelCache(cache_dir)
    key = key_of(warm.spec)
    complete = KILL_POINTS.index(point) >= KILL_POINTS.index("meta.json:written")  # meta.json is written last
    if complete:
        assert [e["key"] for e in cache.entries()] == [key] and cache.load(key)[0] == warm.kernel.cubin
    else:
        assert cache.entries() == [] and cache.load(key) is None  # no trusted partial entry

    compiled = serve_cubin(lambda source, arch: warm.kernel.cubin)
    start = time.monotonic()
    kernel = Engine(cache_dir=cache_dir).get_kernel(warm.spec)
    assert time.monotonic() - start < BOUND_S
    assert kernel.cubin == warm.kernel.cubin
    assert compiled == ([] if complete else [warm.spec.name])
    assert cache.load(key)[0] == warm.kernel.cubin
    assert Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(warm.spec).cubin == warm.kernel.cubin


def _write_many(cache_dir, names, ready):
    """Forked: build many specs (fake NVRTC) as fast as the disk allows, until killed."""
    engine_module.compile_source = lambda source, arch, name, **kw: CompiledKernel(fake_cubin(source, arch), "")
    engine = Engine(cache_dir=cache_dir)
    ready.set()
    for name in names:
        engine.get_kernel(DecodeSpec.from_name(name))


def test_sigkill_at_a_random_moment(cache_dir, monkeypatch, serve_cubin):
    seed = int.from_bytes(os.urandom(4), "little")
    delay = random.Random(seed).uniform(0.05, 0.5)  # entries take ~80 ms each (3 fsyncs + index)
    specs = [DecodeSpec(64, mask="none", page_size=p, arch="sm_80") for p in range(1, 25)]
    expected = {s.name: fake_cubin(render(s), s.arch) for s in specs}
    ready = FORK.Event()
    child = FORK.Process(target=_write_many, args=(str(cache_dir), [s.name for s in specs], ready), daemon=True)
    child.start()
    assert ready.wait(30)
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)

    cache = KernelCache(cache_dir)
    survivors = cache.entries()
    for entry in survivors:  # whatever survived is whole and right
        assert cache.load(entry["key"])[0] == expected[entry["name"]], f"seed {seed}"
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 60.0)
    compiled = serve_cubin(fake_cubin)
    start = time.monotonic()
    engine = Engine(cache_dir=cache_dir)
    assert {s.name: engine.get_kernel(s).cubin for s in specs} == expected, f"seed {seed}"
    assert time.monotonic() - start < BOUND_S, f"seed {seed}"
    assert len(compiled) == len(specs) - len(survivors), f"seed {seed}, killed after {delay:.3f} s"


# ---- full disk, read-only disk ------------------------------------------------------------------

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=errno.errorcode.get)
def test_failed_writes_serve_from_memory_with_one_warning(cache_dir, monkeypatch, caplog, fake_nvrtc, code):
    caplog.set_level(logging.WARNING, logger="flashjit")
    engine = Engine(cache_dir=cache_dir)

    def fail(path, data):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(trusted_writes, "write_file", fail)
    specs = [DecodeSpec(64, mask="causal", arch="sm_90"), DecodeSpec(64, mask="none", arch="sm_90")]
    kernels = [engine.get_kernel(s) for s in specs]
    assert [k.cubin for k in kernels] == [fake_cubin(render(s), s.arch) for s in specs]
    assert [engine.get_kernel(s) for s in specs] == kernels  # memory hits from now on
    assert fake_nvrtc == [s.name for s in specs]
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert os.strerror(code) in warnings[0] and "memory" in warnings[0] and "FLASHJIT_CACHE_DIR" in warnings[0]
    assert KernelCache(cache_dir).entries() == []


# ---- a lock held by a hung process ------------------------------------------------------------

def _hold_lock(cache_dir, key, ready):
    """Forked: take the compile lock of `key` and hang, as a stuck compiler would."""
    with KernelCache(cache_dir).compile_lock(key):
        hang(ready)


def test_lock_held_by_a_hung_process(warm, cache_dir, monkeypatch, caplog, serve_cubin):
    caplog.set_level(logging.WARNING, logger="flashjit")
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", None)
    monkeypatch.setenv("FLASHJIT_LOCK_TIMEOUT", "1")  # read at lock time, not at import
    key = key_of(warm.spec)
    ready = FORK.Event()
    child = FORK.Process(target=_hold_lock, args=(str(cache_dir), key, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(30)
        compiled = serve_cubin(lambda source, arch: warm.kernel.cubin)
        start = time.monotonic()
        kernel = Engine(cache_dir=cache_dir).get_kernel(warm.spec)
        waited = time.monotonic() - start
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert 0.9 <= waited < BOUND_S  # waited the timeout out, then compiled anyway
    assert kernel.cubin == warm.kernel.cubin and compiled == [warm.spec.name]
    assert any("held for over 1 s" in w for w in warnings_of(caplog))
    assert KernelCache(cache_dir).load(key)[0] == warm.kernel.cubin


def test_strict_mode_does_not_wait_for_a_lock_it_cannot_use(warm, cache_dir, monkeypatch):
    """Strict mode cannot compile, so a peer holding the kernel's lock (hung, stopped) is not
    waited for: the miss is an error at once."""
    monkeypatch.setattr(cache_module, "LOCK_TIMEOUT_S", 30.0)
    ready = FORK.Event()
    child = FORK.Process(target=_hold_lock, args=(str(cache_dir), key_of(warm.spec), ready), daemon=True)
    child.start()
    try:
        assert ready.wait(30)
        start = time.monotonic()
        with pytest.raises(KernelNotPrewarmed):
            Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(warm.spec)
        waited = time.monotonic() - start
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert waited < 5.0


def test_read_only_cache_serves_what_it_holds_and_warns_once(warm, cache_dir, monkeypatch, caplog, fake_nvrtc):
    """A cache baked into a container image, mounted read-only (simulated: root ignores chmod)."""
    caplog.set_level(logging.WARNING, logger="flashjit")
    warm.copy_entry_to(cache_dir)
    real_write_bytes = cache_module.Path.write_bytes

    def read_only(path, data):
        if str(path).startswith(str(cache_dir)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_write_bytes(path, data)

    monkeypatch.setattr(trusted_writes, "write_file", lambda path, data: read_only(path, data))
    monkeypatch.setattr(trusted_writes, "probe", lambda folder: read_only(folder / ".probe", b""))
    engine = Engine(cache_dir=cache_dir)
    assert engine.cache.writable is False
    assert engine.get_kernel(warm.spec).cubin == warm.kernel.cubin and fake_nvrtc == []
    assert warnings_of(caplog) == []  # serving from a read-only cache is normal
    others = [warm.spec.replace(page_size=p) for p in (32, 64)]
    assert all(engine.get_kernel(s).cubin == fake_cubin(render(s), s.arch) for s in others)
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and "read-only" in warnings[0] and "memory" in warnings[0], warnings
