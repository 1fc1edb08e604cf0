"""Every kind of tables a plan holds declares what plan() and run() read of it (worklist/tables.py):
the per-request tables of both host planners, the shared-prefix ones of both, and the GPU planner's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashjit.serving.device_planner import DeviceTables
from flashjit.serving.host_plan import load_host_plan
from flashjit.worklist.host import HostPlanner, NativeSharedTables, NativeTables, NumpyTables
from flashjit.worklist.shared import SharedTables, plan_shared_work
from flashjit.worklist.spans import SharedSpans
from flashjit.worklist.tables import BatchTables, HostTables, Tables

PAGE = 16
SIZES = dict(group_size=4, row_tiles=1, ctas_per_item=8, max_ctas=264, granularity=16)


def batch(prefix_pages: int = 3):
    """Four requests whose page lists start with the same prefix_pages ids, as int32 CPU tensors."""
    lists = [list(range(prefix_pages)) + [100 + 10 * r + i for i in range(r + 1)] for r in range(4)]
    indptr = torch.tensor(np.cumsum([0] + [len(p) for p in lists]), dtype=torch.int32)
    ids = torch.tensor([i for p in lists for i in p], dtype=torch.int32)
    return indptr, ids, torch.full((4,), PAGE, dtype=torch.int32)


def planned(tables):
    tables.plan(None, None, ctas_per_item=8, max_ctas=264, granularity=16)
    return tables


def test_the_numpy_planners_tables_declare_the_protocols():
    indptr, _, last = batch()
    tables = planned(HostPlanner(None).read(indptr, last, PAGE, q_len=1))
    assert type(tables) is NumpyTables
    assert isinstance(tables, BatchTables) and isinstance(tables, HostTables) and isinstance(tables, Tables)
    shared = SharedTables(tables, plan_shared_work(SharedSpans.none(tables.batch), tables.page_indptr, tables.kv_lens,
                                                   tables.query_indptr, PAGE, **SIZES))
    assert isinstance(shared, HostTables) and not isinstance(shared, BatchTables)


def test_the_c_planners_tables_declare_the_protocols():
    library = load_host_plan()
    if library is None:
        pytest.skip("no C compiler: the host planner is numpy only")
    planner = HostPlanner(library)
    indptr, ids, last = batch()
    tables = planned(planner.read(indptr, last, PAGE, q_len=1))
    assert type(tables) is NativeTables and isinstance(tables, BatchTables)
    spans = planner.shared_spans(tables, ids, PAGE, False, 4)
    shared = planner.shared_tables(tables, spans, **SIZES)
    assert type(shared) is NativeSharedTables and isinstance(shared, HostTables)


def test_the_gpu_planners_tables_declare_what_a_plan_holds():
    indptr, _, last = batch()
    tables = DeviceTables(HostPlanner(None).read(indptr, last, PAGE, q_len=1), planner=None, buffers=None)
    assert isinstance(tables, Tables) and not isinstance(tables, HostTables)


def test_an_object_without_a_work_list_is_not_tables():
    class Partial:
        batch = num_tokens = num_page_ids = max_q_len = 1

    assert not isinstance(Partial(), Tables)
