"""`built`: a build box's cache of five kernels, made once per test module (tests/conftest.py lists
this module in pytest_plugins), for the bundle and write-trust tests."""

from __future__ import annotations

import pytest

import flashjit.jit.engine as engine_module
from flashjit import DecodeSpec, Engine
from flashjit.jit.compile import CompiledKernel
from flashjit.kernels.mla.spec import MLASpec

from fake_cubins import fake_cubin

# The warm (really compiled) spec plus four the fake NVRTC builds: two archs, three masks, and an MLA
# spec compiled for sm_90a (its wgmma kernel) under its arch sm_90.
OTHER_SPECS = [DecodeSpec(128, mask="causal", group_size=4, arch="sm_80"),
               DecodeSpec(128, mask="sliding_window", group_size=4, arch="sm_90"),
               DecodeSpec(64, mask="none", page_size=32, arch="sm_80"),
               MLASpec(num_heads=128, arch="sm_90")]


@pytest.fixture(scope="module")
def built(warm, tmp_path_factory):
    """A build box's cache: WARM_SPEC (copied) and OTHER_SPECS (fake-compiled). Do not modify."""
    cache_dir = tmp_path_factory.mktemp("build-box")
    warm.copy_entry_to(cache_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "compile_source",
                      lambda source, arch, name, **kw: CompiledKernel(fake_cubin(source, arch), ""))
        Engine(cache_dir=cache_dir).prewarm(OTHER_SPECS, jobs=2)
    return cache_dir, [warm.spec] + OTHER_SPECS
