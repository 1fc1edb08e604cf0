"""A storm on one cache: prewarm, prune, clear, import, export, and strict and normal readers, in
processes that are SIGKILLed and SIGSTOPped at random, for STORM_S seconds. Every kernel served is
checked byte for byte; nothing ends in an unexpected exception; the cache, an exported bundle and
the temp folder are sound afterwards.

NVRTC is faked (conftest.fake_cubin: distinct bytes per source and arch), so the storm is all
cache traffic. The schedule of signals is drawn from SEED (FLASHJIT_STORM_SEED overrides it, to
replay a failure); the timing between processes is the operating system's, so only properties
that hold under every interleaving are asserted.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import tempfile
import time
import traceback
from pathlib import Path

import pytest

import flashjit.jit.engine as engine_module
from flashjit import DecodeSpec, Engine, KernelNotPrewarmed
from flashjit.deploy.bundle import BundleError, export_bundle, import_bundle
from flashjit.errors import CacheError
from flashjit.jit import cache_upkeep
from flashjit.jit.cache import KernelCache
from flashjit.jit.compile import CompiledKernel
from flashjit.jit.render import render

from fake_cubins import fake_cubin

FORK = multiprocessing.get_context("fork")
SEED = int(os.environ.get("FLASHJIT_STORM_SEED", "51"))
STORM_S = 20.0
SPECS = [DecodeSpec(64, mask=mask, page_size=page, arch="sm_80") for mask in ("none", "causal") for page in (8, 16, 32, 64)]
ROLES = {"prewarm": 1, "read": 2, "strict": 2, "prune": 1, "clear": 1, "export": 1, "import": 1}


def expected_cubins() -> dict[str, bytes]:
    return {spec.name: fake_cubin(render(spec), spec.compile_arch) for spec in SPECS}


def fake_compile(source, arch, name, **kwargs):
    return CompiledKernel(fake_cubin(source, arch), "")


class Log:
    """One line per event in this worker's own file, appended whole (O_APPEND): a SIGKILL loses at
    most the line being written."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, line: str):
        os.write(self.fd, (line.replace("\n", " ")[:500] + "\n").encode())


def worker(role: str, seed: int, paths: dict, expected: dict[str, bytes], deadline: float):
    """One storm process: does its role in a loop until killed (or, if the test is gone, the deadline)."""
    logging.getLogger("flashjit").setLevel(logging.CRITICAL)  # the storm provokes warnings by design
    os.environ["FLASHJIT_LOCK_TIMEOUT"] = "2"  # a stopped peer's lock is waited out quickly
    tempfile.tempdir = str(paths["tmp"])
    engine_module.compile_source = fake_compile
    rng, log = random.Random(seed), Log(paths["logs"] / f"{role}-{seed}.log")
    engine = None
    while time.time() < deadline:
        try:
            if role in ("read", "strict"):
                if engine is None or rng.random() < 0.2:  # a fresh process's view now and then
                    engine = Engine(cache_dir=paths["cache"], allow_compile=role == "read")
                engine._kernels.clear()  # every lookup goes to the disk
                spec = rng.choice(SPECS)
                try:
                    cubin = engine.get_kernel(spec).cubin
                except KernelNotPrewarmed:
                    if role == "read":
                        raise
                    log("miss")
                    continue
                log("ok" if cubin == expected[spec.name] else f"BAD {spec.name} served {len(cubin)} other bytes")
            elif role == "prewarm":
                Engine(cache_dir=paths["cache"]).prewarm(rng.sample(SPECS, 3), jobs=2)
                log("prewarmed")
            elif role == "prune":
                cache_upkeep.INCOMPLETE_GRACE_S = 1.0  # leftovers of killed writers go within the storm
                time.sleep(rng.uniform(0.1, 0.6))
                KernelCache(paths["cache"], create=False).prune(max_bytes=rng.choice([0, 300, 10**6, None]))
                log("pruned")
            elif role == "clear":
                time.sleep(rng.uniform(0.2, 1.5))
                try:
                    KernelCache(paths["cache"], create=False).clear()
                    log("cleared")
                except OSError as exc:  # files written meanwhile: what the CLI reports as "could not clear"
                    log(f"refused {exc}")
            elif role == "export":
                try:
                    export_bundle(paths["export"], paths["cache"])
                    log("exported")
                except BundleError as exc:  # nothing to export, or an entry went while it was read
                    log(f"refused {exc}")
                    time.sleep(rng.uniform(0.05, 0.3))
            elif role == "import":
                try:
                    import_bundle(paths["bundle"], paths["cache"])
                    log("imported")
                except CacheError as exc:  # `clear` took a folder from under it: nothing half-served
                    log(f"refused {exc}")
        except Exception as exc:  # noqa: BLE001 (every other exception fails the test, with its traceback)
            log(f"ERR {type(exc).__name__}: {exc} | {traceback.format_exc(limit=-3)}")
            time.sleep(0.05)


def start(role: str, seed: int, paths: dict, expected: dict, deadline: float):
    process = FORK.Process(target=worker, args=(role, seed, paths, expected, deadline), daemon=True)
    process.start()
    return process


def lines(paths: dict, roles=None) -> list[str]:
    found = []
    for log in sorted(paths["logs"].iterdir()):
        if roles is None or log.name.split("-")[0] in roles:
            found += log.read_text().splitlines()
    return found


@pytest.fixture
def storm_paths(tmp_path, monkeypatch) -> dict:
    paths = {name: tmp_path / name for name in ("cache", "build", "logs", "tmp", "out")}
    for name in ("logs", "tmp", "out"):
        paths[name].mkdir()
    paths["export"], paths["bundle"] = paths["out"] / "export.tar.gz", tmp_path / "good.tar.gz"
    monkeypatch.setattr(engine_module, "compile_source", fake_compile)
    Engine(cache_dir=paths["build"]).prewarm(SPECS, jobs=2)
    export_bundle(paths["bundle"], paths["build"])
    return paths


def test_a_storm_of_writers_readers_and_signals_serves_every_kernel_exactly(storm_paths, tmp_path, monkeypatch):
    paths, expected, rng = storm_paths, expected_cubins(), random.Random(SEED)
    deadline = time.time() + STORM_S + 60  # workers stop by themselves should this test die
    workers = {(role, n): start(role, rng.randrange(1 << 30), paths, expected, deadline)
               for role, count in ROLES.items() for n in range(count)}
    kills = stops = 0
    stopped: dict = {}  # worker -> when it is continued
    try:
        end = time.monotonic() + STORM_S
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.3, 1.0))
            for slot, until in list(stopped.items()):
                if time.monotonic() >= until:
                    os.kill(workers[slot].pid, signal.SIGCONT)
                    del stopped[slot]
            slot = rng.choice(sorted(workers))
            if slot in stopped:
                continue
            if rng.random() < 0.65:  # SIGKILL, at whatever it was doing; a fresh process takes its role
                os.kill(workers[slot].pid, signal.SIGKILL)
                workers[slot].join(10)
                workers[slot] = start(slot[0], rng.randrange(1 << 30), paths, expected, deadline)
                kills += 1
            else:  # SIGSTOP for a while, holding whatever it holds (locks, half-written files)
                os.kill(workers[slot].pid, signal.SIGSTOP)
                stopped[slot] = time.monotonic() + rng.uniform(0.2, 2.5)
                stops += 1
    finally:
        for process in workers.values():
            try:
                os.kill(process.pid, signal.SIGCONT)
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.join(10)
    where = f"(seed {SEED}: FLASHJIT_STORM_SEED={SEED} replays the schedule)"
    assert kills >= 5 and stops >= 3, where

    events = lines(paths)
    errors = [line for line in events if line.startswith(("BAD", "ERR"))]
    assert errors == [], f"{where}\n" + "\n".join(errors[:10])
    served = sum(line == "ok" for line in lines(paths, ("read", "strict")))
    assert served >= 20, f"only {served} kernels were served {where}"
    for role in ROLES:  # every role had its turn (a refusal counts: it says why it did nothing)
        assert lines(paths, (role,)), f"no {role} finished {where}"

    # After the storm: a fresh process serves every kernel exactly, compiling only what is missing.
    engine = Engine(cache_dir=paths["cache"])
    assert {spec.name: engine.get_kernel(spec).cubin for spec in SPECS} == expected, where
    # An exported bundle, if one was written whole before its exporter was killed, is sound.
    if paths["export"].exists():
        check = tmp_path / "check-cache"
        report = import_bundle(paths["export"], check)
        assert report.rejected == [], where
        served = Engine(cache_dir=check, allow_compile=False)
        for name in report.imported:
            spec = next(s for s in SPECS if s.name == name)
            assert served.get_kernel(spec).cubin == expected[name], where
    # Killed writers leave temp files and trash behind; prune takes them, and nothing else remains.
    monkeypatch.setattr(cache_upkeep, "INCOMPLETE_GRACE_S", 0.0)
    KernelCache(paths["cache"]).prune()
    leftovers = [p.name for p in (paths["cache"] / "v1" / "entries").iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers
    assert os.listdir(paths["tmp"]) == [], where  # nothing of flashjit's in the temp folder
