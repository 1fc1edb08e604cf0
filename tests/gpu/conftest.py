"""GPU tests: skipped cleanly on machines without CUDA, whether the folder is collected (its files
are left out) or a file of it is named on the command line (its tests are skipped)."""

import os
import random
import zlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).parent

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items):
    """The items of this folder (the hook sees the whole session's) get the gpu marker, and without
    CUDA a skip."""
    no_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if no_gpu is not None:
                item.add_marker(no_gpu)


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
