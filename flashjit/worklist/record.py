"""The work list's ABI: the record every planner writes and every work-list kernel reads, and the
GPU planner's arguments and shared memory.

Three planners write the records (numpy: worklist/split.py and shared.py; C: native/host_plan.c;
CUDA: templates' worklist/device_plan.cuh) and the decode and MLA kernels read them (decode::WorkItem). The
checks that tie the sides together:

* The entry templates define FJ_ITEM_INTS as ITEM_INTS, and WorkItem asserts the width it reads.
* The C planner is built with HOST_PLAN_DEFINES (-DFJ_ITEM_INTS=ITEM_INTS); the file refuses to
  build without it, or with a width other than the one it writes. Its structs' layout is checked
  against the ctypes mirrors in worklist/host.py (tests/worklist/test_worklist_abi.py).
* PlanArgs is checked field by field in every kernel source that carries the GPU planner
  (jit/abi_checks.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

# The int32 fields of one work-item record, in order: the item's span and its request's geometry
# (request -1: CUDA-graph padding), then its tile-sharing group: the item's index in it, the span its
# CTAs share and how many items share it. The group is the request's items, or for a fixed split
# (plan(fixed_split_tokens=...)) the item alone, which then reads exactly its own span.
WORK_ITEM_FIELDS = ("request", "v_begin", "v_end", "kv_len", "page_begin", "q_begin", "q_len", "splits",
                    "share", "share_begin", "share_end", "sharers")
ITEM_INTS = len(WORK_ITEM_FIELDS)
# A shared-prefix record's last field ("sharers") holds the KV heads one CTA of a short own item
# attends (RECORD_HEADS) and, where its plan merges in the decode kernel (worklist/kernel_core.cuh's
# merge_when_written), the record's part in that merge: MERGE_COUNTS (its CTA counts its partials
# in) or MERGE_WAITS (its request's last own item: waits for the others' and combines them).
MERGE_COUNTS, MERGE_WAITS = 1 << 8, 1 << 9
RECORD_HEADS = MERGE_COUNTS - 1

# The GPU planner's shared memory: PLAN_SMEM_INTS int32 per request (plus one), for at most
# PLAN_MAX_BATCH requests, or fewer where a device's shared memory per block holds fewer beside the
# planner's static arrays (plan_batch_limit); a larger CUDA-graph batch plans on the host.
PLAN_SMEM_INTS, PLAN_MAX_BATCH = 7, 4096

# The split counts both planners try for the longest span (the render defines FJ_SPLIT_CANDIDATES).
SPLIT_CANDIDATES = tuple(range(1, 25)) + (28, 32, 40, 48, 56, 64, 80, 96, 112, 128)

PLAN_ENTRY = "flashjit_plan"  # the GPU planner's entry point in every work-list kernel's module

# The C host planner's source, the defines it is built with (they are part of its library key), and
# the functions worklist/host.py's HostPlanner calls (a library that does not export them all is not used).
HOST_PLAN_SOURCE = Path(__file__).resolve().parent / "native" / "host_plan.c"
HOST_PLAN_DEFINES = (f"-DFJ_ITEM_INTS={ITEM_INTS}",)
HOST_PLAN_SYMBOLS = ("fj_read", "fj_plan", "fj_fill", "fj_shared_spans", "fj_shared_plan", "fj_shared_fill",
                     "fj_id_range")


def plan_smem_bytes(batch: int) -> int:
    """The GPU planner's dynamic shared memory for a batch capacity of `batch` requests."""
    return 4 * PLAN_SMEM_INTS * (batch + 1)


def plan_batch_limit(block_smem_bytes: int, static_smem_bytes: int) -> int:
    """The most requests the GPU planner takes on a device whose blocks may have block_smem_bytes
    of shared memory (its opt-in limit), beside the planner's static_smem_bytes: PLAN_MAX_BATCH
    where it fits (an H100 or H200, an A100), fewer on GPUs of about 100 KB a block (sm_86, sm_89,
    sm_120), 0 if not even one."""
    fits = (block_smem_bytes - static_smem_bytes) // (4 * PLAN_SMEM_INTS) - 1
    return max(0, min(PLAN_MAX_BATCH, fits))


class PlanArgs(ctypes.Structure):
    """plan::Args, flashjit_plan's first parameter (the GPU planner)."""

    _c_name_ = "plan::Args"
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "batch", "indptr", "last_page_len", "qo_indptr", "work_items", "num_tokens", "req_qo_indptr",
        "req_work_indptr", "token_request", "chunk_out", "num_work_out")] + [(name, ctypes.c_int) for name in (
            "page_size", "batch_capacity", "work_capacity", "token_capacity", "ctas_per_item", "max_ctas",
            "granularity", "min_chunk", "chunk_tokens", "fixed_split", "item_overhead", "merge_cost")]
