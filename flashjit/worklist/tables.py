"""The protocols of a plan's tables: what plan() and run() read of the five kinds the planners make.

* BatchTables: what HostPlanner.read gives (NumpyTables, the reference; NativeTables, over the C
  planner): a batch's validated page table and query tokens, which plan() splits into work items.
* HostTables: tables whose work list the host writes into the staging buffer: those two after
  plan(), and the shared-prefix ones (SharedTables in numpy, NativeSharedTables in C).
* Tables: what a Plan holds, the host's or serving/device_planner.DeviceTables, whose work list
  the GPU planner writes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .split import WorkPlan


@runtime_checkable
class Tables(Protocol):
    batch: int          # requests
    num_tokens: int     # query tokens, all requests
    num_page_ids: int   # page ids the page table names (indptr[-1])
    max_q_len: int      # the most query tokens of one request

    def work_plan(self, host: np.ndarray, starts: tuple) -> WorkPlan:
        """The plan's work items (host: the staging buffer; starts: its fields' offsets)."""


@runtime_checkable
class HostTables(Tables, Protocol):
    kv_lens: np.ndarray  # tokens per request
    q_lens: np.ndarray   # query tokens per request

    def write(self, host: np.ndarray, starts: tuple, staging_pointer: int):
        """The work list into the staging buffer: per item its record, then the merges' arrays."""


@runtime_checkable
class BatchTables(HostTables, Protocol):
    page_indptr: np.ndarray   # [batch + 1] page-table offsets
    query_indptr: np.ndarray  # [batch + 1] query-token offsets

    def plan(self, span_begin, span_end, **options) -> WorkPlan:
        """split.plan_work over the spans the mask reads (span_end None: kv_lens)."""
