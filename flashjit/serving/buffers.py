"""The memory plan() writes into: the work list and the split partials on the device (PlanBuffers,
sized by a Capacity), and the pinned read-back of the page ids' range (PageIdRange)."""

from __future__ import annotations

import ctypes
import typing

import numpy as np

from ..jit.abi import ITEM_INTS, DecodeArgs, MergeArgs
from ..masks.params import MASK_PARAM_CTYPES
from .streams import DEVICE_TO_HOST, HOST_TO_DEVICE, StreamCopies


class Capacity(typing.NamedTuple):  # a NamedTuple: built every plan(), in a third of a frozen dataclass's time
    batch: int
    tokens: int
    work: int


class PlanBuffers:
    """The work list on the GPU (one int32 buffer at fixed offsets) and the fp32 split partials.

    plan() fills a pinned staging copy and sends it with one asynchronous copy; the next plan()
    waits for that copy before reusing the staging memory. Addresses never change, so CUDA-graph
    replays read the newest plan. (On a CPU device, for the tests, the copy is a plain one.)
    """

    # work_items: ITEM_INTS int32 per item (decode_common.cuh's WorkItem), first so its records are
    # 16-byte aligned; the rest are the merges' (req_*, token_request, num_tokens).
    FIELDS = ("work_items", "num_tokens", "req_qo_indptr", "req_work_indptr", "token_request")

    def __init__(self, capacity: Capacity, partial_rows: int, head_dim: int, merge_groups: int, device):
        import torch

        self.capacity = capacity
        w, b, t = capacity.work, capacity.batch, capacity.tokens
        sizes = (ITEM_INTS * w, 1, b + 1, b + 1, t)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.offsets = {name: int(offsets[i]) for i, name in enumerate(self.FIELDS)}
        self.starts = tuple(self.offsets.values())
        self.staging = torch.zeros(int(offsets[-1]), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host = self.staging.numpy()
        self.device_buffer = torch.zeros(int(offsets[-1]), dtype=torch.int32, device=device)
        base = self.device_buffer.data_ptr()
        self.pointers = {name: base + 4 * off for name, off in self.offsets.items()}
        self.tmp_o = torch.empty(max(1, partial_rows * head_dim), dtype=torch.float32, device=device)
        self.tmp_lse = torch.empty(max(1, partial_rows), dtype=torch.float32, device=device)
        # The fused merge's arrival counters and the split requests' shared-tile claims, per
        # (request, KV head, row tile): zero here, and the kernel leaves them zero.
        self.merge_counters = torch.zeros(max(1, merge_groups), dtype=torch.int32, device=device)
        self.tile_counters = torch.zeros(max(1, merge_groups), dtype=torch.int32, device=device)
        self.copies = StreamCopies(device)
        # Launch arguments over these buffers; each plan() sets its scalars, each run() its tensors.
        p = self.pointers
        self.decode_args = a = DecodeArgs()
        for name in ("work_items", "req_qo_indptr", "req_work_indptr"):
            setattr(a, name, p[name])
        a.tmp_o, a.tmp_lse = self.tmp_o.data_ptr(), self.tmp_lse.data_ptr()
        a.merge_counters, a.tile_counters = self.merge_counters.data_ptr(), self.tile_counters.data_ptr()
        self.merge_args = m = MergeArgs()
        m.tmp_o, m.tmp_lse = a.tmp_o, a.tmp_lse
        m.token_request, m.req_qo_indptr, m.req_work_indptr = p["token_request"], p["req_qo_indptr"], p["req_work_indptr"]
        m.num_tokens = p["num_tokens"]
        self.merge_params = (ctypes.c_void_p * 1)(ctypes.addressof(m))
        # The mask parameters the decode params array is built for, its value slots, and the array:
        # kept while the parameters stay the same, so that plan() keeps its prepared launch too.
        self._params_array_for, self._mask_values, self._decode_params = None, [], None
        self._plan_params = None  # (the struct, its mask slots, the array) of params_with

    def decode_params(self, mask_params: tuple, values: list) -> ctypes.Array:
        """The decode kernel's void*[]: the Args struct, then each mask parameter's value (written in place)."""
        if mask_params != self._params_array_for:
            self._mask_values = [MASK_PARAM_CTYPES[p.kind]() for p in mask_params]
            self._decode_params = (ctypes.c_void_p * (1 + len(self._mask_values)))(
                ctypes.addressof(self.decode_args), *(ctypes.addressof(v) for v in self._mask_values))
            self._params_array_for = mask_params
        for slot, value in zip(self._mask_values, values):
            slot.value = value
        return self._decode_params

    def params_with(self, struct: ctypes.Structure) -> ctypes.Array:
        """A void*[] of struct, then the mask parameters' value slots of decode_params: the GPU
        planner's parameters, which read the values the decode launch does."""
        found = self._plan_params
        if found is None or found[0] is not struct or found[1] is not self._mask_values:
            array = (ctypes.c_void_p * (1 + len(self._mask_values)))(
                ctypes.addressof(struct), *(ctypes.addressof(v) for v in self._mask_values))
            found = self._plan_params = (struct, self._mask_values, array)
        return found[2]

    def fits(self, capacity: Capacity, partial_elems: int, merge_groups: int) -> bool:
        c = self.capacity
        return (capacity.work <= c.work and capacity.batch <= c.batch and capacity.tokens <= c.tokens
                and partial_elems <= self.tmp_o.numel() and merge_groups <= self.merge_counters.numel())

    def write(self, tables, synced_stream=None):
        """A plan's work list (tables: host_planner's NumpyTables or NativeTables) to the GPU.
        synced_stream: a stream on which the host has just waited for a copy queued after this
        buffer's last copy (None: none)."""
        if synced_stream is None or synced_stream != self.copies.marked_stream:
            self.copies.wait()  # the previous plan's copy has read the staging memory
        tables.write(self.host, self.starts, self.staging.data_ptr())
        self.copies.copy(self.device_buffer.data_ptr(), self.staging.data_ptr(), 4 * len(self.host), HOST_TO_DEVICE,
                         mark=True)


class PageIdRange:
    """The range of a plan's page ids, read from the GPU without a round trip of its own.

    start() queues the read on the device's current stream, after whatever wrote the ids: the ids
    themselves into pinned memory when they are few and contiguous, else their min and max reduced
    on the GPU (a host min/max over many ids would cost more than the reduction's launch). wait()
    returns them once they have landed. plan() does its host work in between, which hides the copy's
    latency.
    """

    COPY_LIMIT = 8192  # page ids (32 KiB)

    def __init__(self, device):
        import torch

        self.host = torch.empty(self.COPY_LIMIT, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.reduced = torch.empty(2, dtype=torch.int32, device=device)
        self.copies = StreamCopies(device)
        self.pending = 0

    def start(self, indices, count: int):
        if count > self.COPY_LIMIT or (count > 1 and indices.stride(0) != 1):
            import torch

            torch.aminmax(indices[:count], out=(self.reduced[0], self.reduced[1]))
            indices, count = self.reduced, 2
        if count:
            self.copies.copy(self.host.data_ptr(), indices.data_ptr(), 4 * count, DEVICE_TO_HOST, mark=True)
        self.pending = count

    def wait(self) -> int:
        """How many values (the page ids, or their [min, max]) have landed at the start of host."""
        if self.pending:
            self.copies.wait()
        return self.pending
