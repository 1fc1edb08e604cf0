"""plan()'s shared-prefix step: whether a batch may share, what it shares, and the plan's work list then.

A plan shares when every condition below holds, and otherwise plans per request as without it:
  * share_prefixes=True (the default) and the host plans the work (not the GPU planner of
    CUDA-graph mode, whose fixed kernel is the per-request one);
  * check_page_ids=True: detection reads the page ids on the host, which waits for the stream, and
    check_page_ids=False promises plan() no wait (plan() reads the ids back then anyway);
  * the planner picks the split (no chunk_tokens, fixed_split_tokens or disable_split_kv: those
    promise a per-request cut);
  * the kernel is the 16-bit tensor-core one (or the CUDA-core one chosen for few rows per request,
    where plan() left tensor_cores to it: a shared record's rows are many), with mask none or
    causal and no variant: then every
    query sees a shared span whole (causal: the span ends at or before each member's first query
    position, which detection enforces), so one chunk's softmax state is the same for every member;
  * two neighbouring requests share a full first page (shared_prefix.neighbour_prefixes).
"""

from __future__ import annotations

import numpy as np

from ..jit.spec import TENSOR_CORE_HEAD_DIMS
from .buffers import Capacity
from .shared_plan import SharedTables, plan_shared_work
from .shared_prefix import MAX_LEVELS, find_shared_spans

SHARING_MASKS = ("none", "causal")


def may_share(setup, rule, graph, batch: int, num_page_ids: int, check_page_ids: bool, tensor_cores) -> bool:
    """The conditions on the plan's arguments (the module docstring's); tensor_cores: plan()'s."""
    spec = setup.spec
    cores_ok = spec.tensor_cores or (tensor_cores is None and spec.head_dim in TENSOR_CORE_HEAD_DIMS)
    return (check_page_ids and graph is None and not rule.one_item and rule.chunk_tokens is None and batch >= 2
            and num_page_ids > 1 and cores_ok and not spec.kv_is_fp8 and spec.mask in SHARING_MASKS
            and spec.variant == "none")


def host_page_ids(indices, num_page_ids: int, page_range):
    """The plan's page ids on the host (a contiguous int32 CPU tensor): the copy the page-id range
    made of them (buffers.PageIdRange.ids_host), else a copy (which waits for the stream). On a CPU
    device, indices themselves (plan() has checked they are contiguous)."""
    if indices.is_cpu:
        return indices
    found = page_range.ids_host(num_page_ids)
    return indices[:num_page_ids].cpu().contiguous() if found is None else found


def shared_spans(host_planner, tables, ids, page_size: int, causal: bool):
    """find_shared_spans over the tables, in C where the host planner has its library; None when
    nothing is shared."""
    native = getattr(host_planner, "shared_spans", None)
    if native is not None:
        found = native(tables, ids, page_size, causal, MAX_LEVELS)
        if found is not NotImplemented:
            return found
    return find_shared_spans(tables.page_indptr, ids.numpy(), tables.kv_lens, tables.q_lens, page_size, causal=causal)


def plan_sharing(setup, shared_setup_for, tables, spans, host_planner=None):
    """(setup, tables, work, capacity) of a batch with shared spans (shared_prefix.SharedSpans);
    shared_setup_for() makes the shared_prefix kernel's setup. The work list is made in C where the
    host planner can (HostPlanner.shared_tables), else in numpy (shared_plan, the reference)."""
    shared_setup = shared_setup_for()
    tiling, loaded = shared_setup.kernel.tiling, shared_setup.loaded
    sizes = dict(group_size=setup.spec.group_size, row_tiles=tiling.row_tiles, row_warps=tiling.shared_row_warps,
                 ctas_per_item=setup.num_kv_heads * tiling.row_tiles, max_ctas=loaded.num_sms * loaded.ctas_per_sm,
                 granularity=tiling.tile_tokens)
    native = getattr(host_planner, "shared_tables", None)
    found = NotImplemented if native is None else native(tables, spans, **sizes)
    if found is not NotImplemented:  # the tables are their own work summary, as NativeTables are
        shared_tables = work = found
        num_slots = found.num_slots
    else:
        shared = plan_shared_work(spans, tables.page_indptr, tables.kv_lens, tables.query_indptr, setup.page_size,
                                  **sizes)
        shared_tables, work, num_slots = SharedTables(tables, shared), shared.work, shared.num_slots
    # Capacity.work sizes the records' buffer and the partials: the slots outnumber the records.
    return shared_setup, shared_tables, work, Capacity(tables.batch, work.num_tokens, max(num_slots, work.num_work))
