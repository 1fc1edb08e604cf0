"""Attention variants on the CPU: the registry, spec names and keys, the rendered hooks, NVRTC
compiles of every built-in with every kernel family, plan()'s variant arguments, and the
reference's math against a from-scratch float64 softmax."""

from __future__ import annotations

import ctypes
import math
import re

import numpy as np
import pytest
import torch

from flashjit import DecodeSpec, SpecError, register_variant
from flashjit.jit.compile import compile_source
from flashjit.jit.render import render
from flashjit.masks.variants import variants
from flashjit.serving.reference import decode_reference
from flashjit.serving import variant_args

from built_ins import BUILT_IN_VARIANTS
from cpu_decoders import cpu_decoder, tables

# The variants whose float64 definitions test_reference_matches_float64_definitions writes out: the
# registry's built-ins, each of them (a new one needs its definition there).
BUILT_IN = ("none", "soft_cap", "sinks", "soft_cap_sinks")


def test_built_ins_and_their_params():
    assert sorted(BUILT_IN) == sorted(BUILT_IN_VARIANTS)
    assert variants.get("soft_cap").param_names == ("logits_soft_cap",)
    assert [(p.name, p.kind, p.ctype) for p in variants.get("sinks").params] == [
        ("sinks", "float_tensor", "const float* __restrict__")]
    assert variants.get("soft_cap_sinks").param_names == ("logits_soft_cap", "sinks")
    with pytest.raises(SpecError, match="soft_cap"):
        variants.get("alibi")


def test_spec_names_keys_and_round_trip():
    plain = DecodeSpec(64, mask="sliding_window", group_size=8, arch="sm_90")
    sinks = plain.replace(variant="sinks")
    assert plain.name == "decode_d64_bf16_kvbf16_sliding_window_p16_g8_q1_nhd_sm90_tc"  # "none" is left out
    assert sinks.name == "decode_d64_bf16_kvbf16_sliding_window-sinks_p16_g8_q1_nhd_sm90_tc"
    for spec in (plain, sinks, plain.replace(mask="none", variant="soft_cap_sinks")):
        assert DecodeSpec.from_name(spec.name) == spec
    assert sinks != plain and sinks.digest != plain.digest
    with pytest.raises(SpecError, match="variant"):
        DecodeSpec(64, variant="nope", arch="sm_90")


def test_head_dim_512_runs_on_tensor_cores_only():
    assert DecodeSpec(512, arch="sm_90").tensor_cores  # even one row per CTA
    with pytest.raises(SpecError, match="CUDA-core kernels take head_dim"):
        DecodeSpec(512, tensor_cores=False, arch="sm_90")


def test_hooks_render_only_where_a_variant_fills_them():
    def flags(variant):
        source = render(DecodeSpec(128, group_size=4, variant=variant, arch="sm_90"))
        return re.findall(r"constexpr bool VARIANT_(LOGITS|SINK) = (true|false);", source), source

    assert flags("none")[0] == [("LOGITS", "false"), ("SINK", "false")]
    assert flags("soft_cap")[0] == [("LOGITS", "true"), ("SINK", "false")]
    found, source = flags("soft_cap_sinks")
    assert found == [("LOGITS", "true"), ("SINK", "true")]
    assert ("float variant_logits_soft_cap, const float* __restrict__ variant_sinks" in source
            and "VariantParams::sinks" in source)  # the kernel's parameters, and their ABI checks


@pytest.mark.parametrize("head_dim, kv_dtype, group, tensor_cores, variant", [
    (64, "bf16", 8, True, "sinks"),
    (128, "e4m3", 4, True, "soft_cap_sinks"),
    (256, "bf16", 2, True, "soft_cap"),
    (128, "fp16", 1, False, "soft_cap_sinks"),
    (512, "bf16", 4, True, "sinks"),
    (512, "e4m3", 8, True, "soft_cap"),
    (512, "e5m2", 1, True, "none"),
])
def test_variants_compile_without_spills(head_dim, kv_dtype, group, tensor_cores, variant):
    spec = DecodeSpec(head_dim, kv_dtype=kv_dtype, mask="sliding_window", group_size=group, max_q_len=2,
                      tensor_cores=tensor_cores, variant=variant, arch="sm_90")
    log = compile_source(render(spec), "sm_90", spec.name, extra_options=("--ptxas-options=-v",)).log
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    assert spills and not any(spills) and registers and max(registers) <= 255, log


def test_a_user_variant_registers_and_renders(isolated_variants, tmp_path):
    path = tmp_path / "alibi.cuh.j2"
    path.write_text('{% extends "variants/base.cuh.j2" %}\n'
                    '{% block logits %}  return score - params.slope * (float)(q_pos - kv_pos);{% endblock %}\n')
    register_variant("alibi_test", path, {"slope": "float"},
                     logits=lambda s, q_pos, kv_pos, heads, p: s - p["slope"] * (q_pos - kv_pos))
    spec = DecodeSpec(64, variant="alibi_test", arch="sm_90")
    assert "params.slope * (float)(q_pos - kv_pos)" in render(spec)
    with pytest.raises(SpecError, match="not registered yet"):
        register_variant("alibi_test", path, {"slope": "int"})


# ---- plan()'s arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("given, name", [
    ({}, "none"), ({"logits_soft_cap": 0.0}, "none"), ({"logits_soft_cap": 30.0}, "soft_cap"),
    ({"sinks": "t"}, "sinks"), ({"logits_soft_cap": 30.0, "sinks": "t"}, "soft_cap_sinks"),
    ({"variant": "sinks", "variant_params": {"sinks": "t"}}, "sinks"),
])
def test_flashinfer_names_pick_the_built_ins(given, name):
    resolved, params = variant_args.resolve(given.get("variant"), given.get("variant_params"),
                                            given.get("logits_soft_cap"), given.get("sinks"))
    assert resolved == name and (params is None) == (name == "none")


def test_variant_arguments_do_not_mix():
    with pytest.raises(ValueError, match="logits_soft_cap/sinks"):
        variant_args.resolve("sinks", None, 30.0, None)
    with pytest.raises(ValueError, match="variant_params"):
        variant_args.resolve(None, {"sinks": 1}, None, None)


HEADS, KV_HEADS, DIM, PAGE = 8, 2, 64, 16


def test_plan_passes_the_variant_params_after_the_masks(planner):  # noqa: F811
    decoder = cpu_decoder(planner)
    indptr, indices, last = tables([40, 7, 300], PAGE, np.random.default_rng(0))
    sinks = torch.linspace(-1, 1, HEADS)
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, mask="sliding_window", window_left=127,
                 logits_soft_cap=50.0, sinks=sinks)
    assert decoder.spec.variant == "soft_cap_sinks" and decoder.spec.mask == "sliding_window"
    params = decoder.current_plan.decode_launch.params
    assert ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int))[0] == 127
    assert ctypes.cast(params[2], ctypes.POINTER(ctypes.c_float))[0] == 50.0
    assert ctypes.cast(params[3], ctypes.POINTER(ctypes.c_void_p))[0] == sinks.data_ptr()


@pytest.mark.parametrize("keywords, message", [
    ({"sinks": torch.zeros(HEADS - 1)}, "one float32 logit per query head"),
    ({"sinks": torch.zeros(HEADS, dtype=torch.float16)}, "sinks"),
    ({"logits_soft_cap": -2.0}, r"logits_soft_cap: expected a float in 1\.18e-38\.\.1\.84e\+19 \(its reciprocal a "
                                 r"normal float32; 0 or None: no capping\), got -2\.0$"),
    ({"logits_soft_cap": float("inf")}, r"logits_soft_cap: expected a finite float .*, got inf$"),
    # a cap without a normal reciprocal made NaN scores; one past 2**64 flushed small scores to 0
    ({"logits_soft_cap": 1e-39}, r"logits_soft_cap: expected a float in .*, got 1e-39$"),
    ({"logits_soft_cap": 2.0**-126 * 0.99}, r"logits_soft_cap: expected a float in 1\.18e-38"),
    ({"logits_soft_cap": 1e30}, r"logits_soft_cap: expected a float in .*, got 1e\+30$"),
    ({"logits_soft_cap": 2.0**126}, r"logits_soft_cap: expected a float in .*\.\.1\.84e\+19"),
    ({"logits_soft_cap": 2.0**64 * 1.01, "sinks": torch.zeros(HEADS)}, r"logits_soft_cap: expected a float in "),
    ({"variant": "sinks", "variant_params": {}}, "missing \\['sinks'\\]"),
    ({"variant": "soft_cap", "variant_params": {"logits_soft_cap": 1.0, "extra": 2}}, "unknown \\['extra'\\]"),
])
def test_plan_refuses_bad_variant_params(planner, keywords, message):  # noqa: F811
    decoder = cpu_decoder(planner)
    indptr, indices, last = tables([40, 7], PAGE, np.random.default_rng(1))
    with pytest.raises(ValueError, match=message):
        decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, **keywords)
    assert decoder.current_plan is None


@pytest.mark.parametrize("cap", [2.0**-126, 1e-30, 0.5, 50.0, 2.0**64])
def test_plan_accepts_soft_caps_at_the_edges(planner, cap):  # noqa: F811
    decoder = cpu_decoder(planner)
    indptr, indices, last = tables([40, 7], PAGE, np.random.default_rng(1))
    decoder.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, logits_soft_cap=cap)
    assert decoder.spec.variant == "soft_cap"
    assert ctypes.cast(decoder.current_plan.decode_launch.params[1], ctypes.POINTER(ctypes.c_float))[0] == np.float32(cap)


# ---- the reference's math -----------------------------------------------------------------------

def float64_attention(q, k, v, visible, scale, cap=None, sinks=None):
    """One request's attention written from the definitions, in float64: [t, h, d] queries, [n, h, d] keys."""
    t, h, _ = q.shape
    out = np.zeros(q.shape)
    lse = np.full((t, h), -np.inf)
    for i in range(t):
        for head in range(h):
            s = np.array([q[i, head] @ k[j, head] * scale for j in range(k.shape[0])])
            if cap is not None:
                s = cap * np.tanh(s / cap)
            s = s[visible[i]]
            terms = list(s) + ([sinks[head]] if sinks is not None else [])
            if not terms:
                continue
            top = max(terms)
            denominator = sum(math.exp(x - top) for x in terms)
            lse[i, head] = top + math.log(denominator)
            weights = np.exp(s - top) / denominator
            out[i, head] = weights @ v[visible[i], head]
    return out, lse


@pytest.mark.parametrize("variant", BUILT_IN)
def test_reference_matches_float64_definitions(variant):
    gen = torch.Generator().manual_seed(0)
    page_size, kv_len, q_len, heads = 4, 11, 3, 2
    k_cache = torch.randn(4, page_size, heads, 8, generator=gen)
    v_cache = torch.randn(4, page_size, heads, 8, generator=gen)
    q = torch.randn(q_len, heads, 8, generator=gen) * 3  # scores large enough for the cap to bend them
    params = {}
    cap = 1.5 if "soft_cap" in variant else None
    sinks = torch.tensor([2.0, -0.5]) if "sinks" in variant else None
    if cap is not None:
        params["logits_soft_cap"] = cap
    if sinks is not None:
        params["sinks"] = sinks
    indptr, indices, last = torch.tensor([0, 3]), torch.tensor([2, 0, 3]), torch.tensor([3])
    out, lse = decode_reference(q, k_cache, v_cache, indptr, indices, last, qo_indptr=torch.tensor([0, q_len]),
                                mask="sliding_window", mask_params={"window_left": 4}, variant=variant,
                                variant_params=params)
    k = k_cache[indices].reshape(-1, heads, 8)[:kv_len].double().numpy()
    v = v_cache[indices].reshape(-1, heads, 8)[:kv_len].double().numpy()
    q_pos = np.arange(kv_len - q_len, kv_len)[:, None]
    kv_pos = np.arange(kv_len)[None, :]
    visible = (kv_pos <= q_pos) & (kv_pos >= q_pos - 4)
    want, want_lse = float64_attention(q.double().numpy(), k, v, visible, 8 ** -0.5, cap,
                                       None if sinks is None else sinks.double().numpy())
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)


def test_a_row_without_keys_has_the_sink_as_lse():
    q = torch.randn(2, 2, 8)
    k_cache = torch.randn(2, 4, 1, 8)
    sinks = torch.tensor([0.25, -3.0])
    out, lse = decode_reference(q, k_cache, k_cache, torch.tensor([0, 0, 1]), torch.tensor([0]),
                                torch.tensor([0, 2]), variant="sinks", variant_params={"sinks": sinks})
    assert torch.equal(lse[0], sinks) and torch.equal(out[0], torch.zeros(2, 8))  # request 0: no keys
    assert (lse[1] > sinks).all()  # logaddexp of the keys and the sink


def test_benchmark_rows_of_the_variants():
    """The gpt-oss rows come in pairs (with and without sinks) at b16-b64, window 128 and full; the
    soft-cap and head_dim 512 rows exist; a sinks row plans with one sink per query head."""
    from benchmarks.cases import CASES
    from benchmarks.peers import fa3_skip, flashinfer_skip, plan_arguments, sdpa_skip

    names = {c.name: c for c in CASES}
    for b in (16, 32, 64):
        for shape in (f"gpt-oss b{b} L8192 window 128", f"gpt-oss b{b} L8192"):
            plain, sinks = names[shape], names[shape + " sinks"]
            assert (plain.heads_qo, plain.heads_kv, plain.head_dim) == (64, 8, 64) and sinks.variant == "sinks"
            assert dataclasses_replace_equal(plain, sinks)
    assert names["gpt-oss b16 L8192 window 128"].window == 127
    assert names["gemma-2 b16 L8192 d256 16/8 soft_cap"].variant == "soft_cap" and "b16 L8192 d512" in names

    class Batch:  # what plan_arguments reads
        indptr = indices = last_page_len = None
        q = torch.zeros(1)

    _, options = plan_arguments(Batch(), names["gpt-oss b32 L8192 sinks"])
    assert options["variant"] == "sinks" and options["variant_params"]["sinks"].shape == (64,)
    assert "variant" not in plan_arguments(Batch(), names["gpt-oss b32 L8192"])[1]
    sinks_row = names["gpt-oss b16 L8192 sinks"]
    assert sdpa_skip(sinks_row, [8192]) and flashinfer_skip(sinks_row) and fa3_skip(sinks_row)
    assert fa3_skip(names["b16 L8192 d512"]) and not fa3_skip(names["b16 L8192 d128 soft_cap"])


def dataclasses_replace_equal(plain, with_variant) -> bool:
    """The two rows differ in their name and variant only."""
    import dataclasses

    return dataclasses.replace(with_variant, name=plain.name, variant=None) == plain
