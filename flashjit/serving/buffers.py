"""The memory plan() writes into: the work list and the split partials on the device (PlanBuffers,
sized by a Capacity), and the pinned read-back of the page ids' range (PageIdRange)."""

from __future__ import annotations

import ctypes
import typing

import numpy as np

from ..worklist.record import ITEM_INTS
from ..kernels.decode.args import DecodeArgs, MergeArgs
from ..masks.params import MASK_PARAM_CTYPES
from .streams import DEVICE_TO_HOST, HOST_TO_DEVICE, StreamCopies


class Capacity(typing.NamedTuple):  # a NamedTuple: built every plan(), in a third of a frozen dataclass's time
    batch: int
    tokens: int
    work: int       # work items: the records' buffer and the decode grid
    slots: int = 0  # split partials, where they outnumber the items (a shared record writes one per member)

    @property
    def partial_slots(self) -> int:
        return max(self.work, self.slots)


class PlanBuffers:
    """The work list on the GPU (one int32 buffer at fixed offsets) and the fp32 split partials.

    plan() fills a pinned staging copy and sends it with one asynchronous copy; the next plan()
    waits for that copy before reusing the staging memory. Addresses never change, so CUDA-graph
    replays read the newest plan. (On a CPU device, for the tests, the copy is a plain one.)
    """

    # work_items: ITEM_INTS int32 per item (worklist/kernel_core.cuh's WorkItem), first so its records are
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

    def set_param_value(self, index: int, value) -> None:
        """Rewrite one parameter value of decode_params (index: in the kernel's order, mask's then variant's)."""
        self._mask_values[index].value = value

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
        """A plan's work list (tables: worklist/host.py's NumpyTables or NativeTables) to the GPU.
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
    latency. A plan that may share prefixes asks for every id as well (start(..., ids=True)), which
    then come in the same wait.
    """

    COPY_LIMIT = 8192  # page ids (32 KiB)
    # A plan that may share prefixes reads every page id on the host (shared_decode.host_page_ids):
    # past COPY_LIMIT they come in a copy of their own, queued behind the range's, up to this many
    # (4 MiB of pinned memory at most, grown as batches need it).
    IDS_COPY_LIMIT = 1 << 20

    def __init__(self, device, *, copy_ids: bool | None = None):
        """copy_ids: whether start(..., ids=True) copies the ids past COPY_LIMIT (default on a GPU;
        on the CPU the ids are host memory already)."""
        import torch

        self.pinned = device.type == "cuda"
        self.host = torch.empty(self.COPY_LIMIT, dtype=torch.int32, pin_memory=self.pinned)
        self.reduced = torch.empty(2, dtype=torch.int32, device=device)
        self.copies = StreamCopies(device)
        self.pending = 0
        self.copy_ids = self.pinned if copy_ids is None else copy_ids
        self.ids = self.host  # where the last start() copied all its ids, when ids_pending says so
        self.ids_pending = self.ids_in_host = 0

    def start(self, indices, count: int, ids: bool = False):
        """ids: the caller reads all count ids too (ids_host() after wait())."""
        self.ids_pending = 0
        self.ids_in_host = 0  # ids (not their range) copied into host
        if count > self.COPY_LIMIT or (count > 1 and indices.stride(0) != 1):
            import torch

            torch.aminmax(indices[:count], out=(self.reduced[0], self.reduced[1]))
            if ids and self.copy_ids and count <= self.IDS_COPY_LIMIT and indices.stride(0) == 1:
                self._copy_ids(indices, count)
            indices, count = self.reduced, 2
        else:
            self.ids_in_host = count
        if count:
            self.copies.copy(self.host.data_ptr(), indices.data_ptr(), 4 * count, DEVICE_TO_HOST, mark=True)
        self.pending = count

    def _copy_ids(self, indices, count: int):
        if len(self.ids) < count or self.ids is self.host:
            import torch

            size = max(2 * self.COPY_LIMIT, 1 << (count - 1).bit_length())
            self.ids = torch.empty(min(size, self.IDS_COPY_LIMIT), dtype=torch.int32, pin_memory=self.pinned)
        self.copies.copy(self.ids.data_ptr(), indices.data_ptr(), 4 * count, DEVICE_TO_HOST)
        self.ids_pending = count

    def ids_host(self, count: int):
        """The first count page ids on the host (a contiguous int32 CPU tensor), after wait(): the
        range's copy or the ids' own; None when start() copied neither."""
        if self.ids_in_host == count:
            return self.host[:count]
        if self.ids_pending == count:
            return self.ids[:count]
        return None

    def wait(self) -> int:
        """How many values (the page ids, or their [min, max]) have landed at the start of host."""
        if self.pending:
            self.copies.wait()
        return self.pending
