"""Which CUDA major version (12 or 13) torch, CuPy and NVRTC are built for, and the extra that installs
the CuPy and NVRTC matching torch: `pip install 'flashjit[cu12]'` or `'flashjit[cu13]'`.

flashjit compiles with CuPy's NVRTC. Its base install names no CuPy, so that pip never adds a CuPy
for another CUDA than the user's torch; each extra brings one CuPy and the NVRTC wheel of its CUDA.
The NVRTC wheels lay their library out differently (CUDA 12: nvidia/cuda_nvrtc/lib, CUDA 13:
nvidia/cu13/lib); CuPy finds either through cuda-pathfinder, and this module reads both layouts to
report which are installed. Everything here is read without loading CuPy or NVRTC.
"""

from __future__ import annotations

import dataclasses
import os
import sys


@dataclasses.dataclass(frozen=True)
class Flavour:
    cuda: int            # the CUDA major version
    extra: str           # flashjit's extra that installs it
    cupy: str            # the CuPy distribution built for it
    nvrtc: str           # the NVRTC wheel's distribution
    nvrtc_library: str   # the NVRTC library inside that wheel, relative to site-packages


FLAVOURS = {
    12: Flavour(12, "cu12", "cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"),
    13: Flavour(13, "cu13", "cupy-cuda13x", "nvidia-cuda-nvrtc", "nvidia/cu13/lib/libnvrtc.so.13"),
}
DEFAULT_CUDA = 12  # the flavour for a torch built without CUDA (CPU-only machines compile with either)
CUPY_DISTRIBUTIONS = tuple(f.cupy for f in FLAVOURS.values()) + ("cupy",)  # "cupy": built from source
NVRTC_DISTRIBUTIONS = tuple(f.nvrtc for f in FLAVOURS.values())


def torch_cuda() -> str | None:
    """The CUDA version torch is built for ("12.8"), None for a CPU build or without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def major(version: str | None) -> int | None:
    return None if not version else int(str(version).split(".")[0])


def flavour_for(cuda_version: str | None) -> Flavour:
    """The flavour matching a torch CUDA version (a CPU build's: the default); a CUDA flashjit has no
    flavour for raises, naming the ones it has."""
    wanted = major(cuda_version) or DEFAULT_CUDA
    if wanted not in FLAVOURS:
        raise ValueError(f"torch is built for CUDA {cuda_version}; flashjit's flavours are for CUDA "
                         f"{', '.join(map(str, FLAVOURS))}")
    return FLAVOURS[wanted]


def installed_versions(names, folders=None) -> dict[str, str]:
    """{distribution: version} of those of `names` installed in folders (default sys.path), read from
    their *.dist-info folder names (importlib.metadata costs ~20 ms to import)."""
    wanted = {_normalized(name): name for name in names}
    found: dict[str, str] = {}
    for folder in sys.path if folders is None else folders:
        try:
            entries = os.listdir(folder or ".")
        except OSError:  # zip files, missing folders
            continue
        for entry in entries:
            if entry.endswith((".dist-info", ".egg-info")):
                dist, _, version = entry.rsplit(".", 1)[0].partition("-")
                name = wanted.get(_normalized(dist))
                if name is not None:
                    found.setdefault(name, version)
    return found


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")  # PEP 503, as dist-info folder names spell it


def nvrtc_wheel_libraries(folders=None) -> dict[int, str]:
    """{CUDA major: path} of the NVRTC wheel libraries found in folders (default sys.path), either layout."""
    found: dict[int, str] = {}
    for folder in sys.path if folders is None else folders:
        for cuda, flavour in FLAVOURS.items():
            path = os.path.join(folder or ".", flavour.nvrtc_library)
            if cuda not in found and os.path.isfile(path):
                found[cuda] = path
    return found


def cupy_flavours(installed: dict[str, str]) -> list[Flavour]:
    """The flavours of the CuPy distributions among installed (installed_versions' result)."""
    return [f for f in FLAVOURS.values() if f.cupy in installed]


def install_hint(cuda_version: str | None = None) -> str:
    """What to install for torch's CUDA (default: the torch found here)."""
    cuda_version = torch_cuda() if cuda_version is None else cuda_version
    try:
        flavour = flavour_for(cuda_version)
    except ValueError as exc:
        return str(exc)
    built = f"torch here is built for CUDA {cuda_version}" if cuda_version else "torch here is a CPU build"
    others = " or ".join(f"'flashjit[{f.extra}]'" for f in FLAVOURS.values() if f is not flavour)
    return f"pip install 'flashjit[{flavour.extra}]' ({built}; {others} for CUDA {_other_cudas(flavour)})"


def _other_cudas(flavour: Flavour) -> str:
    return ", ".join(str(cuda) for cuda in FLAVOURS if cuda != flavour.cuda)


def require_cupy() -> None:
    """Import CuPy, or raise ImportError saying which extra installs the CuPy matching torch."""
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"flashjit compiles and loads its kernels with CuPy, which does not import here "
                          f"({exc}): {install_hint()}") from exc


def agreement(torch_version: str | None, installed: dict[str, str], nvrtc: tuple[int, int] | None) -> list[str]:
    """What disagrees among torch's CUDA, the CuPy installed and the NVRTC loaded; [] when they agree.
    A CPU torch agrees with any one CuPy."""
    problems = []
    cupys = cupy_flavours(installed)
    wanted = major(torch_version)
    if len(cupys) > 1:
        problems.append(f"several CuPy packages ({', '.join(f.cupy for f in cupys)}): keep one")
    elif not cupys and "cupy" not in installed:
        problems.append("no CuPy")
    if wanted is not None and cupys and all(f.cuda != wanted for f in cupys):
        problems.append(f"torch is built for CUDA {torch_version}, CuPy for CUDA {cupys[0].cuda}")
    if nvrtc is not None and len(cupys) == 1 and nvrtc[0] != cupys[0].cuda:
        problems.append(f"{cupys[0].cupy} loaded NVRTC {nvrtc[0]}.{nvrtc[1]}")
    return problems


def doctor_rows(nvrtc: tuple[int, int] | None) -> tuple[list[tuple[str, str]], bool]:
    """`flashjit doctor`'s rows about the flavour (nvrtc: the loaded NVRTC's version, None if none
    loads), and whether torch, CuPy and NVRTC agree."""
    torch_version = torch_cuda()
    installed = installed_versions(CUPY_DISTRIBUTIONS + NVRTC_DISTRIBUTIONS)
    cupys = [f"{name} {installed[name]}" for name in CUPY_DISTRIBUTIONS if name in installed]
    wheels = nvrtc_wheel_libraries()
    rows = [("torch-cuda", torch_version or "none (a CPU build)"),
            ("cupy-packages", ", ".join(cupys) or "NOT INSTALLED"),
            ("nvrtc-wheels", ", ".join(f"CUDA {cuda}: {path}" for cuda, path in sorted(wheels.items())) or "none")]
    problems = agreement(torch_version, installed, nvrtc)
    cupy_flavour = cupy_flavours(installed)
    if problems:
        remove = " ".join(f.cupy for f in cupy_flavour)
        fix = f"pip uninstall {remove}; {install_hint()}" if remove else install_hint()
        rows.append(("cuda-flavour", f"MISMATCH: {'; '.join(problems)}. Fix: {fix}"))
    else:
        extra = cupy_flavour[0].extra if cupy_flavour else flavour_for(torch_version).extra
        rows.append(("cuda-flavour", f"{extra}: torch, CuPy and NVRTC agree"))
    return rows, not problems
