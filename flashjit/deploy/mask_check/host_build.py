"""The host replay's shared library: C++ source built with the host compiler, once per process.

Built through the artifact lifecycle (jit/artifact.py) by host_library.SharedLibrary, into a
private temp folder that is removed at exit, named by the source's hash. The source defines
fj_walk (host_replay.HOST_WALK), the one function the replay calls.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import shutil
import tempfile
from pathlib import Path

from ... import env
from ...jit.artifact import obtain
from ...jit.host_library import BuildError, SharedLibrary
from ...jit.trusted_writes import write_file


def host_compiler() -> str | None:
    """$CXX, else c++ on PATH; None when there is none."""
    return shutil.which(env.cxx() or "c++")


_host_dir: str | None = None


@functools.lru_cache(maxsize=None)
def build_host_library(source: str):
    """Compile source into a shared library once per process; (library, None) or (None, why not)."""
    global _host_dir
    compiler = host_compiler()
    if compiler is None:
        return None, "no host C++ compiler (set CXX or install c++)"
    if _host_dir is None:
        _host_dir = tempfile.mkdtemp(prefix="flashjit-host-mask-")
        atexit.register(shutil.rmtree, _host_dir, True)
    stem = Path(_host_dir) / hashlib.sha256(source.encode()).hexdigest()[:16]
    write_file(stem.with_suffix(".cpp"), source.encode())
    library = SharedLibrary([compiler, "-std=c++17", "-O1", "-shared", "-fPIC"], stem.with_suffix(".cpp"),
                            stem.with_suffix(".so"))
    try:
        lib = obtain(library)[0]
    except BuildError as exc:
        first = next((line for line in exc.stderr.splitlines() if "error" in line), exc.stderr.strip()[:200])
        return None, f"the mask's hooks do not compile for the host ({first.strip()})"
    lib.fj_walk.restype = ctypes.c_int
    return lib, None
