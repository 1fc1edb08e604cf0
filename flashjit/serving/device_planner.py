"""CUDA-graph mode's planner on the GPU: the page table in a fixed device buffer, and the launch
of flashjit_plan (templates/worklist/device_plan.cuh) that turns it into the work list.

plan() copies the batch's page table into the buffer (one copy from pinned memory) and queues the
planner; replan() queues it alone, over whatever the buffer holds then. Captured in a CUDA graph,
replan() re-plans every replay for the lengths the caller wrote into the buffer in place
(graph_page_table), so the host computes nothing per step. The work list the planner writes has
the layout the host planner's does (buffers.PlanBuffers.FIELDS), into the same buffers, so the
decode and merge launches are the same in both modes.
"""

from __future__ import annotations

import ctypes
import typing

import numpy as np

from ..worklist.record import ITEM_INTS, PlanArgs, plan_smem_bytes
from ..jit.launch import PreparedLaunch
from .buffers import PlanBuffers
from ..worklist.split import ITEM_OVERHEAD_TOKENS, MERGE_COST_TOKENS, MIN_CHUNK_TOKENS, WorkPlan
from .streams import HOST_TO_DEVICE, StreamCopies

PLAN_THREADS = 1024  # plan::THREADS
HEADER_INTS = 4  # batch (read), then the planner's chunk and work-item count (written), one spare


class PageTable(typing.NamedTuple):
    """Views of the device buffer the GPU planner reads: write a step's page table here in place
    (batch[0] requests, indptr[:batch + 1], last_page_len[:batch], qo_indptr[:batch + 1]) and
    replay a graph that captured replan(). page ids go into the decoder's graph_page_ids."""

    batch: object
    indptr: object
    last_page_len: object
    qo_indptr: object


class DevicePlanner:
    """One CUDA-graph decoder's GPU planner: its page-table buffer, arguments and launch."""

    def __init__(self, max_batch: int, device):
        import torch

        b = max_batch
        sizes = (HEADER_INTS, b + 1, b, b + 1)
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        total = self._starts[-1]
        pinned = device.type == "cuda"
        self.staging = torch.zeros(total, dtype=torch.int32, pin_memory=pinned)
        self.host = self.staging.numpy()
        self.buffer = torch.zeros(total, dtype=torch.int32, device=device)
        s = self._starts
        self.page_table = PageTable(self.buffer[0:1], self.buffer[s[1]:s[2]], self.buffer[s[2]:s[3]],
                                    self.buffer[s[3]:s[4]])
        self.results = torch.zeros(HEADER_INTS, dtype=torch.int32, pin_memory=pinned)  # read back by work_plan()
        self.copies = StreamCopies(device)
        self.args = a = PlanArgs()
        base = self.buffer.data_ptr()
        a.batch = base
        a.indptr, a.last_page_len, a.qo_indptr = (base + 4 * s[i] for i in (1, 2, 3))
        a.chunk_out, a.num_work_out = base + 4, base + 8
        self.launch: PreparedLaunch | None = None
        self._params = self._params_for = None

    def write_page_table(self, batch: int, indptr, last_page_len, qo_indptr, q_len):
        """A validated page table (host tensors, arrays or lists) into the buffer: one copy of the
        whole buffer (a few KB), queued on the current stream once the previous copy has read the
        staging memory."""
        self.copies.wait()
        h, s = self.host, self._starts
        h[0] = batch
        h[s[1]:s[1] + batch + 1] = _host_ints(indptr)
        h[s[2]:s[2] + batch] = _host_ints(last_page_len)
        if qo_indptr is None:
            h[s[3]:s[3] + batch + 1] = np.arange(batch + 1) * (1 if q_len is None else q_len)
        else:
            h[s[3]:s[3] + batch + 1] = _host_ints(qo_indptr)
        self.copies.copy(self.buffer.data_ptr(), self.staging.data_ptr(), 4 * s[-1], HOST_TO_DEVICE, mark=True)

    def prepare(self, setup, buffers: PlanBuffers, rule):
        """The planner's arguments for a setup over buffers and a plan_state.SplitRule, and its launch."""
        a, cap, tiling, loaded = self.args, buffers.capacity, setup.kernel.tiling, setup.loaded
        p = buffers.pointers
        a.work_items, a.num_tokens = p["work_items"], p["num_tokens"]
        a.req_qo_indptr, a.req_work_indptr, a.token_request = p["req_qo_indptr"], p["req_work_indptr"], p["token_request"]
        a.page_size = setup.page_size
        a.batch_capacity, a.work_capacity, a.token_capacity = cap.batch, cap.work, cap.tokens
        a.ctas_per_item = setup.num_kv_heads * tiling.row_tiles
        a.max_ctas = loaded.num_sms * loaded.ctas_per_sm
        a.granularity, a.min_chunk = tiling.tile_tokens, MIN_CHUNK_TOKENS
        a.chunk_tokens = -1 if rule.one_item else rule.chunk_tokens or 0
        a.fixed_split = int(rule.fixed_split)
        a.item_overhead, a.merge_cost = ITEM_OVERHEAD_TOKENS, MERGE_COST_TOKENS
        params = buffers.params_with(a)
        self.launch = PreparedLaunch.update(self.launch, loaded.plan, (1, 1, 1), (PLAN_THREADS, 1, 1), params,
                                            plan_smem_bytes(cap.batch),
                                            setup.kernel.programmatic_launch)

    def __call__(self, stream: int):
        self.launch(stream)


def _host_ints(values) -> np.ndarray:
    """Validated page-table values (a tensor on any device, an array, a list) as a host array."""
    return np.asarray(values.cpu() if hasattr(values, "cpu") else values)


class DeviceTables:
    """Plan.tables of a plan made on the GPU: the host's validated tables (batch, tokens, page
    ids) and, on request, the work list read back from the device."""

    def __init__(self, host_tables, planner: DevicePlanner, buffers: PlanBuffers):
        self.host_tables, self._planner, self._buffers = host_tables, planner, buffers
        self.batch, self.num_tokens = host_tables.batch, host_tables.num_tokens
        self.num_page_ids, self.max_q_len = host_tables.num_page_ids, host_tables.max_q_len
        self.kv_scratch = getattr(host_tables, "kv_scratch", None)  # HostPlanner.read(keep=) reads it

    def work_plan(self, host: np.ndarray, starts: tuple) -> WorkPlan:
        """The work list the GPU planner wrote, copied back (waits for the device). The arrays are
        views of the staging buffer: valid until the next plan()."""
        import torch

        planner, buffers = self._planner, self._buffers
        buffers.staging.copy_(buffers.device_buffer)
        planner.results.copy_(planner.buffer[:HEADER_INTS])
        torch.cuda.synchronize(buffers.device_buffer.device)
        _, chunk, num_work, _ = planner.results.tolist()
        _, _, qo, work_indptr, token_request = starts
        b = self.batch
        records = host[starts[0]:starts[1]].reshape(-1, ITEM_INTS)[:num_work]
        return WorkPlan(records[:, 0], records[:, 1], records[:, 2], host[work_indptr:work_indptr + b + 1],
                        host[qo:qo + b + 1], host[token_request:token_request + self.num_tokens], chunk,
                        bool(planner.args.fixed_split))
