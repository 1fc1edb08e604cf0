"""MLA decode on the CPU: the spec and its names, the tiling, the rendered source and real NVRTC
compiles, the engine's cache and prewarm, plan() over the shared planner, the reference's math
against a float64 computation from scratch, fp8 latents, and the HuggingFace configs."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from flashjit import SpecError
from flashjit.deploy.hf_mla import is_mla_config, read_mla_config
from flashjit.deploy.manifest import ManifestError
from flashjit.kernels.mla import args as mla_args
from flashjit.worklist.record import PlanArgs
from flashjit.jit.compile import compile_source
from flashjit.jit.family import mask_of, source_of, spec_from_name, tiling_of, variant_of
from flashjit.kernels.merge_states.spec import MergeSpec
from flashjit.kernels.mla.spec import MLASpec
from flashjit.kernels.decode.spec import DecodeSpec
from flashjit.kernels.mla.tiling import MLA_TUNING, cta_rows, mla_tiling
from flashjit.jit.arch import dynamic_shared_limit
from flashjit.jit.render import render
from flashjit.masks.registry import masks
from flashjit.worklist.host import HostPlanner, item_records
from flashjit.serving.mla_reference import mla_reference
from flashjit.serving.quantize import quantize_latent
from flashjit.worklist.split import plan_work

from cli_runner import run
from cpu_decoders import MLA_CTAS_PER_SM, NUM_SMS, cpu_mla, native_library, page_table
from repo_paths import HF_EXAMPLES

SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90


# ---- spec ------------------------------------------------------------------------------------

def test_spec_normalizes_and_names():
    spec = MLASpec(num_heads=16, dtype="bf16", kv_dtype="e4m3", page_size=64, max_q_len=2, arch="90")
    assert (spec.dtype, spec.kv_dtype, spec.arch) == ("bfloat16", "float8_e4m3fn", "sm_90")
    assert spec.name == "mla_c512_r64_h16_bf16_kve4m3_p64_q2_sm90"
    assert MLASpec.from_name(spec.name) == spec and spec_from_name(spec.name) == spec
    assert spec.mask == "causal" and spec.head_dim == 512 and spec.qk_dim == 576 and spec.kv_is_fp8
    assert MLASpec(num_heads=128, arch="sm_90").kv_dtype == "bfloat16"
    assert hash(spec) == hash(MLASpec.from_name(spec.name)) and spec.replace(num_heads=32).num_heads == 32
    decode = "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc"
    assert spec_from_name(decode).name == decode
    assert spec_from_name("merge_states_bf16_sm90") == MergeSpec("bfloat16", "sm_90")


def test_families_tell_the_three_spec_types_apart():
    """One engine path: each family's mask, variant, tiling and source come from its KernelFamily (jit/family.py)."""
    mla, merge = MLASpec(16, arch="sm_90"), MergeSpec("float16", "sm_90")
    decode = DecodeSpec(head_dim=64, mask="causal", variant="sinks", arch="sm_90")
    assert (mask_of(mla).name, variant_of(mla).name) == ("causal", "none") and tiling_of(mla).entry == "flashjit_mla"
    assert (mask_of(merge), variant_of(merge), tiling_of(merge)) == (None, None, None)
    assert variant_of(decode).name == "sinks" and tiling_of(decode).entry == "flashjit_decode"
    assert "mla::Args" in source_of(mla, mask_of(mla), variant_of(mla))
    assert "merge_states::Args" in source_of(merge, None, None)
    assert "VARIANT_SINK = true" in source_of(decode, mask_of(decode), variant_of(decode))
    with pytest.raises(TypeError, match="not a kernel spec"):
        tiling_of("decode_d64")


@pytest.mark.parametrize("fields, field", [
    (dict(num_heads=0), "num_heads"), (dict(num_heads=129), "num_heads"), (dict(num_heads=16.0), "num_heads"),
    (dict(max_q_len=5), "max_q_len"), (dict(page_size=0), "page_size"), (dict(kv_dtype="float16"), "kv_dtype"),
    (dict(dtype="e4m3"), "dtype"), (dict(kv_lora_rank=256), "kv_lora_rank"), (dict(rope_dim=128), "rope_dim"),
    (dict(arch="sm_70"), "arch"),
])
def test_spec_refusals_name_the_field(fields, field):
    with pytest.raises(SpecError) as info:
        MLASpec(**{"num_heads": 16, "arch": "sm_90", **fields})
    assert info.value.field == field and f"MLASpec.{field}=" in str(info.value)


def test_bad_names():
    for name in ("mla_c512_r64_h16", "mla_c512_r64_h16_bf16_kvbf16_p64_q9_sm90"):
        with pytest.raises(SpecError):
            spec_from_name(name)


# ---- tiling ----------------------------------------------------------------------------------

@pytest.mark.parametrize("heads, q_len, rows, row_tiles", [
    (4, 1, 16, 1), (8, 1, 16, 1), (16, 1, 16, 1), (16, 2, 32, 1), (32, 1, 32, 1), (16, 3, 64, 1),
    (64, 1, 64, 1), (128, 1, 64, 2), (128, 4, 64, 8), (32, 4, 64, 2),
])
@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
def test_tiling_shapes(heads, q_len, rows, row_tiles, kv):
    spec = MLASpec(num_heads=heads, kv_dtype=kv, max_q_len=q_len, arch="sm_90")
    t = mla_tiling(spec)
    assert tiling_of(spec) == t and cta_rows(heads * q_len) == rows
    assert (t.rows, t.row_tiles) == (rows, row_tiles)
    assert t.warps % t.m_tiles == 0 and (t.tile_tokens // t.key_slices) % 8 == 0 and (512 // t.warps) % 16 == 0
    stored = 576 * (1 if kv == "e4m3" else 2)
    assert t.ring_bytes == t.stages * t.tile_tokens * stored
    assert t.convert_bytes == (t.tile_tokens * 1152 if kv == "e4m3" else 0)
    assert t.smem_bytes + 2048 <= SMEM_LIMIT  # with the static arrays
    # The CTAs per SM the bounds ask for fit in 228 KiB: each with its arrays, static ones, and the 1 KiB the SM keeps
    assert t.min_ctas * (t.smem_bytes + 2048 + 1024) <= 233472
    assert t.grid(5) == (5, row_tiles, 1) and t.block == (32 * t.warps, 1, 1) and t.entry == "flashjit_mla"


def test_tuning_rows_cover_every_shape():
    for fp8 in (False, True):
        for rows in (16, 32, 64):
            assert MLA_TUNING.row(fp8, rows).key == (None, fp8, rows, False)  # every arch's rows
    assert MLA_TUNING.row(False, 64, wgmma=True).key == (None, False, 64, True)
    assert MLA_TUNING.with_rows(rows=64, stages=2).row(True, 64).stages == 2
    swept = MLA_TUNING.with_rows(rows=64, warps=4)  # the mma.sync rows only, unless wgmma=True
    assert swept.row(False, 64, wgmma=True).warps == 8 and swept.row(False, 64).warps == 4
    assert MLA_TUNING.with_rows(wgmma=True, stages=3).row(False, 64, wgmma=True).stages == 3


def test_a_row_tuned_for_one_arch_serves_that_arch_only():
    """A new GPU's constants are a row keyed by its arch: its specs take it, other archs keep theirs."""
    tuned = dataclasses.replace(MLA_TUNING.row(False, 16), arch="sm_100", stages=4)
    table = dataclasses.replace(MLA_TUNING, rows=MLA_TUNING.rows + (tuned,))
    assert table.row(False, 16, arch="sm_100") is tuned and table.row(False, 16, arch="sm_90").stages == 2
    spec = MLASpec(16, arch="sm_100")
    assert mla_tiling(spec, table).stages == 4 and mla_tiling(spec.replace(arch="sm_90"), table).stages == 2


# ---- render and compile ----------------------------------------------------------------------

def test_render_has_constants_abi_checks_and_entry():
    spec = MLASpec(num_heads=128, kv_dtype="e4m3", max_q_len=2, arch="sm_90")
    source = render(spec)
    assert source.startswith(f"// flashjit ") and spec.name in source.splitlines()[0]
    assert "constexpr int GROUP_SIZE = 128;" in source and "constexpr int QK_DIM = 576;" in source
    assert "typedef fj::e4m3_t kv_t;" in source and "flashjit_mla(mla::Args args)" in source
    assert f'sizeof(mla::Args) == {ctypes.sizeof(mla_args.MLAArgs)}' in source
    assert source.count("static_assert(FJ_OFFSETOF(mla::Args,") == len(mla_args.MLAArgs._fields_)
    assert source.count("static_assert(FJ_OFFSETOF(plan::Args,") == len(PlanArgs._fields_)
    assert "void __launch_bounds__(128) flashjit_merge" not in source and "merge::" not in source  # fused
    assert render(spec) == source  # deterministic


COMPILED = [MLASpec(num_heads=16, arch="sm_90"), MLASpec(num_heads=128, kv_dtype="e4m3", max_q_len=4, arch="sm_90"),
            MLASpec(num_heads=32, max_q_len=2, page_size=1, arch="sm_80"),
            MLASpec(num_heads=64, dtype="f16", kv_dtype="e5m2", page_size=16, arch="sm_90")]


@pytest.mark.parametrize("spec", COMPILED, ids=lambda s: s.name)
def test_nvrtc_compiles_without_spills(spec):
    """(Compile times are benchmarks.decode compile's.)"""
    compiled = compile_source(render(spec), spec.arch, spec.name, extra_options=("--ptxas-options=-v",))
    assert compiled.cubin[:4] == b"\x7fELF" and b"flashjit_mla" in compiled.cubin
    assert b"flashjit_plan" in compiled.cubin  # every module carries the GPU planner (kernel.Kernel loads it)
    assert "0 bytes spill stores" in compiled.log


@pytest.mark.parametrize("spec", [MLASpec(num_heads=128, arch="sm_90"), MLASpec(num_heads=16, arch="sm_90")],
                         ids=lambda s: s.name)
def test_the_merge_of_several_cells_at_once_compiles_without_spills(spec):
    """merge_cells > 1 (MLATuning: the last CTA's cells combined several at once), on the warpgroup
    and the mma.sync kernel."""
    tiling = mla_tiling(spec, dataclasses.replace(MLA_TUNING, merge_cells=4, merge_chunk=4))
    source = render(spec, masks.get(spec.mask), tiling)
    assert "constexpr int MERGE_CELLS = 4;" in source and "merge_partials_if_last<M, NT, cfg::MERGE_CELLS>" in source
    assert "constexpr int MERGE_CELLS = 1;" in render(spec)  # the default: one cell at a time
    compiled = compile_source(source, spec.compile_arch, spec.name, extra_options=("--ptxas-options=-v",))
    spills = [line for line in compiled.log.splitlines() if "spill stores" in line]
    assert spills and all(" 0 bytes spill stores" in line for line in spills)


def test_abi_struct_mismatch_fails_the_compile(monkeypatch):
    class Wrong(ctypes.Structure):
        _c_name_ = "mla::Args"
        _fields_ = [("q_nope", ctypes.c_void_p), ("q_pe", ctypes.c_void_p)] + [
            f for f in mla_args.MLAArgs._fields_ if f[0] not in ("q_nope", "q_pe")]
    monkeypatch.setattr(mla_args, "MLAArgs", Wrong)
    spec = COMPILED[0]
    from flashjit.errors import CompileError

    with pytest.raises(CompileError) as info:
        compile_source(render(spec), spec.arch, spec.name)
    assert "ABI: mla::Args::q_pe" in info.value.log


def test_engine_caches_and_prewarms(engine, fake_nvrtc):
    specs = [MLASpec(num_heads=h, arch="sm_90") for h in (16, 128)]
    results = engine.prewarm(specs + specs, jobs=2)
    assert sorted(r.source for r in results) == ["compiled", "compiled"] and len(fake_nvrtc) == 2
    kernel = engine.get_kernel(specs[1])
    assert kernel.tiling == mla_tiling(specs[1]) and kernel.spec is specs[1]
    from flashjit import Engine

    again = Engine(cache_dir=engine.cache.root)
    assert [r.source for r in again.prewarm(specs)] == ["disk", "disk"] and len(fake_nvrtc) == 2


def test_cli_prewarm_and_show_by_name(cache_dir, fake_nvrtc):
    name = "mla_c512_r64_h16_bf16_kvbf16_p64_q1_sm90"
    code, out, err = run("prewarm", "--spec", name, "--cache-dir", cache_dir)
    assert code == 0, err
    assert name in out and fake_nvrtc == [name]
    code, out, err = run("show", name)
    assert code == 0 and "flashjit_mla" in out


# ---- plan() on the CPU -----------------------------------------------------------------------

@pytest.mark.parametrize("native", [False, True])
def test_plan_writes_the_shared_work_records(engine, fake_nvrtc, native):
    library = native_library() if native else None
    if native and library is None:
        pytest.skip("no C compiler: the numpy planner is the one in use")
    kv_lens, page_size, heads = [5000, 17, 0, 900], 64, 128
    indptr, indices, last = page_table(kv_lens, page_size)
    qo = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32)
    decoder = cpu_mla(engine, host_planner=HostPlanner(library))
    decoder.plan(indptr, indices, last, heads, page_size, qo_indptr=qo, sm_scale=0.1)
    spec, tiling = decoder.spec, decoder.kernel.tiling
    assert spec == MLASpec(num_heads=heads, page_size=page_size, max_q_len=2, arch="sm_90")
    expected = plan_work(None, np.array(kv_lens), qo.numpy(), ctas_per_item=tiling.row_tiles,
                         max_ctas=NUM_SMS * MLA_CTAS_PER_SM, granularity=tiling.tile_tokens)
    work = decoder.work
    assert work.chunk_tokens == expected.chunk_tokens and work.chunk_tokens % tiling.tile_tokens == 0
    np.testing.assert_array_equal(work.work_request, expected.work_request)
    np.testing.assert_array_equal(work.work_begin, expected.work_begin)
    np.testing.assert_array_equal(work.work_end, expected.work_end)
    plan = decoder.current_plan
    records = item_records(plan.buffers.host, plan.buffers.starts)[:expected.num_work]
    assert records[:, 3].tolist() == [kv_lens[r] for r in expected.work_request]  # kv_len
    assert plan.buffers.device_buffer.tolist() == plan.buffers.staging.tolist()
    a = plan.args
    assert a.num_heads == heads and math.isclose(a.sm_scale_log2, 0.1 * math.log2(math.e), rel_tol=1e-6)
    assert a.work_items == plan.buffers.pointers["work_items"] and a.page_indices == indices.data_ptr()
    assert plan.launch.grid == (expected.num_work, tiling.row_tiles, 1)
    assert plan.launch.smem == tiling.smem_bytes and plan.launch.block == tiling.block
    assert plan.buffers.tmp_o.numel() >= expected.num_work * 2 * heads * 512


def test_plan_refusals_leave_the_plan(engine, fake_nvrtc):
    indptr, indices, last = page_table([100, 200], 16)
    decoder = cpu_mla(engine)
    decoder.plan(indptr, indices, last, 16, 16, sm_scale=0.1)
    kept = decoder.current_plan
    for kwargs, message in [(dict(num_heads=0), "num_heads"), (dict(num_heads=256), "num_heads"),
                            (dict(sm_scale=-1.0), "sm_scale"), (dict(q_len=5), "max_q_len"),
                            (dict(kv_dtype="float16"), "kv_dtype"), (dict(chunk_tokens=0), "chunk_tokens")]:
        args = {**dict(num_heads=16, page_size=16, sm_scale=0.1), **kwargs}
        with pytest.raises(ValueError, match=message):
            decoder.plan(indptr, indices, last, args.pop("num_heads"), args.pop("page_size"), **args)
        assert decoder.current_plan is kept


def test_cuda_graph_mode_keeps_buffers_and_kernel(engine, fake_nvrtc):
    decoder = cpu_mla(engine, use_cuda_graph=True, max_batch_size=8, max_num_pages=128, max_q_len=2)
    indptr, indices, last = page_table([100, 300], 16)
    decoder.plan(indptr, indices, last, 32, 16, sm_scale=0.1)
    first = decoder.current_plan
    assert first.spec.max_q_len == 2 and first.launch.grid[0] == first.buffers.capacity.work
    indptr, indices, last = page_table([1000, 5, 7], 16)
    decoder.plan(indptr, indices, last, 32, 16, sm_scale=0.1, q_len=2)
    second = decoder.current_plan
    assert second.buffers is first.buffers and second.args is first.args and second.launch is first.launch
    assert decoder.graph_page_ids.data_ptr() == second.args.page_indices
    with pytest.raises(ValueError, match="max_q_len=2"):
        decoder.plan(indptr, indices, last, 32, 16, sm_scale=0.1, q_len=3)
    with pytest.raises(ValueError, match="first plan's kernel"):
        decoder.plan(indptr, indices, last, 16, 16, sm_scale=0.1)


# ---- the reference ---------------------------------------------------------------------------

def from_scratch(q_nope, q_pe, cache, page_ids, kv_len, page_size, sm_scale):
    """MLA attention of one request in float64 with numpy, straight from the definition."""
    q_nope, q_pe, cache = (x.double().numpy() for x in (q_nope, q_pe, cache))
    rows = np.stack([cache[page_ids[pos // page_size], pos % page_size] for pos in range(kv_len)] or
                    [np.zeros(576)])[:kv_len]
    ckv, kpe = rows[:, :512], rows[:, 512:]
    n, heads = q_nope.shape[:2]
    out, lse = np.zeros((n, heads, 512)), np.full((n, heads), -np.inf)
    for t in range(n):
        for h in range(heads):
            s = (q_nope[t, h] @ ckv.T + q_pe[t, h] @ kpe.T) * sm_scale
            s[np.arange(kv_len) > kv_len - n + t] = -np.inf
            if np.isfinite(s).any():
                mx = s.max()
                p = np.exp(s - mx)
                out[t, h], lse[t, h] = p @ ckv / p.sum(), mx + math.log(p.sum())
    return out, lse


@pytest.mark.parametrize("one_cache", [False, True])
def test_reference_matches_float64_from_scratch(one_cache):
    gen = torch.Generator().manual_seed(1)
    page_size, heads, kv_lens, q_lens = 4, 3, [9, 1, 0, 6], [2, 1, 3, 4]
    indptr, indices, last = page_table(kv_lens, page_size)
    qo = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    cache = torch.randn(int(indptr[-1]) + 2, page_size, 576, generator=gen)
    q_nope, q_pe = torch.randn(int(qo[-1]), heads, 512, generator=gen), torch.randn(int(qo[-1]), heads, 64, generator=gen)
    caches = (cache, None) if one_cache else (cache[..., :512].contiguous(), cache[..., 512:].contiguous())
    out, lse = mla_reference(q_nope, q_pe, *caches, indptr, indices, last, qo_indptr=qo, sm_scale=0.07)
    for b, (kv_len, n) in enumerate(zip(kv_lens, q_lens)):
        q0 = int(qo[b])
        want_out, want_lse = from_scratch(q_nope[q0:q0 + n], q_pe[q0:q0 + n], cache,
                                          indices[indptr[b]:indptr[b + 1]].tolist(), kv_len, page_size, 0.07)
        np.testing.assert_allclose(out[q0:q0 + n].double().numpy(), want_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[q0:q0 + n].double().numpy(), want_lse, rtol=1e-5)
    assert torch.isneginf(lse[int(qo[2]):int(qo[3])]).all() and not out.isnan().any()  # the empty request


def test_quantize_latent_round_trip_and_scales():
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(6, 16, 512, generator=gen) * 3
    q, scale = quantize_latent(cache, "e4m3")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    assert math.isclose(float(q.float().abs().max()), 448.0, rel_tol=1e-3)
    assert ((q.float() * scale - cache).abs() <= cache.abs() * 0.07 + 1e-3).all()
    zero, one = quantize_latent(torch.zeros(2, 4, 64))
    assert one.item() == 1.0 and not zero.float().any()
    with pytest.raises(ValueError, match="kv_dtype"):
        quantize_latent(cache, "bf16")


def test_reference_applies_scales():
    gen = torch.Generator().manual_seed(3)
    indptr, indices, last = page_table([5], 4)
    ckv, kpe = torch.randn(3, 4, 512, generator=gen), torch.randn(3, 4, 64, generator=gen)
    q_nope, q_pe = torch.randn(1, 2, 512, generator=gen), torch.randn(1, 2, 64, generator=gen)
    scaled = mla_reference(q_nope, q_pe, ckv / 2, kpe / 4, indptr, indices, last, sm_scale=0.05, ckv_scale=2.0,
                           kpe_scale=4.0)
    plain = mla_reference(q_nope, q_pe, ckv, kpe, indptr, indices, last, sm_scale=0.05)
    for got, want in zip(scaled, plain):
        torch.testing.assert_close(got, want)


# ---- HuggingFace configs ---------------------------------------------------------------------

@pytest.mark.parametrize("folder, heads, scale", [
    ("deepseek-v3", 128, 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2),
    ("kimi-k2", 64, 192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2),
])
def test_mla_configs_give_specs_at_each_tp(folder, heads, scale):
    assert is_mla_config(HF_EXAMPLES / folder)
    model = read_mla_config(HF_EXAMPLES / folder)
    assert (model.name, model.num_heads, model.kv_lora_rank, model.rope_dim, model.dtype) == (
        folder, heads, 512, 64, "bfloat16")
    assert math.isclose(model.sm_scale, scale, rel_tol=1e-9) and f"sm_scale={scale:.6g}" in model.summary()
    specs = model.specs(["sm_90"])
    assert [s.num_heads for s in specs] == [heads, heads // 8, heads // 16]
    assert all(s.page_size == 64 and s.max_q_len == 1 and s.kv_dtype == "bfloat16" for s in specs)
    more = model.specs(["sm_80", "sm_90"], tps=(8,), page_sizes=(1, 64), kv_dtype="e4m3", max_q_lens=(1, 2))
    assert len(more) == 2 * 2 * 2 and {s.kv_dtype for s in more} == {"float8_e4m3fn"}
    with pytest.raises(ManifestError, match="divisor"):
        model.specs(["sm_90"], tps=(3,))


def test_mla_config_refusals(tmp_path):
    config = json.loads((HF_EXAMPLES / "deepseek-v3" / "config.json").read_text())
    for field, value in (("kv_lora_rank", 256), ("qk_rope_head_dim", 32), ("num_attention_heads", 256)):
        path = tmp_path / field / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(dict(config, **{field: value})))
        with pytest.raises(ManifestError) as info:
            read_mla_config(path)
        assert info.value.field == field and str(value) in str(info.value)


def test_cli_prewarm_hf_config_of_an_mla_model(cache_dir, fake_nvrtc):
    code, out, err = run("prewarm", "--hf-config", HF_EXAMPLES / "deepseek-v3", "--arch", "sm_90", "--tp", "1,16",
                         "--max-q-len", "1,2", "--cache-dir", cache_dir)
    assert code == 0, err
    assert "total: 4 kernels" in out and "mla_c512_r64_h8_bf16_kvbf16_p64_q2_sm90" in out
    assert "sm_scale=" in err


# ---- the benchmark's pure parts --------------------------------------------------------------

def test_benchmark_rows_and_sweep_variants():
    from benchmarks import mla as bench

    row = bench.Row("b2 L100 h16", 2, 100, 16)
    assert row.attended_bytes == 2 * 100 * 576 * 2 + 2 * 16 * 1088 * 2
    assert bench.Row("x", 2, 100, 16, kv="e4m3").attended_bytes == 2 * 100 * 576 + 2 * 16 * 1088 * 2
    assert row.flops == 2 * 2 * 16 * 100 * 1088
    skewed = bench.Row("x", 4, 100, 16, q_len=2, long=1, long_len=5000)
    assert skewed.kv_lens == [100, 100, 100, 5000]
    assert skewed.attended_bytes == 5300 * 576 * 2 + 4 * 2 * 16 * 1088 * 2 and skewed.flops == 2 * 2 * 16 * 5300 * 1088
    assert {r.name for r in bench.ROWS} >= {"b64 L8192 h16", "b16 L8192 h128"}
    assert any(r.long for r in bench.ROWS) and {r.q_len for r in bench.ROWS} >= {1, 2, 4}
    for (fp8, rows), variants in bench.SWEEP.items():
        for warps, tile, stages, min_ctas in variants:
            table = MLA_TUNING.with_rows(fp8=fp8, rows=rows, warps=warps, tile_tokens=tile, stages=stages,
                                         min_ctas=min_ctas)
            spec = MLASpec(num_heads={16: 16, 32: 32, 64: 128}[rows], kv_dtype="e4m3" if fp8 else "bf16",
                           arch="sm_100")  # the mma.sync kernel at every shape (sm_90 takes wgmma at 64 rows)
            t = mla_tiling(spec, table)
            assert (t.rows, t.warps, t.tile_tokens) == (rows, warps, tile)
            assert t.warps % t.m_tiles == 0 and (t.tile_tokens // t.key_slices) % 8 == 0
            assert t.smem_bytes <= dynamic_shared_limit("sm_90")
    fp8_128 = MLASpec(num_heads=128, kv_dtype="e4m3", arch="sm_90")
    variants = dict(bench.sweep_variants(fp8_128))
    first = next(iter(variants))
    assert first == "w8t32s4m1" and mla_tiling(fp8_128, variants[first]) == mla_tiling(fp8_128)  # the table as it is
    assert mla_tiling(fp8_128, variants["wgmma fp8"]).wgmma and not mla_tiling(fp8_128).wgmma
    assert mla_tiling(fp8_128, variants["cells4"]).merge_cells == 4
    assert "wgmma fp8" not in dict(bench.sweep_variants(MLASpec(num_heads=16, kv_dtype="e4m3", arch="sm_90")))
    assert next(iter(dict(bench.sweep_variants(MLASpec(num_heads=128, arch="sm_90"))))).startswith("wgmma ")
    entry = {"row": "b2 L100 h16", "floor_us": 10.0, "gemm_tflops": 4.0,
             "impls": {"flashjit": {"us": 12.5, "gbs": 1.0, "tflops": 2.0}, "flashinfer": {"error": "ImportError: x"},
                       "flashjit graph": {"us": 12.0, "gbs": 1.0, "tflops": 2.1}}}
    text = bench.format_row(entry)
    assert "flashjit     12.5 us" in text and "80% of floor, 50% of GEMM" in text
    assert "flashinfer: ImportError: x" in text and "graph ÷ eager speed 1.04" in text


# ---- run()'s checks on the CPU ---------------------------------------------------------------

def planned_cpu_mla(engine, kv_dtype=None):
    """A CPU decoder planned for 2 requests of 4 pages (64 tokens each), 16 heads; run() launches nothing."""
    decoder = cpu_mla(engine, current_stream=lambda index: 0)
    indptr, last = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([64, 64], dtype=torch.int32)
    decoder.plan(indptr, torch.arange(8, dtype=torch.int32), last, 16, 64, sm_scale=0.1, kv_dtype=kv_dtype)
    launches = []
    decoder._plan = decoder.current_plan._replace(launch=launches.append)
    return decoder, launches


def mla_tensors(kv=torch.bfloat16, pages=8):
    return (torch.zeros(2, 16, 512, dtype=torch.bfloat16), torch.zeros(2, 16, 64, dtype=torch.bfloat16),
            torch.zeros(pages, 64, 576, dtype=kv))


def test_run_points_the_arguments_at_the_tensors(engine, fake_nvrtc):
    decoder, launches = planned_cpu_mla(engine)
    q_nope, q_pe, cache = mla_tensors()
    out, lse = decoder.run(q_nope, q_pe, cache, return_lse=True)
    a = decoder.current_plan.args
    assert (a.q_nope, a.q_pe, a.ckv, a.out, a.lse) == (q_nope.data_ptr(), q_pe.data_ptr(), cache.data_ptr(),
                                                       out.data_ptr(), lse.data_ptr())
    assert a.kpe == cache.data_ptr() + 1024 and (a.ckv_page_stride, a.ckv_slot_stride) == (64 * 576, 576)
    assert (a.kpe_page_stride, a.q_nope_stride, a.q_nope_head_stride) == (64 * 576, 16 * 512, 512)
    assert out.shape == (2, 16, 512) and lse.shape == (2, 16) and launches == [0]
    ckv, kpe = cache[..., :512].contiguous(), cache[..., 512:].contiguous()
    decoder.run(q_nope, q_pe, ckv, kpe, out=out)
    assert (a.ckv, a.kpe, a.kpe_slot_stride) == (ckv.data_ptr(), kpe.data_ptr(), 64) and not a.lse
    assert len(launches) == 2


def test_run_refusals_name_the_tensor(engine, fake_nvrtc):
    decoder, launches = planned_cpu_mla(engine)
    q_nope, q_pe, cache = mla_tensors()
    cases = [
        (dict(q_nope=q_nope.float()), "q_nope"), (dict(q_pe=q_pe[:, :8]), "q_pe"),
        (dict(cache=cache[:5]), "more than 7 pages"), (dict(cache=cache[:, :32]), "kv_cache"),
        (dict(cache=cache.to(torch.float16)), "kv_cache"), (dict(ckv_scale=2.0), "ckv_scale"),
        (dict(out=torch.zeros(2, 512, 16, dtype=torch.bfloat16).transpose(1, 2)), "out"),
        (dict(lse=torch.zeros(2, 8)), "lse"),
    ]
    for change, message in cases:
        args = {**dict(q_nope=q_nope, q_pe=q_pe, cache=cache), **change}
        with pytest.raises(ValueError, match=message):
            decoder.run(args.pop("q_nope"), args.pop("q_pe"), args.pop("cache"), **args)
    assert launches == []


def test_fp8_runs_need_a_scale_and_fold_both(engine, fake_nvrtc):
    decoder, launches = planned_cpu_mla(engine, kv_dtype="e4m3")
    q_nope, q_pe, cache = mla_tensors(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="ckv_scale"):
        decoder.run(q_nope, q_pe, cache)
    decoder.run(q_nope, q_pe, cache, ckv_scale=0.5)
    a = decoder.current_plan.args
    assert (a.ckv_scale, a.kpe_scale) == (0.5, 0.5) and not a.ckv_scale_ptr
    decoder.run(q_nope, q_pe, cache[..., :512], cache[..., 512:], ckv_scale=0.5, kpe_scale=0.25)
    assert (a.ckv_scale, a.kpe_scale) == (0.5, 0.25) and len(launches) == 2
