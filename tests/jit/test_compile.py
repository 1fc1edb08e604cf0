"""NVRTC compile: cubins per arch with no GPU; failures carry the log and the saved source."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import tempfile

import pytest

from flashjit import CompileError, DecodeSpec, FlashJITError, register_mask
from flashjit.jit.compile import (BASE_OPTIONS, COMPILER_DISTRIBUTIONS, compile_options, compile_source,
                              compiler_fingerprint, nvrtc_version)
from flashjit.jit.render import render
from flashjit.kernels.decode.tiling import decode_tiling

BAD_SOURCE = 'extern "C" __global__ void broken(int* out) {\n  out[0] = this_is_not_declared;\n}\n'


def cubin_sm(cubin: bytes) -> int:
    """The SM number an NVIDIA cubin's ELF header records (low byte of e_flags)."""
    assert cubin[:4] == b"\x7fELF", "not an ELF cubin"
    return struct.unpack_from("<I", cubin, 0x30)[0] & 0xFF


def test_nvrtc_version():
    major, minor = nvrtc_version()
    assert major >= 12 and minor >= 0


def test_compile_options():
    assert compile_options("sm_90") == ("-arch=sm_90",) + BASE_OPTIONS
    assert compile_options("sm_80")[0] == "-arch=sm_80"


def test_bad_source_raises_compile_error_with_log_and_saved_source(tmp_path):
    with pytest.raises(CompileError) as info:
        compile_source(BAD_SOURCE, "sm_90", "broken_kernel", failed_source_dir=tmp_path / "failed")
    error = info.value
    assert isinstance(error, FlashJITError)
    assert error.spec_name == "broken_kernel"
    assert "error" in error.log and "this_is_not_declared" in error.log
    assert error.source_path.parent == tmp_path / "failed"
    assert error.source_path.is_file() and error.source_path.read_text() == BAD_SOURCE
    assert str(error.source_path) in str(error) and "error" in str(error)


def test_failed_source_falls_back_to_temp_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "blocker").write_text("a file, so no folder can be made under it")
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    with pytest.raises(CompileError) as info:
        compile_source(BAD_SOURCE, "sm_80", "broken_kernel", failed_source_dir=tmp_path / "blocker" / "failed")
    path = info.value.source_path
    assert path.is_file() and path.read_text() == BAD_SOURCE
    assert path.parent == tmp_path / "tmp" / f"flashjit-failed-{os.geteuid()}"  # this user's, never a shared one


def test_sm80_cubin(warm):
    spec = warm.spec.replace(arch="sm_80")
    compiled = compile_source(render(spec), "sm_80", spec.name)
    assert cubin_sm(compiled.cubin) == 80
    assert isinstance(compiled.log, str)
    assert compiled.cubin != warm.kernel.cubin


def test_sm90_cubin(warm):
    # compiled once per test run by the `warm` fixture, through the same compile_source
    assert warm.spec.arch == "sm_90"
    assert cubin_sm(warm.kernel.cubin) == 90
    assert b"flashjit_decode" in warm.kernel.cubin


def test_merge_entry_only_where_the_decode_kernel_does_not_merge(warm):
    """A tensor-core spec merges split requests in its decode kernel: its cubin carries no
    flashjit_merge (ptxas would spend ~10% of the compile on it). The CUDA-core kernel needs it."""
    tc = warm.spec.replace(tensor_cores=True)
    cuda_cores = warm.spec.replace(tensor_cores=False)
    assert decode_tiling(tc).fused_merge and not decode_tiling(cuda_cores).fused_merge
    assert b"flashjit_merge" not in compile_source(render(tc), "sm_90", tc.name).cubin
    assert b"flashjit_merge" in compile_source(render(cuda_cores), "sm_90", cuda_cores.name).cubin


@pytest.mark.parametrize("head_dim, dtype, mask", [(256, "bf16", "none"), (256, "fp16", "sink_window"),
                                                    (128, "bf16", "tree")])
def test_16bit_tensor_core_kernels_compile_without_spills_below_the_register_limit(head_dim, dtype, mask):
    """At head_dim 256 each slice of keys is shared by two warps, each holding half of O: one warp
    holding all of it would sit at the 255-register limit, where ptxas takes over a second."""
    spec = DecodeSpec(head_dim, dtype, mask=mask, group_size=8, max_q_len=2, page_size=16, arch="sm_90")
    tiling = decode_tiling(spec)
    assert tiling.tensor_cores and tiling.tile_tokens == 16 * tiling.threads // 32 // tiling.col_split
    log = compile_source(render(spec), "sm_90", spec.name, extra_options=("--ptxas-options=-v",)).log
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    assert spills and not any(spills) and registers and max(registers) <= 240, log


def test_timeline_stamps_compile_in_only_on_request(warm):
    """-DFJ_TIMELINE (benchmarks/cta_timeline.py) adds the stamps' buffer; the kernels built without
    it carry none of it."""
    stamped = compile_source(render(warm.spec), "sm_90", warm.spec.name, extra_options=("-DFJ_TIMELINE",)).cubin
    assert b"fj_timeline" in stamped and b"fj_timeline" not in warm.kernel.cubin


def test_compile_error_from_engine_saves_source_in_cache(isolated_masks, tmp_path, engine):
    path = tmp_path / "wrong.cuh.j2"
    path.write_text('{% extends "masks/base.cuh.j2" %}\n{% block visible %}  return no_such_symbol;{% endblock %}\n')
    register_mask("wrong_mask", path)
    spec = DecodeSpec(64, mask="wrong_mask", arch="sm_90")
    with pytest.raises(CompileError) as info:
        engine.get_kernel(spec)
    assert "no_such_symbol" in info.value.log
    assert info.value.source_path.parent == engine.cache.base / "failed"
    assert info.value.source_path.read_text() == engine.source(spec)
    assert engine.cache.entries() == []  # nothing half-made was stored


# ---- compiler fingerprint (the cache index's stand-in for the NVRTC version) ---------------------

def test_compiler_fingerprint_names_the_installed_versions():
    import importlib.metadata

    fingerprint = compiler_fingerprint()
    for name in COMPILER_DISTRIBUTIONS:
        try:
            assert f"{name}={importlib.metadata.version(name)}" in fingerprint
        except importlib.metadata.PackageNotFoundError:
            assert f"{name}=" not in fingerprint


def test_compiler_fingerprint_is_cheap_and_loads_no_cupy():
    """Measured in a fresh process: the first call (the one a warm start pays) and its imports."""
    code = ("import sys, time; from flashjit.jit.compile import compiler_fingerprint; t = time.perf_counter(); "
            "compiler_fingerprint(); t = time.perf_counter() - t; "
            "print(t, 'cupy' in sys.modules, 'importlib.metadata' in sys.modules)")
    seconds, cupy, metadata = subprocess.check_output([sys.executable, "-c", code], text=True).split()
    assert cupy == "False" and metadata == "False"
    assert float(seconds) < 0.02  # ~0.3-1 ms; generous for a loaded CPU


def test_compiler_fingerprint_changes_with_an_nvrtc_upgrade(tmp_path, monkeypatch):
    def fingerprint_with(*folders):
        monkeypatch.setattr(sys, "path", [str(tmp_path / "nowhere")] + [str(f) for f in folders])
        compiler_fingerprint.cache_clear()
        return compiler_fingerprint()

    old, new, toolkit = tmp_path / "old", tmp_path / "new", tmp_path / "toolkit"
    for folder, nvrtc in ((old, "12.8.93"), (new, "12.9.86")):
        (folder / "cupy_cuda12x-14.2.0.dist-info").mkdir(parents=True)
        (folder / f"nvidia_cuda_nvrtc_cu12-{nvrtc}.dist-info").mkdir()
    (toolkit / "cupy_cuda12x-14.2.0.dist-info").mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-12.4"))
    try:
        assert fingerprint_with(old) == "cupy-cuda12x=14.2.0;nvidia-cuda-nvrtc-cu12=12.8.93"
        assert fingerprint_with(new) == "cupy-cuda12x=14.2.0;nvidia-cuda-nvrtc-cu12=12.9.86"
        assert fingerprint_with(new, old).endswith("12.9.86")  # the first on sys.path wins, as for imports
        assert f"toolkit={tmp_path / 'cuda-12.4'}," in fingerprint_with(toolkit)  # no NVRTC wheel: the toolkit's path
    finally:
        compiler_fingerprint.cache_clear()


@pytest.mark.parametrize("head_dim, dtype, mask, q_len", [(128, "bf16", "none", 1), (64, "fp16", "causal", 3)])
def test_shared_prefix_kernels_on_hopper_compile_their_warpgroup_mmas_for_sm90a(head_dim, dtype, mask, q_len):
    """The shared records' wgmma path: rendered only where the tiling takes it, compiled for sm_90a
    with no spills and no MMA serialized by ptxas; the same kernel on sm_80 has no wgmma."""
    spec = DecodeSpec(head_dim, dtype, mask=mask, group_size=4, max_q_len=q_len, page_size=16, arch="sm_90",
                      tensor_cores=True, shared_prefix=True)
    assert spec.compile_arch == "sm_90a"
    source = render(spec)
    shape = f"m64n{head_dim}k16.f32.{'bf16.bf16' if dtype == 'bf16' else 'f16.f16'}"
    assert "enum : bool { SHARED_WGMMA = true };" in source and shape in source
    compiled = compile_source(source, spec.compile_arch, spec.name, extra_options=("--ptxas-options=-v",))
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", compiled.log)]
    assert spills and not any(spills) and "Potential Performance Loss" not in compiled.log, compiled.log
    ampere = spec.replace(arch="sm_80")
    assert ampere.compile_arch == "sm_80" and "wgmma.mma_async" not in render(ampere)


@pytest.mark.parametrize("fields", [dict(head_dim=64, group_size=4, arch="sm_90"),
                                    dict(head_dim=64, tensor_cores=False, arch="sm_80"),
                                    dict(head_dim=128, kv_dtype="e4m3", group_size=8, arch="sm_90"),
                                    dict(head_dim=64, group_size=4, arch="sm_90", shared_prefix=True)],
                         ids=["tensor cores", "CUDA cores", "fp8", "shared prefix"])
def test_a_mask_that_fails_to_compile_shows_its_error_alone(isolated_masks, mask_file, tmp_path, fields):
    """The log of a broken mask holds the mask's error, not warnings about flashjit's own code
    (unused constants of the kernel's configuration, a variable only one kernel form sets)."""
    register_mask("wrong_mask", mask_file(tmp_path, "wrong_mask", "return kv_pos <= no_such_symbol;"))
    spec = DecodeSpec(mask="wrong_mask", **fields)
    with pytest.raises(CompileError) as info:
        compile_source(render(spec), spec.compile_arch, spec.name, failed_source_dir=tmp_path / "failed")
    diagnostics = [line for line in info.value.log.splitlines() if re.search(r"\b(warning|error)\b", line)]
    assert len(diagnostics) == 2 and 'identifier "no_such_symbol" is undefined' in diagnostics[0], info.value.log
    assert diagnostics[1].startswith("1 error detected")
