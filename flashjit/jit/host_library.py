"""Host-side C helpers (flashjit/serving/native/*.c): built once with the system C compiler, kept in
the kernel cache folder, loaded with ctypes.

Each library goes through the artifact lifecycle (artifact.py), as cubins do: load
`<cache>/v1/host/<name>-<key>.so`, else build it under the cache's file lock (two processes build
it once) and store it with an atomic replace, so a killed build leaves no half-written library;
then load it. The key (keys.library_key) hashes the source, the build command and the platform, so
an edited source or another machine type builds anew. A read-only cache still serves a library it
holds; a cache that cannot take one builds it into a private temp folder instead.

A library is machine code run in this process, so it is loaded only after the cache's trust rule
(trusted_files.py) passed: a regular file, not a link, owned by this user or root, writable by no
one else, in folders likewise. One that fails is built again (or, where it cannot be replaced,
built privately); it is never loaded.

A hung compiler is bounded twice: the build is killed, with every process it started, after
BUILD_TIMEOUT_S; and other processes wait at most HOST_LOCK_WAIT_S for the build lock, then use
the numpy planner rather than wait for, or start, a build of their own.

Each helper has a pure-Python reference that flashjit uses when the helper cannot be had: no C
compiler (`$CC`, else `cc`), a failed or timed-out build, a build lock held too long, or
FLASHJIT_HOST_NATIVE=0. That costs speed, never results; one warning says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from .. import env
from . import keys, trusted_files, trusted_writes
from .abi import ITEM_INTS
from .artifact import obtain
from .cache import SCHEMA, KernelCache, LockBusy
from .trusted_writes import atomic_file

log = logging.getLogger("flashjit")

SOURCE_DIR = Path(__file__).resolve().parent.parent / "serving" / "native"
# No -ffast-math, and no fused multiply-adds: the helpers must round exactly as the Python references.
# -DFJ_ITEM_INTS: the work-item record width of abi.py, which host_plan.c refuses to build without.
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off", "-fno-fast-math", f"-DFJ_ITEM_INTS={ITEM_INTS}")
LIBS = ("-lm",)
BUILD_TIMEOUT_S = 60.0  # a build of one helper takes about a second; a compiler past this is hung
HOST_LOCK_WAIT_S = 5.0  # how long another process's build is waited for before using numpy instead
MAX_LIBRARY_BYTES = 64 << 20
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
    lock guards the build and whose root the trust check starts from (None: a private folder,
    where no other process builds, checked from `path`'s folder).
    """

    command: list[str]
    source: Path
    path: Path
    cache: KernelCache | None = None
    libs: tuple[str, ...] = ()
    _warned: set = dataclasses.field(default_factory=set, init=False, repr=False)

    def _trusted_path(self) -> Path:
        """path, once it passed the trust rule; raises Refused, PermissionError or FileNotFoundError."""
        root = self.cache.root if self.cache is not None else self.path.parent
        return trusted_files.check_file(root, self.path.relative_to(root).parts, MAX_LIBRARY_BYTES, follow=1)

    def _warn_once(self, what: str, *args):
        if what not in self._warned:
            self._warned.add(what)
            log.warning(what, *args)

    def load(self) -> ctypes.CDLL | None:
        try:
            path = self._trusted_path()
        except FileNotFoundError:
            return None
        except (trusted_files.Refused, OSError) as exc:  # planted, or unreadable: never loaded
            self._warn_once("flashjit host helper %s is not loaded (%s); building it anew", self.path, exc)
            return None
        try:
            return ctypes.CDLL(str(path))
        except OSError as exc:  # a truncated file, a foreign writer: a miss, built again
            self._warn_once("flashjit host helper %s does not load (%s); rebuilding it", self.path, exc)
            return None

    def lock(self):
        """The cache's build lock, waited for HOST_LOCK_WAIT_S at most (then LockBusy)."""
        if self.cache is None:
            return contextlib.nullcontext()
        return self.cache.compile_lock(self.path.stem, give_up_after=HOST_LOCK_WAIT_S)

    def build(self) -> bytes:
        """The library's bytes. Raises BuildError, subprocess.TimeoutExpired or OSError."""
        return _build(self.command, self.source, self.path.name, self.libs)

    def store(self, built: bytes):
        with atomic_file(self.path) as f:
            f.write(built)

    def load_built(self, built: bytes) -> ctypes.CDLL:
        return ctypes.CDLL(str(self._trusted_path()))


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
    file_name = f"{name}-{library_key(source.read_bytes(), cc)}.so"
    try:
        if cache is not None and not cache.writable:  # a read-only cache still serves what it holds
            held = SharedLibrary([*cc, *CFLAGS], source, cache.base / "host" / file_name, cache, LIBS).load()
            if held is not None:
                return held
        folder, lock_cache = _library_folder(cache)
        return obtain(SharedLibrary([*cc, *CFLAGS], source, folder / file_name, lock_cache, LIBS))[0]
    except LockBusy as exc:
        log.warning("flashjit's host helper %s is being built by another process (%s): %s", name, exc, FALLBACK)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("could not build or load flashjit's host helper %s (%s): %s", name, exc, FALLBACK)
    return None


def _library_folder(cache: KernelCache | None) -> tuple[Path, KernelCache | None]:
    """(where to keep the library, the cache whose lock guards it): the cache's host folder, made
    and checked by the trust rule, else a private temp folder (no lock needed)."""
    if cache is not None and cache.writable:
        try:
            folder = trusted_writes.make_folders(cache.root, (f"v{SCHEMA}", "host"), follow=1)
            if os.access(folder, os.W_OK):
                return folder, cache
        except (OSError, trusted_files.Refused) as exc:
            log.warning("flashjit's host helper folder in %s is not used (%s); building into a private folder",
                        cache.root, exc)
    return Path(tempfile.mkdtemp(prefix="flashjit-host-")), None


def _build(command: list[str], source: Path, name: str, libs=()) -> bytes:
    """Compile source into a shared library in a scratch folder; its bytes. The compiler runs in a
    process group of its own (start_new_session), so at BUILD_TIMEOUT_S it is killed together with everything it started."""
    with tempfile.TemporaryDirectory(prefix="flashjit-build-") as scratch:
        built = Path(scratch) / name
        argv = [*command, "-o", str(built), str(source), *libs]
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as process:
            try:
                _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):  # a child that left the process group
                    process.communicate(timeout=5)
                raise subprocess.TimeoutExpired(argv, BUILD_TIMEOUT_S) from None
        if process.returncode != 0:
            raise BuildError(command, process.returncode, stderr)
        return built.read_bytes()
