"""The host replay's shared library: C++ source built with the host compiler, once per process.

Libraries go to a private temp folder that is removed at exit, named by the source's hash. The
source defines fj_walk (host_replay.HOST_WALK), the one function the replay calls.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

from ... import env


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
    stem = os.path.join(_host_dir, hashlib.sha256(source.encode()).hexdigest()[:16])
    with open(stem + ".cpp", "w") as f:
        f.write(source)
    proc = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", stem + ".cpp", "-o", stem + ".so"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
        return None, f"the mask's hooks do not compile for the host ({first.strip()})"
    lib = ctypes.CDLL(stem + ".so")
    lib.fj_walk.restype = ctypes.c_int
    return lib, None
