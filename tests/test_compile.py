"""NVRTC compile: cubins per arch with no GPU; failures carry the log and the saved source."""

from __future__ import annotations

import struct
import tempfile

import pytest

from flashjit import CompileError, DecodeSpec, FlashJITError, register_mask
from flashjit.compile import BASE_OPTIONS, compile_options, compile_source, nvrtc_version
from flashjit.render import render

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
    assert path.parent == tmp_path / "tmp" / "flashjit-failed"


def test_sm80_cubin(warm):
    spec = warm.spec.replace(arch="sm_80")
    compiled = compile_source(render(spec), "sm_80", spec.name)
    assert cubin_sm(compiled.cubin) == 80
    assert isinstance(compiled.log, str)
    assert compiled.cubin != warm.kernel.cubin


def test_sm90_cubin(warm):
    # compiled once for the session by the `warm` fixture, through the same compile_source
    assert warm.spec.arch == "sm_90"
    assert cubin_sm(warm.kernel.cubin) == 90
    assert b"flashjit_decode" in warm.kernel.cubin and b"flashjit_merge" in warm.kernel.cubin


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
