"""Host-side C helpers (flashjit/serving/native/*.c): built once with the system C compiler, kept in
the kernel cache folder, loaded with ctypes.

Each library goes through the artifact lifecycle (artifact.py), as cubins do: load
`<cache>/v1/host/<name>-<key>.so`, else build it under the cache's file lock (two processes build
it once) and store it with an atomic replace, so a killed build leaves no half-written library;
then load it. The key (keys.library_key) hashes the source, the build command and the platform, so
an edited source or another machine type builds anew. A read-only or unusable cache folder builds
into a private temp folder instead.

Each helper has a pure-Python reference that flashjit uses when the helper cannot be had: no C
compiler (`$CC`, else `cc`), a failed build, or FLASHJIT_HOST_NATIVE=0. That costs speed, never
results; one warning says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .. import env
from . import keys
from .abi import ITEM_INTS
from .artifact import obtain
from .cache import KernelCache, atomic_file

log = logging.getLogger("flashjit")

SOURCE_DIR = Path(__file__).resolve().parent.parent / "serving" / "native"
# No -ffast-math, and no fused multiply-adds: the helpers must round exactly as the Python references.
# -DFJ_ITEM_INTS: the work-item record width of abi.py, which host_plan.c refuses to build without.
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off", "-fno-fast-math", f"-DFJ_ITEM_INTS={ITEM_INTS}")
LIBS = ("-lm",)
BUILD_TIMEOUT_S = 120
FALLBACK = "flashjit uses its numpy version instead (the same results, slower: ~100 us per plan() for host_plan)"

_loaded: dict[tuple, ctypes.CDLL | None] = {}  # (name, cache folder) -> the outcome of the first load
_load_lock = threading.Lock()


class BuildError(RuntimeError):
    """The compiler rejected a source; stderr holds what it said."""

    def __init__(self, command: list[str], returncode: int, stderr: str):
        super().__init__(f"{shlex.join(command)} exited with {returncode}: {stderr.strip()[-2000:]}")
        self.stderr = stderr


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


@dataclasses.dataclass
class SharedLibrary:
    """A shared library built from one source file into `path`, as an artifact (see artifact.py).

    command: the compiler and its flags; `-o OUT SOURCE` and libs follow it. cache: whose file
    lock guards the build (None: a private folder, where no other process builds).
    """

    command: list[str]
    source: Path
    path: Path
    cache: KernelCache | None = None
    libs: tuple[str, ...] = ()
    _warned_damaged: bool = dataclasses.field(default=False, init=False, repr=False)

    def load(self) -> ctypes.CDLL | None:
        if not self.path.is_file():
            return None
        try:
            return ctypes.CDLL(str(self.path))
        except OSError as exc:  # a truncated file, a foreign writer: a miss, built again
            if not self._warned_damaged:
                self._warned_damaged = True
                log.warning("flashjit host helper %s does not load (%s); rebuilding it", self.path, exc)
            return None

    def lock(self):
        return self.cache.compile_lock(self.path.stem) if self.cache is not None else contextlib.nullcontext()

    def build(self) -> bytes:
        """The library's bytes. Raises BuildError, subprocess.TimeoutExpired or OSError."""
        return _build(self.command, self.source, self.path.name, self.libs)

    def store(self, built: bytes):
        with atomic_file(self.path) as f:
            f.write(built)

    def load_built(self, built: bytes) -> ctypes.CDLL:
        return ctypes.CDLL(str(self.path))


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
    source = SOURCE_DIR / f"{name}.c"
    folder, lock_cache = _library_folder(cache)
    library = SharedLibrary([*cc, *CFLAGS], source, folder / f"{name}-{library_key(source.read_bytes(), cc)}.so",
                            lock_cache, LIBS)
    try:
        return obtain(library)[0]
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("could not build or load flashjit's host helper %s (%s): %s", name, exc, FALLBACK)
        return None


def _library_folder(cache: KernelCache | None) -> tuple[Path, KernelCache | None]:
    """(where to keep the library, the cache whose lock guards it): the cache's host folder, else
    a private temp folder (no lock needed)."""
    if cache is not None and cache.writable:
        folder = cache.base / "host"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder, cache
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="flashjit-host-")), None


def _build(command: list[str], source: Path, name: str, libs=()) -> bytes:
    """Compile source into a shared library in a scratch folder; its bytes."""
    with tempfile.TemporaryDirectory(prefix="flashjit-build-") as scratch:
        built = Path(scratch) / name
        result = subprocess.run([*command, "-o", str(built), str(source), *libs], capture_output=True,
                                text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise BuildError(command, result.returncode, result.stderr)
        return built.read_bytes()
