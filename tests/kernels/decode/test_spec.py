"""DecodeSpec: normalization, validation errors, names, digests, and plain-data behaviour."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import flashjit
from flashjit import DecodeSpec, SpecError
from flashjit.jit import arch as arch_module
from flashjit.kernels.decode import spec as spec_module
from flashjit.jit.arch import ARCHS
from flashjit.kernels.decode.spec import HEAD_DIMS

from built_ins import BUILT_IN_MASKS


@pytest.mark.parametrize("value", ["bf16", "bfloat16", "BF16", torch.bfloat16, "torch.bfloat16"])
def test_bfloat16_aliases_normalize(value):
    assert DecodeSpec(128, dtype=value, arch="sm_90").dtype == "bfloat16"


@pytest.mark.parametrize("value", ["fp16", "f16", "half", "float16", torch.float16, "torch.float16"])
def test_float16_aliases_normalize(value):
    assert DecodeSpec(128, dtype=value, arch="sm_90").dtype == "float16"


def test_aliases_give_equal_specs():
    a = DecodeSpec(128, dtype=torch.bfloat16, kv_dtype="torch.bfloat16", arch="90")
    b = DecodeSpec(128, dtype="bf16", kv_dtype="bf16", arch="sm_90")
    assert a == b and hash(a) == hash(b) and a.name == b.name


def test_kv_dtype_defaults_to_query_dtype():
    assert DecodeSpec(128, dtype="fp16", arch="sm_90").kv_dtype == "float16"
    assert DecodeSpec(128, dtype="bf16", arch="sm_90").kv_dtype == "bfloat16"
    assert DecodeSpec(128, dtype="bf16", kv_dtype="fp16", arch="sm_90").kv_dtype == "float16"


@pytest.mark.parametrize("arch, canonical", [("sm_90", "sm_90"), ("90", "sm_90"), ("sm90", "sm_90"),
                                             ("SM_80", "sm_80"), ("90a", "sm_90a")])
def test_arch_normalizes(arch, canonical):
    assert DecodeSpec(64, arch=arch).arch == canonical


def test_layout_normalizes():
    assert DecodeSpec(64, kv_layout="hnd", arch="sm_90").kv_layout == "HND"


@pytest.mark.parametrize("field, value, accepted_fragment", [
    ("head_dim", 100, "64, 96, 128, 256"),
    ("dtype", "int8", "bfloat16"),
    ("kv_dtype", "float32", "float16"),
    ("page_size", 0, "1..256"),
    ("page_size", 257, "1..256"),
    ("page_size", True, "1..256"),
    ("group_size", 0, "1..64"),
    ("max_q_len", 17, "1..16"),
    ("mask", "no_such_mask", "causal"),
    ("kv_layout", "NDH", "NHD, HND"),
    ("arch", "sm_12", "sm_90"),
])
def test_bad_value_raises_spec_error_naming_field_value_and_accepted(field, value, accepted_fragment):
    with pytest.raises(SpecError) as info:
        DecodeSpec(**{"head_dim": 128, "arch": "sm_90", field: value})
    error = info.value
    assert error.field == field
    assert error.value == value
    assert accepted_fragment in error.accepted
    message = str(error)
    assert f"DecodeSpec.{field}=" in message and repr(value) in message and accepted_fragment in message


def test_unknown_mask_lists_registered_masks():
    with pytest.raises(SpecError) as info:
        DecodeSpec(128, mask="diagonal", arch="sm_90")
    for name in BUILT_IN_MASKS:
        assert name in info.value.accepted


def test_spec_error_is_a_value_error_and_a_flashjit_error():
    with pytest.raises(ValueError):
        DecodeSpec(100, arch="sm_90")
    with pytest.raises(flashjit.FlashJITError):
        DecodeSpec(100, arch="sm_90")


def test_missing_arch_without_gpu_raises(monkeypatch):
    monkeypatch.setattr(arch_module, "current_arch", lambda: None)  # as on a GPU-less machine
    with pytest.raises(SpecError) as info:
        DecodeSpec(128)
    assert info.value.field == "arch" and info.value.value is None
    assert "sm_90" in str(info.value) and "no GPU" in str(info.value)


def test_missing_arch_uses_current_gpu(monkeypatch):
    monkeypatch.setattr(arch_module, "current_arch", lambda: "sm_89")
    assert DecodeSpec(128).arch == "sm_89"


def test_current_arch_is_none_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert arch_module.current_arch() is None


ALL_FIELDS = [
    DecodeSpec(64, arch="sm_80"),
    DecodeSpec(128, dtype="fp16", kv_dtype="bf16", mask="causal", page_size=1, group_size=8, max_q_len=4,
               kv_layout="HND", arch="sm_90a"),
    DecodeSpec(256, mask="sliding_window", page_size=256, group_size=64, max_q_len=16, arch="sm_120"),
    DecodeSpec(96, mask="block_sparse", page_size=32, arch="sm_100"),
]


@pytest.mark.parametrize("spec", ALL_FIELDS, ids=lambda s: s.name)
def test_name_round_trips(spec):
    assert DecodeSpec.from_name(spec.name) == spec
    assert DecodeSpec.from_name(f"  {spec.name}\n") == spec


def test_name_format():
    spec = DecodeSpec(128, dtype="bf16", mask="causal", group_size=4, arch="sm_90")
    assert spec.name == "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc"


@pytest.mark.parametrize("bad", ["decode_d128", "decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd", "attention_x"])
def test_from_name_rejects_garbage(bad):
    with pytest.raises(SpecError) as info:
        DecodeSpec.from_name(bad)
    assert info.value.field == "name" and info.value.value == bad


def test_from_name_validates_fields():
    with pytest.raises(SpecError) as info:
        DecodeSpec.from_name("decode_d100_bf16_kvbf16_none_p16_g1_q1_nhd_sm90")
    assert info.value.field == "head_dim"


@pytest.mark.parametrize("variant", ["sinks", "soft_cap"])
def test_a_shared_prefix_spec_with_a_variant_is_refused_by_name(variant):
    """plan() shares prefixes under no variant, and a shared record's rows publish no sinks."""
    args = dict(head_dim=128, dtype="bf16", mask="causal", group_size=4, arch="sm_90", tensor_cores=True)
    assert DecodeSpec(**args, shared_prefix=True).name.endswith("_tc_sp")
    with pytest.raises(SpecError) as info:
        DecodeSpec(**args, variant=variant, shared_prefix=True)
    assert info.value.field == "shared_prefix" and variant in str(info.value) and "'none'" in str(info.value)
    with pytest.raises(SpecError):
        DecodeSpec.from_name(f"decode_d128_bf16_kvbf16_causal-{variant}_p16_g4_q1_nhd_sm90_tc_sp")


def test_names_and_digests_are_distinct():
    specs = [DecodeSpec(d, dtype=t, mask=m, page_size=p, arch=a)
             for d in HEAD_DIMS for t in ("bf16", "fp16") for m in ("none", "causal")
             for p in (16, 32) for a in ("sm_80", "sm_90")]
    assert len({s.name for s in specs}) == len(specs)
    assert len({s.digest for s in specs}) == len(specs)


def test_digest_is_stable():
    spec = DecodeSpec(128, mask="causal", arch="sm_90")
    assert spec.digest == DecodeSpec(128, dtype="bfloat16", mask="causal", arch="90").digest
    assert spec.digest == pickle.loads(pickle.dumps(spec)).digest
    assert len(spec.digest) == 16 and int(spec.digest, 16) >= 0
    # Same digest in another process with another hash seed (it must not depend on hash()).
    code = "from flashjit import DecodeSpec; print(DecodeSpec(128, mask='causal', arch='sm_90').digest)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=os.pathsep.join(sys.path)))
    assert other.stdout.strip() == spec.digest


def test_frozen():
    spec = DecodeSpec(128, arch="sm_90")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.head_dim = 64


def test_hashable_and_picklable():
    spec = DecodeSpec(128, mask="causal", group_size=4, arch="sm_90")
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec and hash(clone) == hash(spec)
    assert {spec: 1}[clone] == 1
    assert spec != spec.replace(group_size=8)


def test_replace_validates():
    spec = DecodeSpec(128, arch="sm_90")
    assert spec.replace(dtype="fp16").dtype == "float16"
    with pytest.raises(SpecError):
        spec.replace(head_dim=100)


def test_to_dict_is_canonical():
    d = DecodeSpec(128, dtype="bf16", arch="90").to_dict()
    assert d["dtype"] == "bfloat16" and d["kv_dtype"] == "bfloat16" and d["arch"] == "sm_90"
    assert DecodeSpec(**d) == DecodeSpec(128, arch="sm_90")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_listed_arch_is_accepted(arch):
    assert DecodeSpec(64, arch=arch).arch == arch


# ---- DecodeSpec.cached: plan()'s memo of validated specs ------------------------------------------

CACHED_ARGS = dict(head_dim=128, dtype="bf16", kv_dtype=None, mask="causal", page_size=16, group_size=4, max_q_len=1,
                   kv_layout="NHD", arch="sm_90", tensor_cores=None)


def cached(**changes) -> DecodeSpec:
    return DecodeSpec.cached(**{**CACHED_ARGS, **changes})


def test_cached_equals_construction_and_is_kept():
    spec = cached()
    assert spec == DecodeSpec(**CACHED_ARGS) and cached() is spec


@pytest.mark.parametrize("field, value", [("head_dim", 64), ("dtype", "fp16"), ("kv_dtype", "fp16"), ("mask", "none"),
                                          ("page_size", 1), ("group_size", 8), ("max_q_len", 4), ("kv_layout", "HND"),
                                          ("arch", "sm_80"), ("tensor_cores", False)])
def test_cached_follows_every_argument(field, value):
    base, changed = cached(), cached(**{field: value})
    assert changed == DecodeSpec(**{**CACHED_ARGS, field: value}) and changed != base
    assert cached() is base and cached(**{field: value}) is changed


@pytest.mark.parametrize("field, value", [("head_dim", 128.0), ("page_size", True), ("group_size", 4.0),
                                          ("max_q_len", True), ("head_dim", np.int64(128))])
def test_cached_rejects_what_construction_rejects_even_when_equal_to_a_kept_key(field, value):
    cached()  # the int version is kept; an equal key of another type must still be validated
    with pytest.raises(SpecError) as info:
        cached(**{field: value})
    assert str(info.value) == str(pytest.raises(SpecError, DecodeSpec, **{**CACHED_ARGS, field: value}).value)


def test_cached_keeps_no_failures():
    for _ in range(2):
        with pytest.raises(SpecError, match="mask"):
            cached(mask="no_such_mask")
    with pytest.raises(SpecError, match="kv_layout"):
        cached(kv_layout=["NHD"])  # unhashable: still the construction's message


def test_cached_does_not_keep_specs_of_the_current_gpu(monkeypatch):
    monkeypatch.setattr(arch_module, "current_arch", lambda: "sm_90")
    assert cached(arch=None).arch == "sm_90"
    monkeypatch.setattr(arch_module, "current_arch", lambda: "sm_80")
    assert cached(arch=None).arch == "sm_80"


def test_cached_is_bounded(monkeypatch):
    monkeypatch.setattr(spec_module, "_CACHED_SPECS", {})
    monkeypatch.setattr(spec_module, "_CACHED_SPECS_MAX", 3)
    specs = [cached(max_q_len=n) for n in range(1, 8)]
    assert len(spec_module._CACHED_SPECS) <= 3 and [s.max_q_len for s in specs] == list(range(1, 8))
