"""plan()'s shared-prefix step: whether a batch may share, what it shares, and the plan's work list then.

A plan shares when every condition below holds, and otherwise plans per request as without it:
  * share_prefixes is not False and the host plans the work: an eager decoder, or CUDA-graph mode
    with share_prefixes=True (plan_graph_sharing: the GPU planner's fixed kernel is the per-request one);
  * check_page_ids=True: detection reads the page ids on the host, which waits for the stream, and
    check_page_ids=False promises plan() no wait (plan() reads the ids back then anyway);
  * the planner picks the split (no chunk_tokens, fixed_split_tokens or disable_split_kv: those
    promise a per-request cut);
  * the kernel is the 16-bit tensor-core one (or the CUDA-core one chosen for few rows per request,
    where plan() left tensor_cores to it: a shared record's rows are many), with mask none or
    causal and no variant: then every
    query sees a shared span whole (causal: the span ends at or before each member's first query
    position, which detection enforces), so one chunk's softmax state is the same for every member;
  * two neighbouring requests share a full first page (worklist/spans.neighbour_prefixes).
"""

from __future__ import annotations

import numpy as np

from ..kernels.decode.spec import TENSOR_CORE_HEAD_DIMS
from .buffers import Capacity
from ..worklist.shared import SharedTables, plan_shared_work
from ..worklist.spans import MAX_LEVELS, SharedSpans, find_shared_spans

SHARING_MASKS = ("none", "causal")

# Whether CUDA-graph plans pack short own items as eager plans do, their decode launch the packed
# entry point captured over a CTA for each record and KV head (plan_state.prepare_launches). Off:
# that path has passed the CPU tests but not yet run on a GPU.
GRAPHS_PACK = False


def own_head_pack(tiling, kv_heads: int, graph: bool) -> int:
    """KV heads one CTA of a short own item attends in a plan of this tiling: tiling.head_pack, in
    a CUDA-graph plan only where GRAPHS_PACK."""
    return tiling.head_pack(kv_heads) if GRAPHS_PACK or not graph else 1


def kernel_may_share(setup, rule, check_page_ids: bool, tensor_cores) -> bool:
    """The conditions on the plan's kernel and split arguments (the module docstring's);
    tensor_cores: plan()'s."""
    spec = setup.spec
    cores_ok = spec.tensor_cores or (tensor_cores is None and spec.head_dim in TENSOR_CORE_HEAD_DIMS)
    return (check_page_ids and not rule.one_item and rule.chunk_tokens is None and cores_ok and not spec.kv_is_fp8
            and spec.mask in SHARING_MASKS and spec.variant == "none")


def may_share(setup, rule, graph, batch: int, num_page_ids: int, check_page_ids: bool, tensor_cores) -> bool:
    """An eager plan's conditions (the module docstring's)."""
    return (graph is None and batch >= 2 and num_page_ids > 1
            and kernel_may_share(setup, rule, check_page_ids, tensor_cores))


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


def shared_work(shared_setup, tables, spans, host_planner=None, chunk_tokens: int | None = None,
                eager: bool = True):
    """(tables, work, capacity) of a batch planned for the shared_prefix kernel's setup, over shared
    spans (worklist/spans.SharedSpans, or None: every request alone in that kernel's format);
    chunk_tokens forces the chunk. Short own items may pack several KV heads a CTA (the kernel's
    packed entry point); eager plans may merge in the decode kernel (tiling.waiting_merge), while
    a CUDA graph's launches are fixed at capture, the merge's among them. The work list is made
    in C where the host planner can (HostPlanner.shared_tables), else in numpy (worklist/shared.py, the
    reference)."""
    tiling, loaded, kv_heads = shared_setup.kernel.tiling, shared_setup.loaded, shared_setup.num_kv_heads
    sizes = dict(group_size=shared_setup.spec.group_size, row_tiles=tiling.row_tiles,
                 row_warps=tiling.shared_row_warps, head_pack=own_head_pack(tiling, kv_heads, not eager),
                 merge_waits=eager and tiling.waiting_merge,
                 ctas_per_item=kv_heads * tiling.row_tiles,
                 max_ctas=loaded.num_sms * loaded.ctas_per_sm, granularity=tiling.tile_tokens,
                 chunk_tokens=chunk_tokens)
    native = getattr(host_planner, "shared_tables", None)
    found = NotImplemented if native is None else native(tables, spans, **sizes)
    if found is not NotImplemented:  # the tables are their own work summary, as NativeTables are
        shared_tables = work = found
        num_slots = found.num_slots
    else:
        shared = plan_shared_work(SharedSpans.none(tables.batch) if spans is None else spans, tables.page_indptr,
                                  tables.kv_lens, tables.query_indptr, shared_setup.page_size, **sizes)
        shared_tables, work, num_slots = SharedTables(tables, shared), shared.work, shared.num_slots
    return shared_tables, work, Capacity(tables.batch, work.num_tokens, work.num_work, num_slots)


def plan_graph_sharing(shared_setup, tables, spans, host_planner, capacity: Capacity):
    """(tables, work) of a CUDA-graph plan that shares (shared_setup: the graph's fixed kernel) in
    the fixed capacity: the planned chunk, else a chunk grown by the overflow's ratio (slots fall
    about as the chunk grows) until the records and the slots fit, else every request alone in one
    item (its requests fit the capacity: plan() checked)."""
    longest = max(1, int(np.max(tables.kv_lens, initial=0)))
    granularity = shared_setup.kernel.tiling.tile_tokens
    chunk = None
    while True:
        found, work, needs = shared_work(shared_setup, tables, spans, host_planner, chunk, eager=False)
        overflow = max(needs.work / capacity.work, needs.partial_slots / capacity.partial_slots)
        if overflow <= 1:
            return found, work
        if spans is not None and work.chunk_tokens >= longest:
            spans = None  # the spans' slots alone overflow: plan every request alone
        if spans is None:
            chunk = longest
        else:
            grown = int(np.ceil(work.chunk_tokens * overflow))
            chunk = min(max(-(-grown // granularity) * granularity, work.chunk_tokens + granularity), longest)
