"""GPU tests: skipped cleanly on machines without CUDA."""

import os
import random
import zlib

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session", autouse=True)
def run_kernel_cache(tmp_path_factory):
    """The default engine (what integrations use) builds into a folder of this run rather than the
    user's cache, unless FLASHJIT_CACHE_DIR names one."""
    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get("FLASHJIT_CACHE_DIR"):
            patch.setenv("FLASHJIT_CACHE_DIR", str(tmp_path_factory.mktemp("default-engine")))
        yield


@pytest.fixture
def seed(request) -> int:
    """A seed from the test's id: stable across processes and runs, so a failure replays from its id."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def rng(seed) -> random.Random:
    return random.Random(seed)
