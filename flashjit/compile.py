"""NVRTC (through CuPy) from rendered CUDA source to a cubin for one arch.

Works with no GPU: NVRTC only needs the arch name. The prelude includes no headers, so the same
source compiles under NVRTC 12 (cupy-cuda12x) and NVRTC 13 (cupy-cuda13x).
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from pathlib import Path

from .errors import CompileError

BASE_OPTIONS = ("--std=c++17", "--use_fast_math")


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def compile_options(arch: str) -> tuple[str, ...]:
    return (f"-arch={arch}",) + BASE_OPTIONS


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    log: str  # NVRTC's log: warnings and, with --ptxas-options=-v, register and spill counts


def compile_source(source: str, arch: str, name: str, *, failed_source_dir=None,
                   extra_options: tuple[str, ...] = ()) -> CompiledKernel:
    """Compile to a cubin; on failure save the source and raise CompileError with the log."""
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
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    for candidate in ([Path(folder)] if folder else []) + [Path(tempfile.gettempdir()) / "flashjit-failed"]:
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            path = candidate / f"{name}-{digest}.cu"
            path.write_text(source)
            return path
        except OSError:
            continue
    return Path("<unsaved>")
