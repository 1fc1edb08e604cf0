"""Decoder: the lifecycle every plan/run API shares (BatchDecode, BatchDecodeMLA).

construct (engine, device, CUDA-graph limits, host planner) -> plan() (read and check the batch's
page table, plan the work, size and fill the buffers, build a Plan that replaces the previous
one whole) -> run() (point the arguments at the tensors, launch). A subclass names its kernel
family's setup and arguments; the steps every family takes are here, once.
"""

from __future__ import annotations

from .. import validation
from ..jit.engine import Engine, default_engine
from ..kernels.worklist_kernel import Kernel
from ..worklist.host import HostPlanner
from . import run_checks
from .buffers import Capacity, PageIdRange, PlanBuffers
from .device_choice import decoder_device
from .graph_mode import graph_limits
from .host_plan import load_host_plan
from .streams import stream_getter


class Decoder:
    """What a plan/run API of a work-list family holds and does besides its family's own steps."""

    def __init__(self, engine: Engine | None, device, *, use_cuda_graph: bool, max_batch_size: int | None,
                 max_num_pages: int | None, max_tokens: int | None, max_q_len: int | None, page_ids_buffer, arch,
                 load_kernel, current_stream, host_planner: HostPlanner | None, page_id_range: PageIdRange | None):
        import torch

        from . import torch_ops

        self.device, self._arch = decoder_device(torch, device, arch, type(self).__name__)  # first: a refused device changes nothing
        self.engine = engine or default_engine()
        self._device_index = self.device.index
        self._compiling = torch.compiler.is_compiling  # True while torch.compile traces run()
        self._op_handle = torch_ops.register(self)  # how torch.ops.flashjit's operators find this decoder
        self._load_kernel = load_kernel or Kernel.loaded
        self._current_stream = current_stream or stream_getter()
        self.use_cuda_graph = use_cuda_graph
        self._graph = graph_limits(use_cuda_graph, self.device, max_batch_size, max_num_pages, max_tokens, max_q_len,
                                   page_ids_buffer)
        self._page_id_range = PageIdRange(self.device) if page_id_range is None else page_id_range
        if host_planner is None:  # an engine that may not compile (strict mode) builds no C helper either
            host_planner = HostPlanner(load_host_plan(self.engine.cache, build=self.engine.allow_compile))
        self._host_planner = host_planner
        self._lse_dtype = torch.float32
        self._plan = None  # the current plan; each successful plan() replaces it whole
        # id(tensor) -> what it was validated as: each layer's cache is validated once a plan.
        self._validated_caches: dict = {}
        # scale_key()s of the scales the arguments hold (None: none yet): the scales rarely change between calls.
        self._scales_pointed_at = None

    # ---- plan -------------------------------------------------------------------------------

    def _read_batch(self, indptr, indices, last_page_len, page_size: int, qo_indptr, q_len, check_page_ids,
                    read_ids: bool = False):
        """(the host tables, the page-id range started) of a batch: the page table and query tokens
        read and checked, the page ids checked against it, and their range (with read_ids, their
        values too) travelling to the host while the caller plans; _page_ids_landed ends it."""
        import torch

        previous = self._plan
        tables = self._host_planner.read(indptr, last_page_len, page_size, qo_indptr, q_len,
                                         keep=None if previous is None else previous.tables)
        num_page_ids = tables.num_page_ids
        validation.tensor("indices", indices, dtype=torch.int32, device=self.device, ndim=1)
        if indices.shape[0] < num_page_ids:
            validation.fail("indices", f"at least indptr[-1]={num_page_ids} page ids", indices.shape[0])
        if num_page_ids > 1 and indices.stride(0) != 1:  # the kernel reads them as one run
            validation.fail("indices", "a contiguous tensor (stride 1)", f"stride {indices.stride(0)}")
        if self._graph is not None:
            self._graph.check_page_id_count(num_page_ids)
        if not isinstance(check_page_ids, bool):
            validation.fail("check_page_ids", "True or False", check_page_ids)
        # The page-id range travels to the host while the host plans, instead of in a round trip of
        # its own; a negative id is still reported ahead of any later argument error.
        self._page_id_range.start(indices, num_page_ids if check_page_ids else 0, ids=read_ids)
        return tables, self._page_id_range

    def _page_ids_landed(self, page_range: PageIdRange) -> tuple[int, int]:
        """(ids whose range landed, the largest page id or -1): run() checks the cache against it."""
        landed, max_page = page_range.wait(), -1
        if landed:
            max_page = validation.largest_page_id(*self._host_planner.id_range(page_range.host, landed))
        return landed, max_page

    def _buffers_with(self, capacity: Capacity, partial_rows: int, width: int, merge_groups: int,
                      previous) -> PlanBuffers:
        """The previous plan's buffers where the new one fits in them, else new ones (never in
        CUDA-graph mode, whose captured launches hold the first plan's)."""
        current = None if previous is None else previous.buffers
        if current is not None and current.fits(capacity, partial_rows * width, merge_groups):
            return current
        if current is not None and self._graph is not None:
            self._graph.refuse_new_buffers()
        return PlanBuffers(capacity, partial_rows, width, merge_groups, self.device)

    # ---- what the current plan decided ------------------------------------------------------

    @property
    def current_plan(self):
        """The current plan (None before the first): setup, buffers, launch arguments and launches."""
        return self._plan

    @property
    def work(self):
        """The current plan's work items (None before the first plan). With the native host planner
        its arrays are views of the staging buffer: valid until the next plan()."""
        return None if self._plan is None else self._plan.work

    @property
    def graph_page_ids(self):
        """CUDA-graph mode: the page-id buffer the kernels read (None otherwise)."""
        return None if self._graph is None else self._graph.page_ids

    # ---- run --------------------------------------------------------------------------------

    def _lse_pointer(self, lse, out) -> int:
        """data_ptr of lse, a contiguous float32 [out's rows, heads]; the common valid case in a few reads."""
        try:
            if (lse.dtype is self._lse_dtype and lse.get_device() == self._device_index and lse.shape == out.shape[:2]
                    and lse.is_contiguous()):
                return lse.data_ptr()
        except AttributeError:  # not a tensor: the checks say what it is
            pass
        return run_checks.lse_pointer(lse, out, self._lse_dtype, self.device)
