"""The kernels' layouts are checked where they live: every tensor-core and MLA kernel source asserts,
value by value, that its own constexpr functions and constants equal flashjit.jit.layouts' (the
formulas the CPU layout tests replay), so changing a value on the Python side fails the NVRTC
compile with a message naming it, as the ABI checks do for the argument structs (test_abi.py)."""

from __future__ import annotations

import pytest

from flashjit import CompileError, DecodeSpec
from flashjit.kernels import layouts
from flashjit.jit.compile import compile_source
from flashjit.kernels.mla.spec import MLASpec
from flashjit.kernels.mla.tiling import mla_tiling
from flashjit.jit.render import render
from flashjit.kernels.decode.tiling import decode_tiling

FP8 = DecodeSpec(128, kv_dtype="e4m3", group_size=4, arch="sm_90")
SHARED = DecodeSpec(64, group_size=4, arch="sm_90", shared_prefix=True)  # the warpgroup kernel
MLA = MLASpec(num_heads=16, kv_dtype="e4m3", arch="sm_90")


def compile_log(spec, tmp_path) -> str:
    try:
        compile_source(render(spec), spec.compile_arch, spec.name, failed_source_dir=tmp_path)
    except CompileError as exc:
        return exc.log
    return ""


def test_each_kernel_asserts_its_layouts_and_cuda_cores_have_none():
    assert decode_tiling(SHARED).shared_wgmma and mla_tiling(MLA).rows == 16
    fp8, shared, mla = render(FP8), render(SHARED), render(MLA)
    assert fp8.count("static_assert(decode::k_byte(") == 128 // 16 * 4
    assert fp8.count("static_assert(decode::o_dim(") == 128 // 16 * 16
    assert 'static_assert(decode::k_byte(3, 1) == 44, "layout: decode::k_byte(3, 1) is not ' in fp8
    assert "static_assert(decode::block_major_offset(" in shared and "static_assert(decode::swizzled_chunk(" in shared
    for name in ("mla::swizzled(7, 71)", "mla::operand_offset<32>(31, 8)", "mla::LatentCopies<128>::CPT", "mla::KW"):
        assert f"static_assert({name} == " in mla, name
    cuda_cores = render(DecodeSpec(128, arch="sm_90", tensor_cores=False))
    assert "layout:" not in cuda_cores and "The kernel's layouts" not in cuda_cores


@pytest.mark.parametrize("spec", [FP8, SHARED, MLA], ids=lambda s: s.name)
def test_the_real_layouts_compile(spec, tmp_path):
    assert compile_log(spec, tmp_path) == ""


def off_by_one(function, at):
    """function, with the value at argument tuple `at` one more."""
    return lambda *args: function(*args) + (args == at)


@pytest.mark.parametrize("spec, name, at, message", [
    (FP8, "fp8_k_byte", (128, 5, 2), "layout: decode::k_byte(5, 2) is not flashjit.jit.layouts.fp8_k_byte(128, 5, 2)"),
    (FP8, "fp8_o_dim", (128, 3, 9), "layout: decode::o_dim(3, 9) is not flashjit.jit.layouts.fp8_o_dim(128, 3, 9)"),
    (SHARED, "block_major_offset", (64, 128, 1, 9, 16), "layout: decode::block_major_offset(64, 128, 1, 9, 16)"),
    (SHARED, "swizzled_chunk", (7, 2, 8), "layout: decode::swizzled_chunk(7, 2) is not"),
    (MLA, "mla_swizzled", (3, 40), "layout: mla::swizzled(3, 40) is not flashjit.jit.layouts.mla_swizzled(3, 40)"),
    (MLA, "mla_operand_offset", (False, 16, 8, 5), "layout: mla::operand_offset<16>(8, 5)"),
])
def test_a_python_value_changed_alone_fails_the_compile(spec, name, at, message, tmp_path, monkeypatch):
    monkeypatch.setattr(layouts, name, off_by_one(getattr(layouts, name), at))
    log = compile_log(spec, tmp_path)
    assert "static assertion failed" in log and message in log


def test_a_loader_constant_changed_alone_fails_the_compile(tmp_path, monkeypatch):
    original = layouts.mla_loader
    monkeypatch.setattr(layouts, "mla_loader", lambda *args: {**original(*args), "TPK": 8})
    assert "layout: mla::LatentCopies<128>::TPK is not" in compile_log(MLA, tmp_path)
