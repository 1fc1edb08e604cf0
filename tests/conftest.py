"""Shared fixtures of the CPU suite, and the suite's layout.

The tests mirror the package: tests/<package>/ holds the tests of flashjit/<package>/ (tests/jit/,
tests/kernels/mla/, tests/integrations/vllm/, ...), tests/benchmarks/ those of benchmarks/, and
tests/ itself those of flashjit's top-level modules (env, validation, cuda_flavour) and of the
package as a whole (layering, the API docs, the golden sources). tests/gpu/ runs on a GPU only,
tests/frameworks/ in .venv-frameworks only. The CPU folders hold no __init__.py: pytest puts each
test file's folder and this one on sys.path, so test file names are unique across the suite, and
what tests in several folders share is a module here (cpu_decoders, cli_runner, repo_paths, ...),
imported by name; its fixtures are plugins of this file (pytest_plugins).

NVRTC needs no GPU, so these tests compile real kernels; each compile costs ~0.4 s on two CPU
cores, so one engine for the whole run (`warm`) compiles WARM_SPEC once and tests that only need
a valid cache entry copy it instead of compiling again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import flashjit.jit.engine as engine_module
from flashjit import DecodeSpec, Engine
from flashjit.jit.cache import KernelCache
from flashjit.jit.compile import CompiledKernel
from flashjit.kernels.worklist_kernel import Kernel
from flashjit.masks.registry import masks
from flashjit.masks.variants import variants

from fake_cubins import fake_cubin

# Fixtures that tests of several folders use: cpu_decoders' `planner` and `launches`, build_box's `built`.
pytest_plugins = ["cpu_decoders", "build_box"]

# tests/frameworks imports vLLM and SGLang, installed in .venv-frameworks only: `make test` runs it
# there with FLASHJIT_FRAMEWORK_TESTS=1, and the main suite leaves it out.
collect_ignore = [] if os.environ.get("FLASHJIT_FRAMEWORK_TESTS") == "1" else ["frameworks"]

# Every spec the suite builds names its arch: without a GPU there is none to infer it from.
WARM_SPEC = DecodeSpec(head_dim=64, dtype="bf16", mask="none", arch="sm_90")


@dataclasses.dataclass(frozen=True)
class Warm:
    engine: Engine
    spec: DecodeSpec
    kernel: Kernel
    cache_dir: Path

    @property
    def entry(self) -> Path:
        """The cache entry folder of WARM_SPEC."""
        return self.engine.cache.entry_dir(self.kernel.key)

    def copy_entry_to(self, cache_dir: Path, with_index: bool = True) -> Path:
        """Copy WARM_SPEC's verified entry (and its index file) into another cache dir."""
        cache = KernelCache(cache_dir)
        target = cache.entry_dir(self.kernel.key)
        shutil.copytree(self.entry, target)
        if with_index:
            shutil.copytree(self.engine.cache.base / "index", cache.base / "index", dirs_exist_ok=True)
        return target


@pytest.fixture(scope="session")
def warm(tmp_path_factory) -> Warm:
    """An engine whose cache holds WARM_SPEC, compiled once for the whole test run. Do not modify."""
    cache_dir = tmp_path_factory.mktemp("warm-cache")
    engine = Engine(cache_dir=cache_dir)
    kernel = engine.get_kernel(WARM_SPEC)
    return Warm(engine, WARM_SPEC, kernel, cache_dir)


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    """A fresh, not yet created cache folder."""
    return tmp_path / "cache"


@pytest.fixture
def engine(cache_dir) -> Engine:
    return Engine(cache_dir=cache_dir)


@pytest.fixture
def compile_log(caplog):
    """Captures the 'flashjit' logger; call it to get the messages of the INFO 'compiling' records."""
    caplog.set_level(logging.INFO, logger="flashjit")

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "flashjit" and r.levelno == logging.INFO and "compiling" in r.getMessage()]

    return messages


@pytest.fixture
def isolated_masks(monkeypatch):
    """Undo every mask registration (and FLASHJIT_TEMPLATE_PATH scan) a test makes."""
    monkeypatch.delenv("FLASHJIT_TEMPLATE_PATH", raising=False)
    saved = dict(masks._masks), masks._scanned_env
    yield masks
    with masks._lock:
        masks._masks.clear()
        masks._masks.update(saved[0])
    masks._scanned_env = saved[1]


@pytest.fixture
def isolated_variants():
    """Undo every variant registration a test makes (the golden sources cross every registered variant)."""
    saved = dict(variants._variants)
    yield variants
    with variants._lock:
        variants._variants.clear()
        variants._variants.update(saved)


def write_mask(folder: Path, name: str, visible: str, header: str = "") -> Path:
    """A user mask template that extends masks/base.cuh.j2 and overrides `visible`."""
    path = folder / f"{name}.cuh.j2"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{header}{{% extends "masks/base.cuh.j2" %}}\n'
                    f"{{% block visible %}}  {visible}{{% endblock %}}\n")
    return path


@pytest.fixture
def mask_file():
    """write_mask, for tests: mask_file(folder, name, visible_body, header='')."""
    return write_mask


class CompiledNames(list):
    """The names fake_nvrtc compiled, in order; archs: the arch each was compiled for."""

    def __init__(self):
        super().__init__()
        self.archs: dict[str, str] = {}


@pytest.fixture
def fake_nvrtc(monkeypatch) -> CompiledNames:
    """Swap the engine's NVRTC for an instant fake (fake_cubin); returns the names it compiled.

    For tests about caching, bundles and faults, where the cubin's bytes do not matter: the real
    compile costs ~0.4 s each on CI. Everything else (render, keys, index, store) stays real.
    """
    compiled = CompiledNames()

    def compile_source(source, arch, name, **kwargs):
        compiled.append(name)
        compiled.archs[name] = arch
        return CompiledKernel(fake_cubin(source, arch), "")

    monkeypatch.setattr(engine_module, "compile_source", compile_source)
    return compiled


@pytest.fixture
def shared_tmp():
    """A folder other users can reach (pytest's tmp_path is private to the user running the suite)."""
    folder = Path(tempfile.mkdtemp(prefix="flashjit-shared-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--inject-fault", metavar="FAULT:PATH", default=None,
                     help="run the session with a deliberately broken kernel (tests/fault_injection.py): every "
                          "kernel of PATH is compiled with FAULT, under keys of its own; GPU tests then fail")


@pytest.fixture(scope="session", autouse=True)
def injected_fault(request):
    """The --inject-fault of this session (fault, path), active for all of it; None without one."""
    text = request.config.getoption("--inject-fault")
    if not text:
        yield None
        return
    from fault_injection import faulted_engine, parse

    fault, path = parse(text)
    with faulted_engine(fault, path):
        yield fault, path
