"""BatchDecode and BatchDecodeMLA on the CPU device, for the tests of plan() and run() in every folder.

The collaborators a GPU would provide are injected: the arch, and a kernel loader that reports a
fixed occupancy (132 SMs x 2 CTAs for decode, x 1 for MLA) instead of loading anything. plan()'s
copies are then plain copies, and run()'s launches are recorded (`launches`) instead of made.
`planner` and `launches` are fixtures (tests/conftest.py lists this module in pytest_plugins).
"""

from __future__ import annotations

import functools
import tempfile

import numpy as np
import pytest
import torch

from flashjit.jit import launch as launcher
from flashjit.jit.cache import KernelCache
from flashjit.kernels.worklist_kernel import LoadedKernel
from flashjit.serving.batch_decode import BatchDecode
from flashjit.serving.batch_mla import BatchDecodeMLA
from flashjit.serving.host_plan import load_host_plan
from flashjit.worklist.host import HostPlanner

NUM_SMS, CTAS_PER_SM, DECODE_FN, MERGE_FN, PACKED_FN = 132, 2, 0xD0, 0xE0, 0xD1
MLA_CTAS_PER_SM = 1
CPU = torch.device("cpu")


def fake_loaded(kernel, device_index) -> LoadedKernel:
    """A kernel 'loaded' instantly, with the occupancy of NUM_SMS x CTAS_PER_SM (and its packed entry
    point where its tiling has one)."""
    packed = PACKED_FN if kernel.tiling.packed_entry else None
    return LoadedKernel(None, DECODE_FN, MERGE_FN, CTAS_PER_SM, NUM_SMS, decode_packed=packed)


def fake_loaded_mla(kernel, device_index) -> LoadedKernel:
    """An MLA kernel 'loaded' instantly, with the occupancy of NUM_SMS x MLA_CTAS_PER_SM."""
    return LoadedKernel(None, DECODE_FN, None, MLA_CTAS_PER_SM, NUM_SMS)


def cpu_decoder(engine, **options) -> BatchDecode:
    """A BatchDecode on the CPU; options are BatchDecode's (use_cuda_graph, max_batch_size, host_planner, ...)."""
    options.setdefault("host_planner", HostPlanner(native_library()))
    options.setdefault("load_kernel", fake_loaded)
    return BatchDecode(engine, CPU, arch="sm_90", **options)


def cpu_mla(engine, **options) -> BatchDecodeMLA:
    """A BatchDecodeMLA on the CPU (the numpy host planner unless options name another)."""
    options.setdefault("host_planner", HostPlanner(None))
    return BatchDecodeMLA(engine, CPU, arch="sm_90", load_kernel=fake_loaded_mla, **options)


@functools.cache
def native_library():
    """plan()'s C helper, built once for these tests (None without a C compiler: the numpy planner)."""
    return load_host_plan(KernelCache(tempfile.mkdtemp(prefix="flashjit-test-host-")))


@pytest.fixture
def planner(engine, fake_nvrtc):
    """An engine whose kernels compile instantly (cpu_decoder 'loads' them)."""
    return engine


def tables(kv_lens, page_size, rng, spare_pages=3):
    """indptr, indices (page ids shuffled by the numpy Generator rng), last_page_len of a batch."""
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    ids = rng.permutation(sum(pages) + spare_pages)[: sum(pages)].astype(np.int32)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)]
    return torch.from_numpy(indptr), torch.from_numpy(ids), torch.tensor(last, dtype=torch.int32)


def page_table(kv_lens, page_size):
    """indptr, indices (one fixed shuffle), last_page_len of a batch."""
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = torch.tensor([0] + list(np.cumsum(pages)), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    indices = torch.randperm(int(indptr[-1]) + 2, generator=torch.Generator().manual_seed(0))[:int(indptr[-1])]
    return indptr, indices.to(torch.int32), last


def launch_of(args) -> tuple:
    """(function, grid, block, smem, stream, programmatic) of one cuLaunchKernelEx call's arguments."""
    config = args[0]._obj  # ctypes.byref(LaunchConfig)
    programmatic = config.num_attrs == 1 and (config.attrs[0].id, config.attrs[0].value) == (6, 1)
    return (args[1].value, tuple(config.grid), tuple(config.block), config.shared_mem_bytes, config.stream or 0,
            programmatic)


@pytest.fixture
def launches(monkeypatch):
    """(function, grid, stream) of each launch, with the argument structs as they were then."""
    calls = []

    def record(*args):
        function, grid, _, _, stream, _ = launch_of(args)
        calls.append((function, grid, stream))
        return 0

    monkeypatch.setattr(launcher, "_cu_launch", record)
    return calls
