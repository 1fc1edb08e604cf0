"""CUDA 12 and 13 flavours: the extras, the NVRTC wheels' two layouts, the agreement `flashjit doctor`
reports, the error naming the extra when no CuPy imports, and (where `make test-cu13` built one) the
compile path under a CuPy and NVRTC for CUDA 13."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from flashjit import cuda_flavour
from flashjit.cuda_flavour import FLAVOURS, agreement, install_hint, installed_versions, nvrtc_wheel_libraries

ROOT = Path(__file__).resolve().parents[1]


def test_the_extras_install_each_flavours_cupy_and_nvrtc_and_the_base_none():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("cupy", "nvidia-cuda-nvrtc"))]
    for flavour in FLAVOURS.values():
        names = [d.split(">")[0].split("=")[0] for d in project["optional-dependencies"][flavour.extra]]
        assert names == [flavour.cupy, flavour.nvrtc]


def wheel_layout(site: Path, cuda: int) -> Path:
    library = site / FLAVOURS[cuda].nvrtc_library
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF")
    return library


def test_nvrtc_wheel_libraries_reads_both_layouts(tmp_path):
    cu12, cu13, empty = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    empty.mkdir()
    lib12, lib13 = wheel_layout(cu12, 12), wheel_layout(cu13, 13)
    assert lib12.as_posix().endswith("nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    assert lib13.as_posix().endswith("nvidia/cu13/lib/libnvrtc.so.13")
    assert nvrtc_wheel_libraries([str(empty), str(cu13), str(cu12)]) == {12: str(lib12), 13: str(lib13)}
    assert nvrtc_wheel_libraries([str(cu13)]) == {13: str(lib13)}
    assert nvrtc_wheel_libraries([str(empty), str(tmp_path / "missing")]) == {}


def test_installed_versions_reads_dist_info_names(tmp_path):
    (tmp_path / "cupy_cuda13x-14.2.0.dist-info").mkdir()
    (tmp_path / "nvidia_cuda_nvrtc-13.5.37.dist-info").mkdir()
    (tmp_path / "nvidia_cuda_nvrtc_cu12-12.9.86.dist-info").mkdir()
    found = installed_versions(cuda_flavour.CUPY_DISTRIBUTIONS + cuda_flavour.NVRTC_DISTRIBUTIONS, [str(tmp_path)])
    assert found == {"cupy-cuda13x": "14.2.0", "nvidia-cuda-nvrtc": "13.5.37", "nvidia-cuda-nvrtc-cu12": "12.9.86"}


@pytest.mark.parametrize("torch_cuda, installed, nvrtc, problem", [
    (None, {"cupy-cuda12x": "14"}, (12, 9), None),                  # a CPU torch takes either flavour
    (None, {"cupy-cuda13x": "14"}, (13, 5), None),
    ("12.8", {"cupy-cuda12x": "14"}, (12, 9), None),
    ("13.0", {"cupy-cuda13x": "14"}, (13, 5), None),
    ("13.0", {"cupy-cuda12x": "14"}, (12, 9), "torch is built for CUDA 13.0, CuPy for CUDA 12"),
    ("12.8", {"cupy-cuda12x": "14", "cupy-cuda13x": "14"}, (12, 9), "several CuPy packages"),
    ("13.0", {"cupy-cuda13x": "14"}, (12, 9), "cupy-cuda13x loaded NVRTC 12.9"),
    ("12.8", {}, None, "no CuPy"),
])
def test_agreement_names_what_disagrees(torch_cuda, installed, nvrtc, problem):
    problems = agreement(torch_cuda, installed, nvrtc)
    assert (problems == []) if problem is None else any(problem in p for p in problems)


@pytest.mark.parametrize("torch_cuda, extra", [("", "cu12"), ("12.8", "cu12"), ("13.0", "cu13"), ("13.2", "cu13")])
def test_install_hint_names_the_extra_for_torchs_cuda(torch_cuda, extra):  # "": a CPU build
    assert install_hint(torch_cuda).startswith(f"pip install 'flashjit[{extra}]'")
    with pytest.raises(ValueError, match="CUDA 11.8; flashjit's flavours are for CUDA 12, 13"):
        cuda_flavour.flavour_for("11.8")


def test_without_cupy_compiling_says_which_extra_to_install(monkeypatch, warm):
    from flashjit.jit.compile import compile_source
    from flashjit.jit.render import render

    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(ImportError, match=r"CuPy, which does not import here .*pip install 'flashjit\[cu12\]' "
                                          r"\(torch here is a CPU build; 'flashjit\[cu13\]' for CUDA 13\)"):
        compile_source(render(warm.spec), "sm_90", warm.spec.name)


def test_doctor_reports_the_flavour_rows():
    rows, agree = cuda_flavour.doctor_rows((12, 9))
    keys = [key for key, _ in rows]
    assert keys == ["torch-cuda", "cupy-packages", "nvrtc-wheels", "cuda-flavour"]
    verdict = dict(rows)["cuda-flavour"]
    assert agree == ("agree" in verdict) and (agree or verdict.startswith("MISMATCH"))


CU13_PYTHON = os.environ.get("FLASHJIT_CU13_PYTHON")


@pytest.mark.skipif(not CU13_PYTHON, reason="no CUDA 13 environment: `make test-cu13` builds one and runs this")
def test_the_cu13_flavour_compiles_a_kernel_with_nvrtc_13():
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from cupy.cuda import nvrtc\n"
            "from flashjit import DecodeSpec, cuda_flavour\n"
            "from flashjit.jit.compile import compile_source\n"
            "from flashjit.jit.render import render\n"
            "spec = DecodeSpec(head_dim=128, dtype='bf16', mask='causal', arch='sm_90')\n"
            "cubin = compile_source(render(spec), spec.compile_arch, spec.name).cubin\n"
            "print(nvrtc.getVersion()[0], cubin[:4] == b'\\x7fELF', sorted(cuda_flavour.nvrtc_wheel_libraries()))\n")
    result = subprocess.run([CU13_PYTHON, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr
    nvrtc_major, is_elf, layouts = result.stdout.split(maxsplit=2)
    assert (nvrtc_major, is_elf) == ("13", "True") and "13" in layouts
