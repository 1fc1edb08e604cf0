"""Cache keys are part of the public cache format: these values must never change for the same
ingredients, or every existing cache (and every shipped bundle) misses."""

from __future__ import annotations

import platform

import flashjit.jit.engine as engine_module
from flashjit import DecodeSpec
from flashjit.jit import host_library, keys
from flashjit.jit.keys import cache_key, portable_key
from flashjit.masks.registry import masks
from flashjit.masks.variants import variants

SOURCE = 'extern "C" __global__ void k() {}'
OPTIONS = ("-arch=sm_90", "--std=c++17", "--use_fast_math")
# Fixed flags: host_library.CFLAGS may change (that rebuilds the local libraries, by design); the
# hashing of a given set of flags may not.
CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off", "-fno-fast-math")


def test_entry_key_is_pinned():
    assert cache_key(SOURCE, "sm_90", OPTIONS, (12, 9), "0.1.0") == \
        "6ed69d0243d3ff4a53998582f3845febf16fb5291b5d0742f7474ef801abbdc0"


def test_portable_key_is_pinned():
    assert portable_key(SOURCE, "sm_90", OPTIONS, "0.1.0") == \
        "be985ce6866ea54524b49e34312c601c6b3adf2a94465501ad99ed552d8d2f2c"


def test_index_key_is_pinned(monkeypatch):
    monkeypatch.setattr(engine_module, "templates_digest", lambda mask, variant=None: "d" * 64)
    monkeypatch.setattr(engine_module, "compiler_fingerprint", lambda: "cupy-cuda12x=13.6.0;nvidia-cuda-nvrtc-cu12=12.9.86")
    monkeypatch.setattr(engine_module, "__version__", "0.1.0")
    monkeypatch.setattr(engine_module, "tiling_of", lambda spec: "t")  # a tuning change must not move the pin
    spec = DecodeSpec(64, mask="sliding_window", arch="sm_90", tensor_cores=False)
    assert engine_module._spec_key(spec, masks.get("sliding_window")) == \
        "bb783028d33216a03bb182a85e7036424f4d8b11ae0b851b84a98c132da0b900"


def test_a_retuned_table_misses_the_index(monkeypatch):
    """The index key holds the spec's tiling: a kernel cached under one tuning table is not paired
    with another table's launch shape (the templates, and so the templates digest, are the same)."""
    import dataclasses

    from flashjit.kernels.mla import tiling as mla_tiling
    from flashjit.kernels.mla.spec import MLASpec

    spec = MLASpec(num_heads=128, kv_dtype="e4m3", arch="sm_90")
    mask = engine_module.mask_of(spec)
    before = engine_module._spec_key(spec, mask)
    assert engine_module._spec_key(spec, mask) == before  # deterministic
    for setting in ({"merge_cells": 4}, {"wgmma_fp8": True}):
        with monkeypatch.context() as patch:
            patch.setattr(mla_tiling, "MLA_TUNING", dataclasses.replace(mla_tiling.MLA_TUNING, **setting))
            assert engine_module._spec_key(spec, mask) != before, setting


def test_host_library_key_is_pinned(monkeypatch):
    monkeypatch.setattr(host_library, "CFLAGS", CFLAGS)
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert host_library.library_key(b"int a;", ["/usr/bin/gcc", "-m64"]) == "155e40931c9badbba94583e09c33e41e"


def test_the_host_planners_flags_are_the_ones_its_library_key_always_had(monkeypatch):
    """The C planner is built with the base flags and its defines, in this order: the key of a
    library built before its source moved to worklist/native/ is the key it has now."""
    from flashjit.worklist.record import HOST_PLAN_DEFINES

    assert (*host_library.CFLAGS, *HOST_PLAN_DEFINES) == (*CFLAGS, "-DFJ_ITEM_INTS=12")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert host_library.library_key(b"int a;", ["/usr/bin/gcc"], HOST_PLAN_DEFINES) == \
        keys.library_key(b"int a;", ["/usr/bin/gcc"], (*CFLAGS, "-DFJ_ITEM_INTS=12"))


def test_keys_module_computes_the_same_keys(monkeypatch):
    """keys.index_key and keys.library_key are what the engine and host_library hash."""
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    spec = DecodeSpec(64, mask="sliding_window", arch="sm_90", tensor_cores=False)
    assert keys.index_key(spec, masks.get("sliding_window"), "d" * 64, "0.1.0", OPTIONS,
                          "cupy-cuda12x=13.6.0;nvidia-cuda-nvrtc-cu12=12.9.86", variants.get("none"), "t") == \
        "bb783028d33216a03bb182a85e7036424f4d8b11ae0b851b84a98c132da0b900"
    assert keys.library_key(b"int a;", ["/usr/bin/gcc", "-m64"], CFLAGS) == \
        "155e40931c9badbba94583e09c33e41e"


def test_the_docstring_lists_every_key():
    functions = [name for name in vars(keys) if name.endswith("_key") and callable(getattr(keys, name))]
    assert sorted(functions) == ["cache_key", "index_key", "library_key", "portable_key"]
    for name in functions:
        assert f"\n{name}(" in keys.__doc__, name
