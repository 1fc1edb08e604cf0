"""`flashjit doctor`: versions, the GPU, the cache folder and one test compile, as a report."""

from __future__ import annotations

import os
import platform
import sys
import time

from .._version import __version__
from .cli_output import format_size, print_json


def module_version(module: str) -> str:
    """The module's __version__, or why it cannot be imported."""
    try:
        return __import__(module).__version__
    except Exception as exc:  # doctor reports, never crashes
        return f"not available ({type(exc).__name__}: {exc})"


def nvrtc_library() -> str:
    """Path of the loaded libnvrtc (cupy finds it through cuda-pathfinder)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libnvrtc.so" in line]
    except OSError:  # not Linux
        paths = []
    return paths[0] if paths else "?"


def cmd_doctor(args) -> int:
    from .. import cuda_flavour
    from ..jit.cache import KernelCache
    from ..jit.compile import compile_source, nvrtc_version
    from ..jit.render import render
    from ..kernels.decode.spec import DecodeSpec
    from ..jit.arch import current_arch

    ok = True
    rows = [("flashjit", __version__), ("python", f"{platform.python_version()} ({sys.executable})")]
    rows += [(module, module_version(module)) for module in ("torch", "cupy", "jinja2")]
    nvrtc = None
    try:
        nvrtc = nvrtc_version()
        rows.append(("nvrtc", ".".join(map(str, nvrtc)) + f" ({nvrtc_library()})"))
    except Exception as exc:
        ok = False
        rows.append(("nvrtc", f"NOT FOUND ({type(exc).__name__}: {exc}); {cuda_flavour.install_hint()}"))
    flavour_rows, flavour_ok = cuda_flavour.doctor_rows(nvrtc)  # torch's CUDA, CuPy's and NVRTC's agree?
    rows += flavour_rows
    ok = ok and flavour_ok

    arch = None
    try:
        import torch

        if torch.cuda.is_available():
            arch = current_arch()
            rows.append(("gpu", f"{torch.cuda.get_device_name()} ({arch}), torch CUDA {torch.version.cuda}"))
        else:
            rows.append(("gpu", "none (CPU only: kernels still compile; prewarm with --arch)"))
    except Exception as exc:
        rows.append(("gpu", f"unknown ({type(exc).__name__}: {exc})"))

    cache = KernelCache(args.cache_dir)
    rows.append(("cache dir", f"{cache.root} ({'writable' if cache.writable else 'NOT writable: memory only'}), "
                              f"{len(cache.entries())} entries"))

    target = arch or "sm_90"
    spec = DecodeSpec(head_dim=64, dtype="bf16", mask="none", page_size=16, group_size=1, arch=target)
    try:
        start = time.perf_counter()
        compiled = compile_source(render(spec), spec.compile_arch, spec.name)
        rows.append(("test compile", f"ok: {spec.name}, {format_size(len(compiled.cubin))} cubin "
                                     f"in {time.perf_counter() - start:.2f} s"))
    except Exception as exc:
        ok = False
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        rows.append(("test compile", f"FAILED: {first}"))
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLASHJIT_")}
    if args.json:
        print_json({**dict(rows), "env": env, "ok": ok})
        return 0 if ok else 1
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    for key, value in env.items():
        print(f"{'env'.ljust(width)}  {key}={value}")
    return 0 if ok else 1
