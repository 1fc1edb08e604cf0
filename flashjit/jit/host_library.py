"""Host-side C helpers (such as the work list's worklist/native/host_plan.c): built once with the
system C compiler, kept in the kernel cache folder, loaded with ctypes. The caller names the source
file, the defines it is built with and the functions it calls; nothing here knows which helpers exist.

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

A library must also export every function its caller names (the caller's symbols, since only it
knows what it calls): one built by a compiler that hides them (CC="gcc -fvisibility=hidden") is
refused after the build, before it is stored, and one in the cache that lacks them is a miss.

Strict mode (an engine that may not compile) builds nothing: it loads the library the cache holds
(`flashjit prewarm` and `flashjit cache import` build it there) or uses numpy.

A compiler never outlives its build: it runs under build_watchdog.py, which kills its process group
and removes the scratch folder when the build times out (BUILD_TIMEOUT_S) or the process that
started it dies, even by SIGKILL; scratch folders of builds killed harder than that are removed by
the next build once STALE_SCRATCH_S old. A library built outside the cache (a cache that cannot
take it) is built into a private temp folder, removed once the library is loaded. Other processes
wait at most HOST_LOCK_WAIT_S for the build lock, then use the numpy planner rather than wait for,
or start, a build of their own.

Each helper has a pure-Python reference that flashjit uses when the helper cannot be had: no C
compiler (`$CC`, else `cc`), a failed or timed-out build, missing symbols, a build lock held too
long, strict mode without a built library, or FLASHJIT_HOST_NATIVE=0. That costs speed, never
results; one warning says why.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import dataclasses
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .. import env
from . import keys, trusted_files, trusted_writes
from .artifact import obtain
from .cache import SCHEMA, KernelCache, LockBusy
from .trusted_writes import atomic_file

log = logging.getLogger("flashjit")

# No -ffast-math, and no fused multiply-adds: the helpers must round exactly as the Python references.
# A helper's defines follow these (host_plan.c: worklist.record.HOST_PLAN_DEFINES).
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off", "-fno-fast-math")
LIBS = ("-lm",)
BUILD_TIMEOUT_S = 60.0  # a build of one helper takes about a second; a compiler past this is hung
STALE_SCRATCH_S = 3600.0  # a scratch folder this old belongs to no running build
WATCHDOG = Path(__file__).with_name("build_watchdog.py")
HOST_LOCK_WAIT_S = 5.0  # how long another process's build is waited for before using numpy instead
MAX_LIBRARY_BYTES = 64 << 20
FALLBACK = "flashjit uses its numpy version instead (the same results, slower: ~100 us per plan() for host_plan)"

_loaded: dict[tuple, ctypes.CDLL | None] = {}  # (source, defines, symbols, cache, may build) -> the first outcome
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


def library_key(source: bytes, cc: list[str], defines=()) -> str:
    """keys.library_key of a helper built with cc, CFLAGS and its defines."""
    return keys.library_key(source, cc, (*CFLAGS, *defines))


@dataclasses.dataclass
class SharedLibrary:
    """A shared library built from one source file into `path`, as an artifact (see artifact.py).

    command: the compiler and its flags; `-o OUT SOURCE` and libs follow it. cache: whose file
    lock guards the build and whose root the trust check starts from (None: a private folder,
    where no other process builds, checked from `path`'s folder). symbols: functions the library
    must export; one that lacks any is not used.
    """

    command: list[str]
    source: Path
    path: Path
    cache: KernelCache | None = None
    libs: tuple[str, ...] = ()
    symbols: tuple[str, ...] = ()
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
            library = ctypes.CDLL(str(path))
        except OSError as exc:  # a truncated file, a foreign writer: a miss, built again
            self._warn_once("flashjit host helper %s does not load (%s); rebuilding it", self.path, exc)
            return None
        return library if not _missing(library, self.symbols) else None  # built by a compiler that hid them

    def lock(self):
        """The cache's build lock, waited for HOST_LOCK_WAIT_S at most (then LockBusy)."""
        if self.cache is None:
            return contextlib.nullcontext()
        return self.cache.compile_lock(self.path.stem, give_up_after=HOST_LOCK_WAIT_S)

    def build(self) -> bytes:
        """The library's bytes. Raises BuildError (MissingSymbols for a library that lacks
        `symbols`), subprocess.TimeoutExpired or OSError."""
        return _build(self.command, self.source, self.path.name, self.libs, self.symbols)

    def store(self, built: bytes):
        with atomic_file(self.path) as f:
            f.write(built)

    def load_built(self, built: bytes) -> ctypes.CDLL:
        library = ctypes.CDLL(str(self._trusted_path()))
        missing = _missing(library, self.symbols)
        if missing:  # replaced since the build checked it
            raise MissingSymbols(self.command, missing)
        return library


class MissingSymbols(BuildError):
    """A library that builds and loads but does not export what its caller calls."""

    def __init__(self, command: list[str], missing: list[str]):
        RuntimeError.__init__(self, f"the library {shlex.join(command)} built does not export {', '.join(missing)} "
                                    "(does a compiler flag such as -fvisibility=hidden hide them?)")
        self.stderr = ""


def _missing(library: ctypes.CDLL, symbols) -> list[str]:
    return [name for name in symbols if not hasattr(library, name)]


def load(source: Path, cache: KernelCache | None = None, defines=(), symbols=(),
         build: bool = True) -> ctypes.CDLL | None:
    """The helper built from the C file source (with -D defines) as a loaded library that exports
    every name in symbols, or None (with one warning) when it cannot be built or loaded.
    build=False (strict mode) only loads the library the cache holds. The first outcome per
    source, defines, symbols and cache folder is kept for the process."""
    key = (str(source), tuple(defines), tuple(symbols), None if cache is None else str(cache.base), build)
    with _load_lock:
        if key not in _loaded:
            _loaded[key] = _build_and_load(Path(source), cache, tuple(defines), tuple(symbols), build)
        return _loaded[key]


def _build_and_load(source: Path, cache: KernelCache | None, defines: tuple, symbols: tuple,
                    build: bool) -> ctypes.CDLL | None:
    name = source.stem
    if not env.host_native():
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (CC=%r; set CC, or install cc) to build flashjit's host helper %s: %s",
                    env.cc(), name, FALLBACK)
        return None
    file_name = f"{name}-{library_key(source.read_bytes(), cc, defines)}.so"

    def library(folder: Path, lock_cache: KernelCache | None) -> SharedLibrary:
        return SharedLibrary([*cc, *CFLAGS, *defines], source, folder / file_name, lock_cache, LIBS, symbols)

    try:
        if cache is not None and (not cache.writable or not build):  # a read-only cache still serves what it holds
            held = library(cache.base / "host", cache).load()
            if held is not None:
                return held
        if not build:
            where = f"the kernel cache at {cache.root}" if cache is not None else "a kernel cache"
            log.warning("flashjit's host helper %s is not in %s and compiling is disabled (strict mode): %s; "
                        "`flashjit prewarm` or `flashjit cache import` with that cache builds it", name, where, FALLBACK)
            return None
        folder = _cache_folder(cache)
        if folder is not None:
            return obtain(library(folder, cache))[0]
        with tempfile.TemporaryDirectory(prefix="flashjit-host-") as private:  # gone once loaded: the mapping stays
            return obtain(library(Path(private), None))[0]
    except LockBusy as exc:
        log.warning("flashjit's host helper %s is being built by another process (%s): %s", name, exc, FALLBACK)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("could not build or load flashjit's host helper %s (%s): %s", name, exc, FALLBACK)
    return None


def _cache_folder(cache: KernelCache | None) -> Path | None:
    """The cache's host folder, made and checked by the trust rule; None when the library has to be
    built privately (no cache, or one that cannot take it)."""
    if cache is not None and cache.writable:
        try:
            folder = trusted_writes.make_folders(cache.root, (f"v{SCHEMA}", "host"), follow=1)
            if os.access(folder, os.W_OK):
                return folder
        except (OSError, trusted_files.Refused) as exc:
            log.warning("flashjit's host helper folder in %s is not used (%s); building into a private folder",
                        cache.root, exc)
    return None


def _build(command: list[str], source: Path, name: str, libs=(), symbols=()) -> bytes:
    """Compile source into a shared library in a scratch folder; its bytes, once it exports
    `symbols`. The compiler runs under build_watchdog.py (see the module doc)."""
    _remove_stale_scratch()
    with tempfile.TemporaryDirectory(prefix="flashjit-build-") as scratch:
        built = Path(scratch) / name
        argv = [*command, "-o", str(built), str(source), *libs]
        watched = [sys.executable, "-I", "-S", str(WATCHDOG), str(os.getpid()), scratch, *argv] if sys.executable else argv
        with subprocess.Popen(watched, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as process:
            try:
                _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.terminate()  # the watchdog kills the compiler's process group
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.communicate(timeout=5)
                raise subprocess.TimeoutExpired(argv, BUILD_TIMEOUT_S) from None
        if process.returncode != 0:
            raise BuildError(command, process.returncode, stderr)
        if symbols:
            library = ctypes.CDLL(str(built))
            missing = _missing(library, symbols)
            _ctypes.dlclose(library._handle)
            if missing:
                raise MissingSymbols(command, missing)
        return built.read_bytes()


def _remove_stale_scratch():
    """Scratch folders of this user's builds that died too hard for their watchdog (STALE_SCRATCH_S old)."""
    folder = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in folder.glob("flashjit-build-*"):
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
                        and time.time() - st.st_mtime > STALE_SCRATCH_S):
                    shutil.rmtree(path, ignore_errors=True)
