"""What one plan() produced (Plan), and the steps that make its parts: the split work and the launches.

plan() builds a Plan only once every argument is valid and swaps it in with one assignment, so a
refused plan leaves the previous one whole. The Plan itself never changes. The ctypes structures
it refers to (the launch arguments, the prepared launches) and its buffers are shared with the next
plan over the same buffers, which rewrites them in place: their addresses are what a captured CUDA
graph holds.
"""

from __future__ import annotations

import typing

import numpy as np

from .. import validation
from ..kernels.decode.args import DecodeArgs, MergeArgs
from ..jit.launch import PreparedLaunch
from ..small_arrays import largest
from .buffers import Capacity, PlanBuffers
from .plan_setup import Setup
from .shared_decode import own_head_pack
from ..worklist.split import WorkPlan, item_counts
from ..worklist.tables import Tables


class Plan(typing.NamedTuple):  # a NamedTuple: immutable, and built in a quarter of a frozen dataclass's time
    setup: Setup                   # what the scalar arguments decided: spec, kernel, dtypes, shapes
    tables: Tables                 # the plan's tables (worklist/tables.py): the host planners', or DeviceTables
    buffers: PlanBuffers           # the work list on the device, at buffers.capacity
    page_ids: object               # the page-id tensor the arguments point at (the CUDA-graph buffer in that mode)
    max_page: int                  # the largest page id, -1 for none or unchecked: run() wants a cache with more
    batch_size: int
    num_tokens: int
    # What q and out must be: (fewest rows, most rows, q's dtype, qo heads, head_dim, out's dtype); one tuple, as
    # run() reads it twice per call. More rows than tokens only in CUDA-graph mode (up to max_tokens).
    query_form: tuple
    decode_args: DecodeArgs        # buffers.decode_args and .merge_args, which run() patches per call
    merge_args: MergeArgs
    decode_launch: PreparedLaunch
    merge_prepared: PreparedLaunch | None  # the merge's launch, kept for a later plan with a split
    merge_launch: PreparedLaunch | None    # merge_prepared where this plan runs the merge, else None

    @property
    def spec(self):
        return self.setup.spec

    @property
    def kernel(self):
        return self.setup.kernel

    @property
    def capacity(self) -> Capacity:
        return self.buffers.capacity

    @property
    def work(self) -> WorkPlan:
        """The work items. With the native host planner its arrays are views of the staging
        buffer: valid until the next plan()."""
        return self.tables.work_plan(self.buffers.host, self.buffers.starts)


class SplitRule(typing.NamedTuple):
    """How plan()'s split arguments cut the requests' spans (split_rule)."""

    chunk_tokens: int | None  # the chunk forced (chunk_tokens or fixed_split_tokens), None: planned
    one_item: bool            # disable_split_kv: one item per request
    fixed_split: bool         # fixed_split_tokens: every item reads exactly its own span (WorkPlan.fixed_split)
    argument: str             # the argument that forced the chunk, for errors


PLANNED = SplitRule(None, False, False, "chunk_tokens")  # the default: the planner picks the chunk


def _checked_tokens(name: str, value):
    if value is not None and (type(value) is not int or not 1 <= value <= validation.INT32_MAX):
        validation.fail(name, f"a positive int up to {validation.INT32_MAX} (a bool is not an int here)", repr(value))
    return value


def split_rule(chunk_tokens, fixed_split_tokens, disable_split_kv) -> SplitRule:
    """plan()'s chunk_tokens, fixed_split_tokens and disable_split_kv checked, as one rule.

    fixed_split_tokens is chunk_tokens plus the guarantee that each work item's CTAs read exactly
    its span, so a request's items, the tiles each reads and the merge's inputs depend on the
    request alone (docs/api.md, batch invariance). disable_split_kv gives each request one item,
    which depends on the request alone too (and wins over chunk_tokens). fixed_split_tokens goes
    with neither of the others."""
    if chunk_tokens is None and fixed_split_tokens is None and not disable_split_kv:
        return PLANNED
    if fixed_split_tokens is not None:
        others = [name for name, given in (("chunk_tokens", chunk_tokens is not None),
                                           ("disable_split_kv", bool(disable_split_kv))) if given]
        if others:
            validation.fail(f"fixed_split_tokens with {' and '.join(others)}",
                            "fixed_split_tokens alone (it forces the chunk itself)", "both")
        return SplitRule(_checked_tokens("fixed_split_tokens", fixed_split_tokens), False, True, "fixed_split_tokens")
    return SplitRule(_checked_tokens("chunk_tokens", chunk_tokens), bool(disable_split_kv), False,
                     "disable_split_kv" if disable_split_kv else "chunk_tokens")


def request_spans(setup: Setup, tables) -> tuple:
    """(span_begin, span_end) the mask reads per request (its kv_span, checked), None where every
    span starts at 0 or ends at the request's kv_len."""
    kernel = setup.kernel
    if kernel.mask.kv_span is None:
        return None, None
    span_begin, span_end = kernel.mask.kv_span(tables.kv_lens, tables.q_lens, setup.params)
    for name, span in (("begins", span_begin), ("ends", span_end)):  # the C planner reads one per request
        if span is not None and (span.shape if isinstance(span, np.ndarray) else np.shape(span)) != (tables.batch,):
            validation.fail(f"mask {kernel.mask.name!r}'s kv_span", f"{tables.batch} span {name}, one per request",
                            f"shape {np.shape(span)}")
    return span_begin, np.minimum(span_end, np.iinfo(np.int32).max)


def span_lengths(tables, span_begin, span_end) -> np.ndarray:
    """Each request's span length, from request_spans."""
    return np.asarray(tables.kv_lens if span_end is None else span_end if span_begin is None
                      else span_end - span_begin, dtype=np.int64)


def check_forced_chunk_fits(setup: Setup, tables, rule: SplitRule, capacity: Capacity):
    """Refuses a forced chunk (chunk_tokens or fixed_split_tokens) that cuts the batch into more
    items than CUDA-graph mode's capacity holds, as split_work does: the GPU planner, which makes
    this plan's work list, would fall back to one item per request instead."""
    if rule.chunk_tokens is None or rule.one_item:
        return
    chunk = rule.chunk_tokens
    items = int(item_counts(span_lengths(tables, *request_spans(setup, tables)), [chunk])[0][0])
    if items > capacity.work:
        validation.fail(rule.argument, f"at most {capacity.work} work items (CUDA-graph capacity)",
                        f"{items} items of {chunk} tokens")


def graph_capacity(setup: Setup, tables, graph, previous: Plan | None, rule: SplitRule = PLANNED) -> Capacity:
    """CUDA-graph mode's fixed capacity (graph: GraphLimits), which must hold this batch; a first
    plan with a fixed split sizes it for every batch the page-id buffer can hold, a shared_prefix
    kernel's for its members' partial slots."""
    loaded, spec = setup.loaded, setup.spec
    one_wave_items = max(1, loaded.num_sms * loaded.ctas_per_sm // (setup.num_kv_heads * setup.kernel.tiling.row_tiles))
    slot_bytes = spec.max_q_len * setup.num_qo_heads * (setup.head_dim + 1) * 4 if spec.shared_prefix else None
    return graph.capacity(spec, tables.batch, tables.num_tokens, one_wave_items, previous,
                          rule.chunk_tokens if rule.fixed_split else None, slot_bytes,
                          planned_chunk=rule.chunk_tokens is None or rule.one_item)


def split_work(setup: Setup, tables, rule: SplitRule, graph, previous: Plan | None) -> tuple[WorkPlan, Capacity]:
    """The work items over the span the mask reads, and the capacity they need: in CUDA-graph
    mode (graph: GraphLimits) the fixed one, which bounds them."""
    kernel = setup.kernel
    span_begin, span_end = request_spans(setup, tables)
    chunk_tokens = rule.chunk_tokens
    if rule.one_item:
        chunk_tokens = max(1, largest(span_lengths(tables, span_begin, span_end), 1))
    tiling, batch, loaded = kernel.tiling, tables.batch, setup.loaded
    ctas_per_item, max_ctas = setup.num_kv_heads * tiling.row_tiles, loaded.num_sms * loaded.ctas_per_sm
    capacity = None if graph is None else graph_capacity(setup, tables, graph, previous, rule)
    work = tables.plan(span_begin, span_end, ctas_per_item=ctas_per_item, max_ctas=max_ctas,
                       granularity=tiling.tile_tokens, chunk_tokens=chunk_tokens,
                       max_items=capacity.work if capacity else None, fixed_split=rule.fixed_split)
    if capacity is None:
        capacity = Capacity(batch, work.num_tokens, work.num_work)
    elif work.num_work > capacity.work:
        validation.fail(rule.argument, f"at most {capacity.work} work items (CUDA-graph capacity)",
                        f"{work.num_work} items of {work.chunk_tokens} tokens")
    return work, capacity


def prepare_launches(setup: Setup, buffers: PlanBuffers, work: WorkPlan, decode_params, graph: bool,
                     previous: Plan | None) -> tuple:
    """(decode launch, merge launch kept, merge launch to run or None). The previous plan's launches
    are re-aimed at the new grids where they run the same function over the same params array
    (PreparedLaunch.update): cheaper than converting their arguments to ctypes again."""
    kernel = setup.kernel
    cap, tiling, loaded = buffers.capacity, kernel.tiling, setup.loaded
    # Packed own items run in the entry point that reads them. An eager plan gives them a grid of
    # their own, whose CTAs that entry maps from where they start (packed_from). A graph's grid is
    # fixed at capture, a CTA for each record's KV head: where its plans pack (own_head_pack), it
    # launches the packed entry with packed_from -1, which reads from each record whether it is
    # packed, and a packed record's CTAs other than the first of each pack exit.
    if graph:
        packs = own_head_pack(tiling, setup.num_kv_heads, graph=True) > 1
        decode_grid, packed_from = tiling.grid(cap.work, setup.num_kv_heads), -1 if packs else cap.work
    else:
        packs = work.packed_items > 0
        decode_grid = tiling.grid(work.num_work, setup.num_kv_heads, work.packed_items)
        packed_from = work.num_work - work.packed_items
    buffers.decode_args.packed_from = packed_from
    programmatic = kernel.programmatic_launch
    function = loaded.decode_packed if packs else loaded.decode
    decode = PreparedLaunch.update(None if previous is None else previous.decode_launch, function, decode_grid,
                                   tiling.block, decode_params, tiling.smem_bytes, programmatic)
    kept_merge = None if previous is None else previous.merge_prepared
    if tiling.fused_merge:  # the decode kernel merges split requests itself
        return decode, kept_merge, None
    # Graphs always launch the merge (its blocks exit early when nothing was split); a plan
    # without a split keeps the prepared merge for the next plan that has one.
    merge = PreparedLaunch.update(kept_merge, loaded.merge, (cap.tokens if graph else work.num_tokens,
                                                             setup.num_qo_heads, 1), tiling.merge_block,
                                  buffers.merge_params, programmatic=programmatic)
    return decode, merge, merge if graph or work.needs_merge else None
