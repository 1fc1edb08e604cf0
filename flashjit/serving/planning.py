"""BatchDecode.plan()'s four ways of making a work list, one chosen per plan() (choose_planning):

* Eager: an eager decoder plans on the host, per request, or for the shared-prefix kernel where
  the batch shares prefixes (shared_decode.py says when).
* GraphOnDevice: CUDA-graph mode whose kernel the GPU planner serves: the host sizes the fixed
  capacity, and the planner turns the page table into the work list on the GPU, at plan() and at
  every replay of a captured replan().
* GraphOnHost: CUDA-graph mode whose kernel the GPU planner does not serve
  (GraphLimits.host_planned_because): the host plans per request, within the capacity.
* GraphShared: CUDA-graph mode with share_prefixes=True: the host plans for the shared-prefix
  kernel, from the first plan on, whether or not a batch shares.

plan() calls each step in this order: kernel_setup (the kernel the plans use), size (work and
capacity, while the page ids travel), share (after they landed), write (at commit: the work list
to the buffers) and start (the GPU planner's launch).
"""

from __future__ import annotations

import typing

from .device_planner import DevicePlanner, DeviceTables
from .plan_state import check_forced_chunk_fits, graph_capacity, split_work
from .shared_decode import host_page_ids, kernel_may_share, may_share, plan_graph_sharing, shared_spans, shared_work


class Batch(typing.NamedTuple):
    """One plan()'s batch arguments, as the planning steps read them."""

    indptr: object
    indices: object
    last_page_len: object
    qo_indptr: object
    q_len: int | None
    check_page_ids: bool
    tensor_cores: bool | None  # plan()'s argument: None lets a batch that shares take tensor cores


class Eager:
    """An eager plan: per request, or shared where the batch shares and sharing is allowed (shares)."""

    def __init__(self, shares: bool):
        self.shares = shares

    def kernel_setup(self, setup, shared_setup):
        return setup

    def size(self, setup, tables, rule, graph, previous):
        return split_work(setup, tables, rule, graph, previous)

    def share(self, setup, tables, work, capacity, batch: Batch, rule, host_planner, page_range, shared_setup):
        """(setup, tables, work, capacity): the shared-prefix kernel's where the batch shares prefixes."""
        if not (self.shares and may_share(setup, rule, None, tables.batch, tables.num_page_ids, batch.check_page_ids,
                                          batch.tensor_cores)):
            return setup, tables, work, capacity
        ids = host_page_ids(batch.indices, tables.num_page_ids, page_range)
        spans = shared_spans(host_planner, tables, ids, setup.page_size, setup.spec.mask == "causal")
        if spans is None:  # nothing is shared: the per-request plan stands
            return setup, tables, work, capacity
        setup = shared_setup(setup)
        return (setup, *shared_work(setup, tables, spans, host_planner))

    def write(self, buffers, tables, batch: Batch, synced_stream):
        buffers.write(tables, synced_stream=synced_stream)
        return tables

    def start(self, setup, buffers, rule, stream):
        """Launch what makes the work list on the GPU (stream() -> the stream handle): nothing here."""


class GraphOnHost(Eager):
    """CUDA-graph mode planned on the host, per request, within the fixed capacity."""

    def __init__(self):
        super().__init__(shares=False)


class GraphOnDevice(GraphOnHost):
    """CUDA-graph mode whose work list the GPU planner makes from the page table."""

    def __init__(self, planner: DevicePlanner):
        super().__init__()
        self.planner = planner

    def size(self, setup, tables, rule, graph, previous):
        capacity = graph_capacity(setup, tables, graph, previous, rule)
        check_forced_chunk_fits(setup, tables, rule, capacity)
        return None, capacity

    def write(self, buffers, tables, batch: Batch, synced_stream):
        self.planner.write_page_table(tables.batch, batch.indptr, batch.last_page_len, batch.qo_indptr, batch.q_len)
        return DeviceTables(tables, self.planner, buffers)

    def start(self, setup, buffers, rule, stream):
        self.planner.prepare(setup, buffers, rule)
        self.planner(stream())


class GraphShared(GraphOnHost):
    """CUDA-graph mode planned on the host for the shared-prefix kernel, shared spans or none."""

    def kernel_setup(self, setup, shared_setup):
        return shared_setup(setup)

    def size(self, setup, tables, rule, graph, previous):
        return None, graph_capacity(setup, tables, graph, previous, rule)

    def share(self, setup, tables, work, capacity, batch: Batch, rule, host_planner, page_range, shared_setup):
        ids = host_page_ids(batch.indices, tables.num_page_ids, page_range)
        spans = shared_spans(host_planner, tables, ids, setup.page_size, setup.spec.mask == "causal")
        tables, work = plan_graph_sharing(setup, tables, spans, host_planner, capacity)
        return setup, tables, work, capacity


Planning = typing.Union[Eager, GraphOnHost, GraphOnDevice, GraphShared]
EAGER, EAGER_ALONE, GRAPH_ON_HOST, GRAPH_SHARED = Eager(shares=True), Eager(shares=False), GraphOnHost(), GraphShared()


def choose_planning(graph, share_prefixes: bool | None, setup, rule, batch: Batch) -> Planning:
    """The planning of one plan(): from the decoder's mode (graph: its GraphLimits, or None),
    share_prefixes and the per-request setup."""
    if graph is None:
        return EAGER_ALONE if share_prefixes is False else EAGER
    if share_prefixes is True and kernel_may_share(setup, rule, batch.check_page_ids, batch.tensor_cores):
        return GRAPH_SHARED
    planner = graph.device_planner(setup)
    return GRAPH_ON_HOST if planner is None else GraphOnDevice(planner)


def reads_page_ids(graph, share_prefixes: bool | None) -> bool:
    """Whether a plan may read its page ids on the host (to find shared prefixes): known before the
    setup, so their copy travels with their range."""
    return share_prefixes is True or (share_prefixes is None and graph is None)
