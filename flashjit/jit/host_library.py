"""Host-side C helpers (flashjit/native/*.c): built once with the system C compiler, kept in the
kernel cache folder, loaded with ctypes.

Lifecycle, as for kernels: look for `<cache>/v1/host/<name>-<key>.so`, else build it under a file
lock (two processes build it once) into a temp file that is os.replace()d, so a killed build leaves
no half-written library; then load. The key hashes the source, the build command and the platform,
so an edited source or another machine type builds anew. A read-only or unusable cache folder
builds into a private temp folder instead.

Each helper has a pure-Python reference that flashjit uses when the helper cannot be had: no C
compiler (`$CC`, else `cc`), a failed build, or FLASHJIT_HOST_NATIVE=0. That costs speed, never
results; one warning says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import filelock

from .. import env
from . import keys
from .abi import ITEM_INTS
from .cache import KernelCache, atomic_file, lock_timeout

log = logging.getLogger("flashjit")

SOURCE_DIR = Path(__file__).resolve().parent.parent / "decode" / "native"
# No -ffast-math, and no fused multiply-adds: the helpers must round exactly as the Python references.
# -DFJ_ITEM_INTS: the work-item record width of abi.py, which host_plan.c refuses to build without.
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off", "-fno-fast-math", f"-DFJ_ITEM_INTS={ITEM_INTS}")
BUILD_TIMEOUT_S = 120
FALLBACK = "flashjit uses its numpy version instead (the same results, slower: ~100 us per plan() for host_plan)"

_loaded: dict[tuple, ctypes.CDLL | None] = {}  # (name, cache folder) -> the outcome of the first load
_load_lock = threading.Lock()


def compiler() -> list[str] | None:
    """The C compiler command to build with ($CC, e.g. "ccache gcc -m64"; else cc), its program
    resolved on PATH, or None when there is none."""
    try:
        command = shlex.split(env.cc() or "cc")
    except ValueError:  # unbalanced quotes: not a command
        return None
    program = shutil.which(command[0]) if command else None
    return [program, *command[1:]] if program else None


def library_key(source: bytes, cc: list[str]) -> str:
    """keys.library_key of a helper built with cc and CFLAGS."""
    return keys.library_key(source, cc, CFLAGS)


def load(name: str, cache: KernelCache | None = None) -> ctypes.CDLL | None:
    """The helper native/<name>.c as a loaded library, or None (with one warning) when it cannot
    be built or loaded. The first outcome per cache folder is kept for the process."""
    key = (name, None if cache is None else str(cache.base))
    with _load_lock:
        if key not in _loaded:
            _loaded[key] = _build_and_load(name, cache)
        return _loaded[key]


def _build_and_load(name: str, cache: KernelCache | None) -> ctypes.CDLL | None:
    if not env.host_native():
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (CC=%r; set CC, or install cc) to build flashjit's host helper %s: %s",
                    env.cc(), name, FALLBACK)
        return None
    source_path = SOURCE_DIR / f"{name}.c"
    target = _library_folder(cache) / f"{name}-{library_key(source_path.read_bytes(), cc)}.so"
    try:
        return _load_or_build(cc, source_path, target)
    except (OSError, subprocess.SubprocessError, filelock.Timeout, RuntimeError) as exc:
        log.warning("could not build or load flashjit's host helper %s (%s): %s", name, exc, FALLBACK)
        return None


def _load_or_build(cc: list[str], source: Path, target: Path) -> ctypes.CDLL:
    """Load target, building it first when it is missing or does not load (a damaged file)."""
    damaged = False
    if target.is_file():
        try:
            return ctypes.CDLL(str(target))
        except OSError as exc:
            log.warning("flashjit host helper %s does not load (%s); rebuilding it", target, exc)
            damaged = True
    with filelock.FileLock(str(target) + ".lock", timeout=lock_timeout()):
        if damaged or not target.is_file():  # another process may have built it meanwhile
            _build(cc, source, target)
    return ctypes.CDLL(str(target))


def _library_folder(cache: KernelCache | None) -> Path:
    if cache is not None and cache.writable:
        folder = cache.base / "host"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="flashjit-host-"))


def _build(cc: list[str], source: Path, target: Path):
    """Compile source into target: built in a temp folder, then moved in whole."""
    with tempfile.TemporaryDirectory(prefix="flashjit-build-") as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([*cc, *CFLAGS, "-o", str(built), str(source), "-lm"], capture_output=True,
                                text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{shlex.join(cc)} exited with {result.returncode}: {result.stderr.strip()[-2000:]}")
        with atomic_file(target) as f:
            f.write(built.read_bytes())
