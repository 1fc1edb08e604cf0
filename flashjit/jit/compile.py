"""NVRTC (through CuPy) from rendered CUDA source to a cubin for one arch.

Works with no GPU: NVRTC only needs the arch name. The prelude includes no headers, so the same
source compiles under NVRTC 12 (cupy-cuda12x) and NVRTC 13 (cupy-cuda13x).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
from pathlib import Path

from .. import cuda_flavour, env
from ..errors import CompileError

BASE_OPTIONS = ("--std=c++17", "--use_fast_math")
# Installed distributions that decide which NVRTC compiles: CuPy finds NVRTC through
# cuda-pathfinder, which prefers these wheels over a system CUDA toolkit.
NVRTC_DISTRIBUTIONS = cuda_flavour.NVRTC_DISTRIBUTIONS
COMPILER_DISTRIBUTIONS = cuda_flavour.CUPY_DISTRIBUTIONS + ("cuda-pathfinder",) + NVRTC_DISTRIBUTIONS


def nvrtc_version() -> tuple[int, int]:
    cuda_flavour.require_cupy()
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


@functools.lru_cache(maxsize=1)
def compiler_fingerprint() -> str:
    """Which NVRTC this process would compile with, found without loading CuPy or NVRTC.

    The cache index keys on it, so a CuPy or NVRTC upgrade misses the index and falls back to the
    full key (which holds the real NVRTC version) instead of serving a stale cubin. It reads the
    versions of COMPILER_DISTRIBUTIONS from the *.dist-info folder names on sys.path (~0.3 ms, once
    per process). With no NVRTC wheel installed, NVRTC comes from a CUDA toolkit, and its location
    (CUDA_HOME, CUDA_PATH, /usr/local/cuda resolved, which names the version on standard installs)
    stands in for its version.
    """
    found = cuda_flavour.installed_versions(COMPILER_DISTRIBUTIONS)
    parts = [f"{name}={found[name]}" for name in COMPILER_DISTRIBUTIONS if name in found]
    if not any(name in found for name in NVRTC_DISTRIBUTIONS):
        toolkit = [*env.cuda_toolkit(), "/usr/local/cuda"]
        parts.append("toolkit=" + ",".join(os.path.realpath(p) if p else "" for p in toolkit))
    return ";".join(parts)


def compile_options(arch: str) -> tuple[str, ...]:
    return (f"-arch={arch}",) + BASE_OPTIONS


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    log: str  # NVRTC's log: warnings and, with --ptxas-options=-v, register and spill counts


def compile_source(source: str, arch: str, name: str, *, failed_source_dir=None,
                   extra_options: tuple[str, ...] = ()) -> CompiledKernel:
    """Compile to a cubin; on failure save the source and raise CompileError with the log.

    The source goes to failed_source_dir (a folder the caller has checked by the trust rule, or
    None), else to this user's folder in the temp folder (trusted_writes.private_folder); it is
    written under the rule for writes, never through a link."""
    cuda_flavour.require_cupy()
    from cupy.cuda import nvrtc

    options = list(compile_options(arch) + tuple(extra_options))
    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program) or str(exc)
            raise CompileError(name, log, _save_failed_source(source, name, failed_source_dir)) from None
        return CompiledKernel(nvrtc.getCUBIN(program), nvrtc.getProgramLog(program) or "")
    finally:
        nvrtc.destroyProgram(program)


def _save_failed_source(source: str, name: str, folder) -> Path:
    from . import trusted_files, trusted_writes

    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    candidates = ([lambda: trusted_writes.make_folders(folder)] if folder else []) + [
        lambda: trusted_writes.private_folder("flashjit-failed")]
    for candidate in candidates:
        try:
            path = candidate() / f"{name}-{digest}.cu"
            trusted_writes.write_file(path, source.encode())
            return path
        except (OSError, trusted_files.Refused):
            continue
    return Path("<unsaved>")
