"""merge_state / merge_states: the torch path against float64 attention computed from scratch, -inf
states, bad inputs; the kernel's spec, NVRTC compile and cache (tests/gpu/test_merge_states_gpu.py
runs it)."""

from __future__ import annotations

import math

import pytest
import torch

import flashjit
from flashjit import Engine, MergeSpec, SpecError, merge_state, merge_states
from flashjit.deploy.cli_kernels import collect_specs
from flashjit.jit.compile import compile_source
from flashjit.kernels.merge_states.kernel import MERGE_STATES_ENTRY, MergeStatesKernel
from flashjit.jit.render import render as render_merge_states
from flashjit.serving.merge_states import merge_states_torch

NEG_INF = float("-inf")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def attention_states(n: int, tokens: int, heads: int, dim: int, *, empty=(), seed=0):
    """Attention of random queries over random keys cut into n parts, in float64: the partial states
    (o [n, tokens, heads, dim], lse [n, tokens, heads]) and the one-pass result over all keys.
    Parts listed in `empty` hold no key (lse -inf, o NaN: what an unwritten part may hold)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [0 if i in empty else int(torch.randint(1, 40, (), generator=gen)) for i in range(n)]
    q = torch.randn(tokens, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lengths), heads, dim, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(sum(lengths), heads, dim, generator=gen, dtype=torch.float64)
    scores = torch.einsum("thd,khd->thk", q, k) / math.sqrt(dim)

    def state(lo, hi):
        if hi == lo:
            return torch.full((tokens, heads, dim), float("nan"), dtype=torch.float64), torch.full((tokens, heads), NEG_INF, dtype=torch.float64)
        s = scores[..., lo:hi]
        lse = torch.logsumexp(s, -1)
        return torch.einsum("thk,khd->thd", torch.exp(s - lse[..., None]), v[lo:hi]), lse

    bounds = [0]
    for n_keys in lengths:
        bounds.append(bounds[-1] + n_keys)
    parts = [state(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    full = state(0, bounds[-1])
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_merge_equals_one_pass_over_all_keys(dtype, n):
    o, lse, (full_o, full_lse) = attention_states(n, tokens=3, heads=4, dim=64, seed=n)
    merged, merged_lse = merge_states(o.to(dtype), lse.float())
    assert merged.dtype == dtype and merged_lse.dtype == torch.float32
    assert merged.shape == (3, 4, 64) and merged_lse.shape == (3, 4)
    torch.testing.assert_close(merged.double(), full_o, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])
    torch.testing.assert_close(merged_lse.double(), full_lse, atol=1e-5, rtol=1e-5)


def test_empty_states_are_identities_even_holding_nan():
    o, lse, (full_o, full_lse) = attention_states(6, tokens=2, heads=3, dim=16, empty=(0, 3, 5), seed=7)
    assert torch.isnan(o[0]).all()  # the empty parts' o is garbage, yet must not leak
    merged, merged_lse = merge_states(o.float(), lse.float())
    assert not torch.isnan(merged).any()
    torch.testing.assert_close(merged.double(), full_o, atol=1e-5, rtol=1e-5)
    kept = [i for i in range(6) if i not in (0, 3, 5)]
    again, again_lse = merge_states(o[kept].float(), lse[kept].float())
    torch.testing.assert_close(merged, again, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merged_lse, again_lse, atol=1e-6, rtol=1e-6)


def test_rows_without_any_key_give_zero_and_minus_inf():
    o = torch.full((4, 2, 3, 8), float("nan"))
    lse = torch.full((4, 2, 3), NEG_INF)
    lse[1, 0, 0] = 0.5  # one live row
    o[1, 0, 0] = 2.0
    merged, merged_lse = merge_states(o, lse)
    assert not torch.isnan(merged).any() and not torch.isnan(merged_lse).any()
    assert torch.equal(merged[0, 0], torch.full((8,), 2.0))
    assert merged_lse[0, 0].item() == pytest.approx(0.5)
    dead = torch.ones(2, 3, dtype=torch.bool)
    dead[0, 0] = False
    assert (merged[dead] == 0).all() and (merged_lse[dead] == NEG_INF).all()


def test_no_states_at_all():
    merged, merged_lse = merge_states(torch.zeros(0, 2, 3, 8), torch.zeros(0, 2, 3))
    assert (merged == 0).all() and (merged_lse == NEG_INF).all()


def test_merge_state_is_merge_states_of_two():
    o, lse, _ = attention_states(2, tokens=5, heads=2, dim=32, seed=3)
    o, lse = o.float(), lse.float()
    pair = merge_state(o[0], lse[0], o[1], lse[1])
    stacked = merge_states(o, lse)
    assert torch.equal(pair[0], stacked[0]) and torch.equal(pair[1], stacked[1])


def test_merging_is_associative_within_float32():
    o, lse, _ = attention_states(4, tokens=2, heads=2, dim=16, seed=11)
    o, lse = o.float(), lse.float()
    left = merge_state(*merge_state(o[0], lse[0], o[1], lse[1]), *merge_state(o[2], lse[2], o[3], lse[3]))
    torch.testing.assert_close(left[0], merge_states(o, lse)[0], atol=1e-6, rtol=1e-6)


def test_writes_into_given_outputs():
    o, lse, _ = attention_states(3, tokens=2, heads=2, dim=8)
    out, out_lse = torch.empty(2, 2, 8), torch.empty(2, 2)
    got = merge_states(o.float(), lse.float(), out=out, out_lse=out_lse)
    assert got[0] is out and got[1] is out_lse
    torch.testing.assert_close(out, merge_states_torch(o.float(), lse.float())[0])


def test_strided_states_are_read_as_they_are():
    o, lse, _ = attention_states(3, tokens=4, heads=2, dim=8, seed=5)
    o, lse = o.float(), lse.float()
    wide = torch.zeros(3, 4, 5, 8)
    wide[:, :, 1:3] = o
    merged, _ = merge_states(wide[:, :, 1:3], lse)
    torch.testing.assert_close(merged, merge_states(o, lse)[0])


BAD = [
    (lambda: merge_states(torch.zeros(2, 3, 8), torch.zeros(2, 3)), "o: expected a 4-d tensor"),
    (lambda: merge_states(torch.zeros(2, 1, 3, 8, dtype=torch.float64), torch.zeros(2, 1, 3)), "o: expected dtype"),
    (lambda: merge_states(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 4)), "lse: expected a tensor [n, tokens, heads] = (2, 1, 3)"),
    (lambda: merge_states(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, dtype=torch.float16)), "lse: expected dtype torch.float32"),
    (lambda: merge_states(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3, device="meta")), "lse: expected a tensor on o's device cpu"),
    (lambda: merge_states(torch.zeros(2, 1, 3, 8), [[0.0]]), "lse: expected a tensor"),
    (lambda: merge_states(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3), out=torch.zeros(1, 3, 4)), "out: expected a tensor (1, 3, 8)"),
    (lambda: merge_states(torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 3), out_lse=torch.zeros(1, 3, dtype=torch.int32)), "out_lse: expected a float32 tensor (1, 3)"),
    (lambda: merge_state(torch.zeros(1, 3, 8), torch.zeros(1, 3), torch.zeros(1, 3, 8, dtype=torch.bfloat16), torch.zeros(1, 3)), "o_b: expected a tensor like o_a"),
    (lambda: merge_state(torch.zeros(1, 3, 8), torch.zeros(1, 3), torch.zeros(1, 3, 8), torch.zeros(3)), "lse_b: expected"),
]


@pytest.mark.parametrize("call, message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_inputs_name_the_tensor(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


# ---- the kernel: spec, NVRTC, cache ----------------------------------------------------------------

def test_merge_spec_names_round_trip_and_refuse_bad_values():
    spec = MergeSpec("bf16", "sm_90")
    assert spec.name == "merge_states_bf16_sm90" and MergeSpec.from_name(spec.name) == spec
    assert MergeSpec("fp32", "90a").name == "merge_states_f32_sm90a"
    for field, bad in (("dtype", "e4m3"), ("dtype", "float64"), ("arch", "sm_42")):
        with pytest.raises(SpecError, match=f"MergeSpec.{field}"):
            MergeSpec(**{"dtype": "bf16", "arch": "sm_90", field: bad})
    with pytest.raises(SpecError, match="merge_states_bf16_sm90"):
        MergeSpec.from_name("merge_states_f64_sm90")
    assert collect_specs(None, ["merge_states_f16_sm80"], "sm_80,sm_90") == [
        MergeSpec("f16", "sm_80"), MergeSpec("f16", "sm_90")]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_kernel_compiles_with_nvrtc(dtype):
    spec = MergeSpec(dtype, "sm_90")
    source = render_merge_states(spec)
    assert 'static_assert(sizeof(merge_states::Args) ==' in source  # the host's layout, checked by the compile
    compiled = compile_source(source, spec.arch, spec.name)
    assert compiled.cubin[:4] == b"\x7fELF" and MERGE_STATES_ENTRY.encode() in compiled.cubin


def test_a_changed_host_layout_fails_the_compile():
    spec = MergeSpec("bf16", "sm_80")
    source = render_merge_states(spec).replace("  int num_states, num_tokens, num_heads, head_dim;",
                                               "  int num_tokens, num_states, num_heads, head_dim;")
    with pytest.raises(flashjit.CompileError, match="merge_states::Args::num_states"):
        compile_source(source, spec.arch, spec.name)


def test_engine_compiles_caches_and_prewarms_the_kernel(tmp_path):
    spec = MergeSpec("bf16", "sm_90")
    engine = Engine(cache_dir=tmp_path)
    (result,) = engine.prewarm([spec])
    assert result.source == "compiled" and result.spec == spec
    kernel = engine.get_kernel(spec)
    assert isinstance(kernel, MergeStatesKernel) and engine.get_kernel(spec) is kernel
    assert kernel.block_shape(128) == (128, 8) and kernel.block_shape(1024) == (128, 1)
    assert MergeSpec("f32", "sm_90").vector_elements == 4
    fresh = Engine(cache_dir=tmp_path)  # another process: the index finds the entry, no compile
    (again,) = fresh.prewarm([spec])
    assert again.source == "disk" and fresh.get_kernel(spec).cubin == kernel.cubin
    assert fresh.cached_entry(spec) is not None
    strict = Engine(cache_dir=tmp_path / "empty", allow_compile=False)
    with pytest.raises(flashjit.KernelNotPrewarmed, match="flashjit prewarm --spec merge_states_f16_sm90"):
        strict.get_kernel(MergeSpec("f16", "sm_90"))
