"""fp8 KV caches on the CPU: spec names, stage memory, compiles per arch, the
quantize helper and the scale checks. The kernels themselves run in tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from flashjit import DecodeSpec, SpecError
from flashjit import validation as checks
from flashjit.jit.compile import compile_source
from flashjit.serving.quantize import FP8_MAX, dequantize_kv, quantize_kv, quantize_latent
from flashjit.jit.render import render
from flashjit.kernels.decode.tiling import decode_tiling


@pytest.mark.parametrize("value, canonical", [
    ("e4m3", "float8_e4m3fn"), ("fp8", "float8_e4m3fn"), (torch.float8_e4m3fn, "float8_e4m3fn"),
    ("fp8_e5m2", "float8_e5m2"), (torch.float8_e5m2, "float8_e5m2"), ("float8_e5m2", "float8_e5m2"),
])
def test_fp8_kv_dtypes_normalize_and_round_trip_through_names(value, canonical):
    spec = DecodeSpec(128, dtype="bf16", kv_dtype=value, group_size=4, arch="sm_90")
    assert spec.kv_dtype == canonical and spec.kv_is_fp8 and spec.kv_bytes == 1
    assert f"_kv{canonical[7:11]}_" in spec.name
    assert DecodeSpec.from_name(spec.name) == spec


def test_an_fp8_output_dtype_is_refused_naming_query_fp8():
    with pytest.raises(SpecError, match="query_fp8=True") as info:
        DecodeSpec(128, dtype=torch.float8_e4m3fn, kv_dtype="e4m3", arch="sm_90")
    assert info.value.field == "dtype" and "bfloat16" in info.value.accepted


# ---- e4m3 queries (query_fp8: vLLM quantizes the queries for an fp8 cache) ---------------------------

def test_e4m3_query_specs_name_their_queries_and_keep_the_others_keys():
    spec = DecodeSpec(128, dtype="bf16", kv_dtype="e4m3", mask="causal", group_size=4, arch="sm_90", query_fp8=True)
    plain = spec.replace(query_fp8=False)
    assert spec.name == plain.name + "_fp8q" and DecodeSpec.from_name(spec.name) == spec
    assert spec.q_dtype == "float8_e4m3fn" and spec.dtype == "bfloat16" and plain.q_dtype == "bfloat16"
    assert "query_fp8" in repr(spec) and "query_fp8" not in repr(plain)  # the others' digests stay as they were
    assert spec.digest != plain.digest


@pytest.mark.parametrize("changes, reason", [
    (dict(kv_dtype="bf16"), "kv_dtype=bfloat16"), (dict(kv_dtype="e5m2"), "kv_dtype=float8_e5m2"),
    (dict(tensor_cores=False), "tensor_cores=False"), (dict(arch="sm_80"), "arch=sm_80"),
    (dict(arch="sm_86"), "arch=sm_86"),
])
def test_e4m3_queries_are_refused_where_no_kernel_reads_them(changes, reason):
    args = dict(head_dim=128, dtype="bf16", kv_dtype="e4m3", group_size=4, arch="sm_90", query_fp8=True)
    with pytest.raises(SpecError, match=reason) as info:
        DecodeSpec(**{**args, **changes})
    assert info.value.field == "query_fp8" and "e4m3 cache" in info.value.accepted


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_120"])
@pytest.mark.parametrize("head_dim, group, q_len", [(64, 1, 1), (96, 4, 1), (128, 4, 1), (128, 8, 4), (256, 8, 2)])
def test_e4m3_query_kernels_read_two_byte_pairs_and_convert_them(arch, head_dim, group, q_len):
    spec = DecodeSpec(head_dim, dtype="bf16", kv_dtype="e4m3", group_size=group, max_q_len=q_len, arch=arch,
                      query_fp8=True)
    source = render(spec)
    assert "typedef fj::e4m3_t q_t;" in source and "typedef fj::bfloat16_t out_t;" in source
    ptx = ptx_of(spec)
    assert re.search(r"ld\.global(\.nc)?\.u16", ptx), "the queries load as pairs of bytes"
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    plain = ptx_of(spec.replace(query_fp8=False))
    assert not re.search(r"ld\.global(\.nc)?\.u16", plain)  # 16-bit queries load as words
    if arch == "sm_90":
        compiled = compile_source(source, arch, spec.name, extra_options=("--ptxas-options=-v",))
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", compiled.log)]
        assert spills and not any(spills), compiled.log


# ---- tiling (the kernel's register layouts and pitches: tests/test_fp8_layout.py) -------------------

@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_stage_memory_fits_two_ctas_per_sm(head_dim):
    tiling = decode_tiling(DecodeSpec(head_dim, kv_dtype="e4m3", group_size=4, arch="sm_90"))
    assert tiling.tensor_cores and tiling.smem_bytes <= 227 * 1024 // 2 - 1024
    assert tiling.smem_bytes >= tiling.stages * tiling.tile_tokens * (tiling.k_pitch + tiling.v_pitch)


# ---- compiles ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kv_dtype, head_dim, group, q_len", [
    ("e4m3", 128, 4, 1), ("e5m2", 128, 8, 1), ("e4m3", 64, 4, 1), ("e4m3", 256, 4, 1),  # tensor cores, 8 rows
    ("e4m3", 128, 8, 2), ("e5m2", 64, 4, 3), ("e4m3", 256, 8, 2),                     # 2 row tiles
    ("e4m3", 128, 1, 1), ("e5m2", 96, 4, 1),                                         # CUDA cores
])
def test_fp8_kernels_compile_without_spills(arch, kv_dtype, head_dim, group, q_len):
    """sm_80 takes the bit-manipulation conversion, sm_90 the paired hardware one."""
    spec = DecodeSpec(head_dim, dtype="bf16", kv_dtype=kv_dtype, group_size=group, max_q_len=q_len, arch=arch)
    source = render(spec)
    assert "typedef fj::%s_t kv_t;" % kv_dtype in source
    compiled = compile_source(source, arch, spec.name, extra_options=("--ptxas-options=-v",))
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", compiled.log)]
    assert spills and not any(spills), compiled.log


def ptx_of(spec) -> str:
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(render(spec), "k.cu", [], [])
    try:
        nvrtc.compileProgram(program, [f"-arch=compute_{spec.arch_number}", "--std=c++17"])
        return nvrtc.getPTX(program).decode()
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.parametrize("arch, native", [("sm_80", False), ("sm_86", False), ("sm_89", True), ("sm_90", True)])
def test_e4m3_uses_the_paired_hardware_conversion_from_sm89(arch, native):
    ptx = ptx_of(DecodeSpec(128, kv_dtype="e4m3", group_size=4, arch=arch))
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == native
    # e5m2 needs no conversion instruction anywhere: its bytes are placed with prmt
    assert "e5m2x2" not in ptx_of(DecodeSpec(128, kv_dtype="e5m2", group_size=4, arch=arch))


# ---- quantize helper -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype, bound", [("float8_e4m3fn", 2.0 ** -4), ("float8_e5m2", 2.0 ** -3)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("per_head", [False, True])
def test_quantize_uses_the_full_range_and_round_trips(kv_dtype, bound, layout, per_head):
    gen = torch.Generator().manual_seed(0)
    head_axis = 2 if layout == "NHD" else 1
    shape = [9, 16, 16, 64]
    shape[head_axis] = 3
    spread = torch.tensor([0.01, 1.0, 300.0]).reshape([-1 if d == head_axis else 1 for d in range(4)])
    cache = (torch.randn(shape, generator=gen) * spread).bfloat16()
    fp8, scale = quantize_kv(cache, kv_dtype, per_head=per_head, kv_layout=layout)
    assert fp8.dtype == getattr(torch, kv_dtype) and scale.dtype == torch.float32
    assert scale.shape == ((3,) if per_head else (1,))
    heads = fp8.float().abs().amax(dim=[d for d in range(4) if d != head_axis])
    if per_head:
        assert torch.equal(heads, torch.full((3,), FP8_MAX[kv_dtype]))
    else:
        assert heads.max() == FP8_MAX[kv_dtype]
    restored = dequantize_kv(fp8, scale, kv_layout=layout)
    # fp8 rounding: relative error <= 2^-(mantissa bits + 1) for values in the normal range
    x = cache.float()
    normal = x.abs() >= (scale.reshape(heads.shape[0] if per_head else 1, *(1,) * (3 - head_axis)) * 2.0 ** -6)
    relative = ((restored - x).abs() / x.abs().clamp_min(1e-30))[normal]
    assert relative.max() <= bound


def test_quantize_refuses_bad_caches():
    with pytest.raises(ValueError, match="cache: expected finite values"):
        quantize_kv(torch.tensor([float("inf")]).reshape(1, 1, 1, 1))
    with pytest.raises(ValueError, match="cache: expected 4 dimensions"):
        quantize_kv(torch.ones(2, 3))
    with pytest.raises(SpecError, match="kv_dtype"):
        quantize_kv(torch.ones(1, 1, 1, 8), "bf16")


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("largest", [1e-36, 1.2e-38, 3e-39, 1e-45])
def test_quantize_tiny_magnitudes_without_nan(kv_dtype, per_head, largest):
    """A cache whose largest magnitude is near or below float32's smallest normal (its scale was
    subnormal, its reciprocal infinite: 0 * inf gave NaN) gets the smallest normal scale."""
    cache = torch.zeros(2, 16, 2, 8)
    cache[0, 3, 1, 5], cache[1, 0, 0, 0] = largest, -largest / 2  # zeros beside them: the NaN of 0 * inf
    fp8, scale = quantize_kv(cache, kv_dtype, per_head=per_head)
    assert scale.isfinite().all() and (scale >= checks.FLOAT32_MIN_NORMAL).all() and (1 / scale).isfinite().all()
    restored = dequantize_kv(fp8, scale)
    assert not restored.isnan().any() and (restored[cache == 0] == 0).all()
    if largest >= checks.FLOAT32_MIN_NORMAL:  # a normal value keeps its fp8 precision's worth
        assert torch.allclose(restored, cache, rtol=0.15, atol=0)
    latent, latent_scale = quantize_latent(cache.reshape(2, 16, 16), kv_dtype)
    assert not (latent.float() * latent_scale).isnan().any()


@pytest.mark.parametrize("per_head", [False, True])
def test_quantize_an_empty_cache_gives_an_empty_one_and_the_scale_1(per_head):
    fp8, scale = quantize_kv(torch.empty(0, 16, 4, 8, dtype=torch.bfloat16), per_head=per_head)
    assert fp8.shape == (0, 16, 4, 8) and fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, torch.ones(4 if per_head else 1))
    latent, latent_scale = quantize_latent(torch.empty(0, 64, 576, dtype=torch.bfloat16))
    assert latent.shape == (0, 64, 576) and torch.equal(latent_scale, torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_quantize_refuses_a_cache_of_another_dtype_naming_it(dtype):
    already = r" \(an fp8 cache is quantized already: dequantize_kv gives its values\)" if dtype.is_floating_point else ""
    message = rf"^cache: expected a float16, bfloat16, float32 or float64 tensor{already}, got {dtype}$"
    with pytest.raises(ValueError, match=message):
        quantize_kv(torch.zeros(1, 16, 2, 8, dtype=dtype))
    with pytest.raises(ValueError, match=message):
        quantize_latent(torch.zeros(1, 16, 576, dtype=dtype))


# ---- run()'s scale arguments ---------------------------------------------------------------------------

def test_scale_forms():
    cpu = torch.device("cpu")
    assert checks.kv_scale("k_scale", None, num_kv_heads=8, device=cpu, required=False) == (1.0, 0, 0)
    assert checks.kv_scale("k_scale", 0.5, num_kv_heads=8, device=cpu, required=True) == (0.5, 0, 0)
    one, per_head = torch.ones(1), torch.ones(8)
    assert checks.kv_scale("k_scale", one, num_kv_heads=8, device=cpu, required=True) == (1.0, one.data_ptr(), 0)
    assert checks.kv_scale("v_scale", per_head, num_kv_heads=8, device=cpu, required=True) == (
        1.0, per_head.data_ptr(), 1)


@pytest.mark.parametrize("value, message", [
    (None, "k_scale: expected a scale for the fp8 cache"),
    (0, "k_scale: expected a positive float"),
    (float("nan"), "k_scale: expected a positive float"),
    (True, "k_scale: expected a positive float"),
    (torch.ones(3), "k_scale: expected 1 or num_kv_heads=8 contiguous values"),
    (torch.ones(16)[::2], "k_scale: expected 1 or num_kv_heads=8 contiguous values"),
    (torch.ones(1, dtype=torch.float64), "k_scale: expected dtype torch.float32"),
])
def test_bad_scales_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        checks.kv_scale("k_scale", value, num_kv_heads=8, device=torch.device("cpu"), required=True)


def test_scale_tensor_values_are_checked():
    checks.tensor_scale_values("v_scale", torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError, match=r"v_scale: expected positive finite values, got \[0.5, -2.0\]"):
        checks.tensor_scale_values("v_scale", torch.tensor([0.5, -2.0]))


def test_manifests_name_fp8_caches(tmp_path):
    from flashjit.deploy.manifest import specs_from_manifest

    path = tmp_path / "fp8.toml"
    path.write_text('archs = ["sm_90"]\n[[model]]\nname = "m"\nnum_qo_heads = 32\nnum_kv_heads = 8\nhead_dim = 128\n'
                    'dtype = "bf16"\nkv_dtype = "e4m3"\npage_sizes = [16]\nmasks = ["none"]\n')
    (spec,) = specs_from_manifest(path)
    assert spec.kv_dtype == "float8_e4m3fn" and spec.name == "decode_d128_bf16_kve4m3_none_p16_g4_q1_nhd_sm90_tc"
