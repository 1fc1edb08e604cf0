"""BatchDecode: the serving API. plan() once per batch composition, run() once per layer.

Conventions follow FlashInfer's paged KV cache: CSR `indptr` [B+1] into `indices` (physical
page ids), `last_page_len` [B] (tokens in each request's last page), a cache of
[pages, page_size, kv_heads, head_dim] (NHD) or [pages, kv_heads, page_size, head_dim] (HND),
as separate K and V tensors or one [pages, 2, ...] tensor. Queries are [tokens, qo_heads, head_dim].

plan() validates, plans split-KV work, copies the work list to the GPU once and builds the launch
arguments. run() checks the tensors, patches the pointers and launches: no allocation when `out`
(and `lse`) are given, no host synchronization.
"""

from __future__ import annotations

import ctypes
import functools
import math
import typing
import weakref

import numpy as np

from .. import validation
from ..jit.engine import Engine
from ..jit.host_library import load as load_host_library
from .host_planner import ITEM_INTS, HostPlanner
from ..jit.kernel import MASK_PARAM_CTYPES, DecodeArgs, Kernel, LoadedKernel, MergeArgs, PreparedLaunch
from .split_plan import WorkPlan
from ..masks.registry import masks
from ..small_arrays import largest
from ..jit.spec import KV_DTYPES, DecodeSpec, normalize_dtype

LOG2E = 1.4426950408889634
_default_engine: Engine | None = None


def default_engine() -> Engine:
    global _default_engine
    if _default_engine is None:
        _default_engine = Engine()
    return _default_engine


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)  # the spec's dtype names are torch's


def _current_stream(device_index: int) -> int:
    return _stream_getter()(device_index)


@functools.cache
def _stream_getter():
    """torch's raw current-stream getter (0.2 us instead of ~5 us for the stream object), looked up
    once: the import and getattr cost twice the call."""
    import torch

    return getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
        lambda index: torch.cuda.current_stream(index).cuda_stream)


_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind


@functools.cache
def _device_getter():
    """torch's current-device index getter (0.14 us against 0.45 for torch.cuda.current_device())."""
    import torch

    return getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


class _StreamCopies:
    """Copies in the order of the device's current stream, and an event to wait for the latest.

    They go through CUDA's runtime API: ~3 us of host time a copy on the H200 machine, where torch's
    copy_ with its slicing costs ~15 us and the stream object a torch event is recorded on ~5 us.
    On a CPU device (the tests) a copy is a memmove and there is nothing to wait for.
    """

    def __init__(self, device):
        self.device, self.event = device, None
        self.marked_stream = None  # the stream the last marked copy went on
        if device.type == "cuda":
            import torch
            from cupy.cuda import runtime

            self.runtime = runtime
            with torch.cuda.device(device):
                self.event = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
            weakref.finalize(self, runtime.eventDestroy, self.event).atexit = False

    def copy(self, dst: int, src: int, nbytes: int, kind: int, *, mark: bool = False):
        """Queue a copy of nbytes from address src to dst (kind: a cudaMemcpyKind); mark: let wait() wait for it."""
        if self.event is None:
            ctypes.memmove(dst, src, nbytes)
            return
        index = self.device.index
        if _device_getter()() != index:  # the runtime API works on the current device
            import torch

            with torch.cuda.device(index):
                return self.copy(dst, src, nbytes, kind, mark=mark)
        stream = _current_stream(index)
        self.runtime.memcpyAsync(dst, src, nbytes, kind, stream)
        if mark:
            self.runtime.eventRecord(self.event, stream)
            self.marked_stream = stream

    def wait(self):
        """Block until the last marked copy is done (at once if none was marked)."""
        if self.event is not None:
            self.runtime.eventSynchronize(self.event)


class BatchDecode:
    """Paged-KV decode attention for a batch of requests.

    >>> decoder = BatchDecode(device="cuda")
    >>> decoder.plan(indptr, indices, last_page_len, 32, 8, 128, 16, mask="causal")
    >>> out = decoder.run(q, (k_cache, v_cache))
    """

    def __init__(self, engine: Engine | None = None, device="cuda", *, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_num_pages: int | None = None, max_tokens: int | None = None,
                 max_q_len: int | None = None):
        """use_cuda_graph: run() launches fixed-size grids over fixed buffers, so a captured run()
        replays correctly after a new plan() with other lengths and page tables. Needs
        max_batch_size (requests) and max_num_pages (page ids in one plan's indices; plan() copies
        them into a buffer of that size), optionally max_q_len (query tokens per request any plan
        may have, default the first plan's largest) and max_tokens (query tokens in all, default
        max_batch_size x max_q_len). Every plan() then uses one kernel, built for max_q_len, so
        the heads, head_dim, dtypes, mask and page size must stay the same, while the query tokens
        per request may vary up to max_q_len (speculative decoding). Scalars such as sm_scale and
        window_left, and mask tensors, are part of the captured launch: keep them the same too."""
        import torch

        self.engine = engine or default_engine()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            validation.fail("device", "a CUDA device", self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._arch = "sm_%d%d" % torch.cuda.get_device_capability(self.device)
        self.use_cuda_graph = use_cuda_graph
        for name, value in (("max_batch_size", max_batch_size), ("max_num_pages", max_num_pages)):
            if use_cuda_graph and (not isinstance(value, int) or value < 1):
                validation.fail(name, "a positive int when use_cuda_graph=True", value)
        if max_q_len is not None and (not use_cuda_graph or not isinstance(max_q_len, int) or max_q_len < 1):
            validation.fail("max_q_len", "a positive int, with use_cuda_graph=True", max_q_len)
        self._graph_q_len = max_q_len  # the CUDA-graph kernel's query tokens per request, once known
        self._max_batch_size, self._max_tokens = max_batch_size, max_tokens
        self._graph_indices = (torch.zeros(max_num_pages, dtype=torch.int32, device=self.device)
                               if use_cuda_graph else None)
        self._buffers: _PlanBuffers | None = None
        self._page_range = _PageIdRange(self.device)
        self._host_planner = HostPlanner(load_host_library("host_plan", self.engine.cache))
        self._tables = None  # the current plan's host tables (host_plan.NumpyTables or NativeTables)
        self._lse_dtype = torch.float32
        self._kv_checked: dict = {}  # id(tensor) -> (weakref, data_ptr, strides): caches already validated
        self._last_cache = _NO_CACHE  # the cache the arguments point at (see _set_cache)
        self._scales_key = None  # the k_scale/v_scale the arguments hold
        self._scale_rules = None  # (decode args, fp8 cache, kv heads) they were validated for
        self._decode_launch = self._merge_prepared = self._merge_launch = None  # kept from plan to plan
        self._setups: dict = {}  # plan()'s scalars (and their types) -> {kernel query tokens: _Setup}
        self._setup = self._args_for = None  # the current plan's setup; the (setup, buffers) the arguments hold
        self._planned = False

    # ---- plan -------------------------------------------------------------------------------

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, qo_indptr=None, q_len: int | None = None, mask: str = "none",
             window_left: int | None = None, mask_params: dict | None = None, q_dtype="bfloat16",
             kv_dtype=None, kv_layout: str = "NHD", sm_scale: float | None = None,
             chunk_tokens: int | None = None, disable_split_kv: bool = False,
             tensor_cores: bool | None = None, check_page_ids: bool = True) -> "BatchDecode":
        """Plans a batch for every layer's run(); see docs/api.md for the arguments.

        check_page_ids: read the page ids' range back from the GPU, so that a negative id fails
        here and run() refuses a cache with too few pages. That waits for the work already queued
        on the current stream. False skips it (no synchronization: plan() can overlap the GPU's
        previous step); the caller then guarantees 0 <= id < the cache's page count, as FlashInfer's
        plan() assumes.
        """
        import torch

        # A serving loop plans one configuration every step: what its scalars decide is memoized
        # (_Setup). Types are part of the key, as 128.0 == 128 yet only the int is valid; mask_params
        # may hold tensors, so plans given them build their setup each time.
        scalars = (num_qo_heads, num_kv_heads, head_dim, page_size, mask, window_left, q_dtype, kv_dtype, kv_layout,
                   sm_scale, tensor_cores)
        key = (scalars, tuple(map(type, scalars))) if mask_params is None else None
        try:
            known = self._setups.get(key)
        except TypeError:  # an unhashable argument: the checks below say what is wrong with it
            key = known = None
        if known is None:
            validation.head_counts(num_qo_heads, num_kv_heads, page_size)
        # The query tokens are each request's newest positions (kv_len - q_len + i).
        tables = self._host_planner.read(indptr, last_page_len, page_size, qo_indptr, q_len)
        num_page_ids = tables.num_page_ids

        validation.tensor("indices", indices, dtype=torch.int32, device=self.device, ndim=1)
        if indices.shape[0] < num_page_ids:
            validation.fail("indices", f"at least indptr[-1]={num_page_ids} page ids", indices.shape[0])
        if num_page_ids > 1 and indices.stride(0) != 1:  # the kernel reads them as one run
            validation.fail("indices", "a contiguous tensor (stride 1)", f"stride {indices.stride(0)}")
        if self._graph_indices is not None and num_page_ids > self._graph_indices.numel():
            validation.fail("indices", f"at most max_num_pages={self._graph_indices.numel()} page ids", num_page_ids)
        if not isinstance(check_page_ids, bool):
            validation.fail("check_page_ids", "True or False", check_page_ids)
        # The page-id range travels to the host while the host plans, instead of in a round trip of
        # its own; a negative id is still reported ahead of any later argument error.
        self._page_range.start(indices, num_page_ids if check_page_ids else 0)
        try:
            kernel_q_len = self._kernel_q_len(tables.max_q_len)
            setup = None if known is None else known.get(kernel_q_len)
            if setup is None or setup.mask_generation != masks.generation:
                setup = self._make_setup(scalars, mask_params, kernel_q_len)
                if key is not None:
                    if len(self._setups) >= _MAX_SETUPS:
                        self._setups.clear()
                    self._setups.setdefault(key, {})[kernel_q_len] = setup
            if self.use_cuda_graph and self._planned and setup.spec != self.spec:
                validation.fail("plan() with use_cuda_graph=True", f"the first plan's kernel {self.spec.name}",
                            setup.spec.name)
            work, capacity = self._split_work(setup, tables, chunk_tokens, disable_split_kv)
        finally:
            landed, max_page = self._page_range.wait(), -1
            if landed:  # run() checks the cache against the largest id
                max_page = validation.largest_page_id(*self._host_planner.id_range(self._page_range.host, landed))
        buffers = self._ensure_buffers(capacity, setup)

        # Every argument is valid: from here on the new plan replaces the previous one.
        held = self._args_for  # the launch arguments hold another setup's values unless it is this one
        fresh = held is None or held[0] is not setup or held[1] is not buffers
        if setup is not self._setup:
            self._adopt(setup)
        self._max_page = max_page
        self._tables = tables
        self.batch_size, self.num_tokens = tables.batch, work.num_tokens
        self._q_shape = (work.num_tokens, setup.num_qo_heads, setup.head_dim)
        self._q_rows = (work.num_tokens, capacity.tokens if self.use_cuda_graph else work.num_tokens)
        self._num_page_ids = num_page_ids
        self._kv_checked.clear()  # cache tensors are validated against this plan (page count, shape)
        self._last_cache = _NO_CACHE
        # A page-id range that landed was copied after the previous plan's work list, on the same
        # stream if the copies say so: then the staging memory is free without a wait of its own.
        buffers.write(tables, synced_stream=self._page_range.copies.marked_stream if landed else None)
        self._build_args(setup, work, indices, fresh)
        self._planned = True
        return self

    def _make_setup(self, scalars: tuple, mask_params, kernel_q_len: int) -> "_Setup":
        """What a plan's scalars decide: validated, the spec compiled (or found) and loaded."""
        (num_qo_heads, num_kv_heads, head_dim, page_size, mask, window_left, q_dtype, kv_dtype, kv_layout, sm_scale,
         tensor_cores) = scalars
        validation.head_counts(num_qo_heads, num_kv_heads, page_size)
        generation = masks.generation  # before the lookups: a mask registered meanwhile makes a new setup
        spec = DecodeSpec.cached(head_dim, q_dtype, kv_dtype, mask, page_size, num_qo_heads // num_kv_heads,
                                 kernel_q_len, kv_layout, self._arch, tensor_cores)
        kernel = self.engine.get_kernel(spec)
        loaded = kernel.loaded(self.device.index)
        params = self._mask_params(kernel.mask, window_left, mask_params)
        kv_shape = ((page_size, num_kv_heads, head_dim) if spec.kv_layout == "NHD"
                    else (num_kv_heads, page_size, head_dim))
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        return _Setup(spec, kernel, loaded, params, scale * LOG2E, num_qo_heads, num_kv_heads, head_dim, page_size,
                      _torch_dtype(spec.dtype), _torch_dtype(spec.kv_dtype), kv_shape, generation)

    def _adopt(self, setup: "_Setup"):
        """The attributes run() and the properties read from a setup."""
        self._setup = setup
        self.spec, self.kernel = setup.spec, setup.kernel
        self.num_qo_heads, self.num_kv_heads = setup.num_qo_heads, setup.num_kv_heads
        self.head_dim, self.page_size = setup.head_dim, setup.page_size
        self._q_dtype, self._kv_dtype, self._kv_shape = setup.q_dtype, setup.kv_dtype, setup.kv_shape
        if self.use_cuda_graph:
            self._graph_q_len = setup.spec.max_q_len

    @property
    def work(self) -> WorkPlan | None:
        """The current plan's work items (None before the first plan). With the native host planner
        its arrays are views of the staging buffer: valid until the next plan()."""
        if self._tables is None:
            return None
        return self._tables.work_plan(self._buffers.host, self._buffers.starts)

    def _kernel_q_len(self, largest_q: int) -> int:
        """The kernel's query tokens per request: the batch's largest, or in CUDA-graph mode the
        fixed max_q_len, which also serves batches with fewer (one kernel for every replay)."""
        fixed = self._graph_q_len if self.use_cuda_graph else None
        if fixed is None:
            return largest_q
        if largest_q > fixed:
            validation.fail("plan() with use_cuda_graph=True", f"at most max_q_len={fixed} query tokens per request "
                        "(set max_q_len when constructing BatchDecode)", largest_q)
        return fixed

    def _split_work(self, setup: "_Setup", tables, chunk_tokens,
                    disable_split_kv: bool) -> "tuple[WorkPlan, _Capacity]":
        """The work items over the span the mask reads, within the CUDA-graph capacity if any."""
        span_begin = span_end = None  # None: every span starts at 0 and ends at the request's kv_len
        kernel = setup.kernel
        if kernel.mask.kv_span is not None:
            span_begin, span_end = kernel.mask.kv_span(tables.kv_lens, tables.q_lens, setup.params)
            span_end = np.minimum(span_end, np.iinfo(np.int32).max)
        if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
            validation.fail("chunk_tokens", "a positive int", chunk_tokens)
        if disable_split_kv:
            span_lens = (tables.kv_lens if span_end is None else span_end if span_begin is None
                         else span_end - span_begin)
            chunk_tokens = max(1, largest(span_lens, 1))
        tiling, batch, loaded = kernel.tiling, tables.batch, setup.loaded
        ctas_per_item, max_ctas = setup.num_kv_heads * tiling.row_tiles, loaded.num_sms * loaded.ctas_per_sm
        capacity = self._graph_capacity(setup.spec, batch, tables.num_tokens, max(batch, max_ctas // ctas_per_item))
        work = tables.plan(span_begin, span_end, ctas_per_item=ctas_per_item, max_ctas=max_ctas,
                           granularity=tiling.tile_tokens, chunk_tokens=chunk_tokens,
                           max_items=capacity.work if capacity else None)
        if capacity is None:
            capacity = _Capacity(batch, work.num_tokens, work.num_work)
        elif work.num_work > capacity.work:
            validation.fail("chunk_tokens", f"at most {capacity.work} work items (CUDA-graph capacity)",
                        f"{work.num_work} items of {work.chunk_tokens} tokens")
        return work, capacity

    def _graph_capacity(self, spec, batch: int, tokens: int, one_wave_items: int) -> "_Capacity | None":
        """CUDA-graph mode: the buffer sizes fixed at the first plan (None otherwise)."""
        if not self.use_cuda_graph:
            return None
        if self._buffers is not None:
            cap = self._buffers.capacity
        else:
            max_tokens = self._max_tokens or self._max_batch_size * spec.max_q_len
            cap = _Capacity(self._max_batch_size, max_tokens, max(self._max_batch_size, one_wave_items))
        if batch > cap.batch or tokens > cap.tokens:
            validation.fail("plan() with use_cuda_graph=True", f"at most {cap.batch} requests and {cap.tokens} query tokens",
                        f"{batch} requests, {tokens} tokens")
        return cap

    def _ensure_buffers(self, capacity: "_Capacity", setup: "_Setup") -> "_PlanBuffers":
        spec, num_qo_heads = setup.spec, setup.num_qo_heads
        partial_rows = capacity.work * spec.max_q_len * num_qo_heads
        merge_groups = capacity.batch * setup.num_kv_heads * setup.kernel.tiling.row_tiles
        current = self._buffers
        if current is None or not current.fits(capacity, partial_rows * setup.head_dim, merge_groups):
            if current is not None and self.use_cuda_graph:
                validation.fail("plan() with use_cuda_graph=True", "the buffers of the first plan", "a larger plan")
            current = self._buffers = _PlanBuffers(capacity, partial_rows, setup.head_dim, merge_groups, self.device)
        return current

    def _mask_params(self, mask, window_left, mask_params) -> dict:
        if not mask.params and not mask_params and window_left is None:
            return {}  # the common case, a mask without parameters given none, in one test
        params = dict(mask_params or {})
        if window_left is not None:
            params["window_left"] = window_left
        missing = [p for p in mask.param_names if p not in params]
        unknown = [p for p in params if p not in mask.param_names]
        if missing or unknown:
            validation.fail(f"mask_params for mask {mask.name!r}", f"exactly {list(mask.param_names)}",
                        f"missing {missing}, unknown {unknown}")
        for p in mask.params:
            value = params[p.name]
            if p.kind == "int" and (not isinstance(value, (int, np.integer)) or value < 0):
                validation.fail(f"mask param {p.name}", "a non-negative int", value)
            if p.kind == "int_tensor":
                import torch

                validation.tensor(f"mask param {p.name}", value, dtype=torch.int32, device=self.device, ndim=1)
                if value.numel() > 1 and value.stride(0) != 1:
                    validation.fail(f"mask param {p.name}", "a contiguous tensor (stride 1)", f"stride {value.stride(0)}")
        return params

    def _build_args(self, setup: "_Setup", work: WorkPlan, indices, fresh: bool):
        """Launch arguments: plan pointers and scalars now, tensor pointers patched by run().
        fresh: the arguments (or their buffers) are another setup's, so its scalars go in too."""
        buffers, kernel = self._buffers, setup.kernel
        a, m = buffers.decode_args, buffers.merge_args  # the work-list pointers are in already
        if self._graph_indices is not None:  # fixed address for graph replays (capacity checked by plan())
            used = int(self._num_page_ids)
            self._graph_indices[:used].copy_(indices[:used], non_blocking=True)
            indices = self._graph_indices
        a.page_indices = indices.data_ptr()
        self._indices = indices  # keep alive while planned
        if fresh:
            a.num_qo_heads = m.num_qo_heads = setup.num_qo_heads
            a.sm_scale_log2 = setup.sm_scale_log2
            scale_rules = (a, setup.spec.kv_is_fp8, setup.num_kv_heads)  # what run() validated the scales against
            if scale_rules != self._scale_rules:
                self._scales_key, self._scale_rules = None, scale_rules  # run() checks and sets the scales again
            self._decode_args, self._merge_args = a, m
            values, self._mask_tensors = [], []
            for param in kernel.mask.params:
                value = setup.params[param.name]
                if param.kind == "int_tensor":  # validated by _mask_params
                    self._mask_tensors.append(value)  # keep alive while planned
                    value = value.data_ptr()
                values.append(value)
            self._decode_params = buffers.decode_params(kernel.mask.params, values)
            self._args_for = (setup, buffers)
        graph, cap, tiling, loaded = self.use_cuda_graph, buffers.capacity, kernel.tiling, setup.loaded
        decode_grid = tiling.grid(cap.work if graph else work.num_work, setup.num_kv_heads)
        self._decode_launch = PreparedLaunch.update(self._decode_launch, loaded.decode, decode_grid, tiling.block,
                                                    self._decode_params, tiling.smem_bytes)
        if tiling.fused_merge:  # the decode kernel merges split requests itself
            self._merge_launch = None
            return
        # Graphs always launch the merge (its blocks exit early when nothing was split); a plan
        # without a split keeps the prepared merge for the next plan that has one.
        self._merge_prepared = PreparedLaunch.update(
            self._merge_prepared, loaded.merge, (cap.tokens if graph else work.num_tokens, setup.num_qo_heads, 1),
            tiling.merge_block, buffers.merge_params)
        self._merge_launch = self._merge_prepared if graph or work.needs_merge else None

    # ---- run --------------------------------------------------------------------------------

    def run(self, q, kv_cache, *, out=None, lse=None, return_lse: bool = False, k_scale=None, v_scale=None):
        """Attention of q over the planned cache; returns out (and lse, natural log, if asked).

        q and out are [tokens, qo_heads, head_dim]. Allocates only out/lse when they are not given;
        never synchronizes (except once to check the values of a scale tensor it has not seen).

        k_scale, v_scale: the cache holds K / k_scale and V / v_scale (required for fp8 caches,
        default 1 otherwise). Each a positive float, or a float32 tensor of 1 or num_kv_heads values
        on the cache's device, read at launch: a captured run() sees the values at replay time.

        With use_cuda_graph=True, q/out may have up to max_tokens rows (rows past the plan's tokens
        are left alone), and a captured run() replays correctly after a new plan(); the graph keeps
        the tensors it was captured with, so refill those between replays.
        """
        if not self._planned:
            raise RuntimeError("BatchDecode.run() called before plan()")
        a = self._decode_args
        self._set_cache(kv_cache, a)
        if k_scale is not None or v_scale is not None or self._scales_key != (None, None):
            self._set_scales(a, k_scale, v_scale)
        a.q, a.q_stride = self._query_args("q", q)
        if out is None:
            out = q.new_empty((q.shape[0],) + self._q_shape[1:])
        a.out, a.out_stride = out_pointer, out_stride = self._query_args("out", out)
        if return_lse and lse is None:
            lse = q.new_empty(out.shape[:2], dtype=self._lse_dtype)
        a.lse = lse_pointer = 0 if lse is None else self._lse_pointer(lse, out)

        stream = _current_stream(self.device.index)
        self._decode_launch(stream)
        if self._merge_launch is not None:
            m = self._merge_args
            m.out, m.out_stride, m.lse = out_pointer, out_stride, lse_pointer
            self._merge_launch(stream)
        return (out, lse) if return_lse else out

    def _set_scales(self, a, k_scale, v_scale):
        """Point the arguments at the scales; unchanged scales (the common case) cost one comparison."""
        key = (_scale_key(k_scale), _scale_key(v_scale))
        if key == self._scales_key:
            return
        import torch

        required, heads = self.spec.kv_is_fp8, self.num_kv_heads
        self._scales_key = None  # a v_scale refused after k_scale was set leaves no stale match
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            host, pointer, stride = validation.kv_scale(name, value, num_kv_heads=heads, device=self.device,
                                                    required=required)
            if pointer and not torch.cuda.is_current_stream_capturing():  # a capture cannot synchronize
                validation.tensor_scale_values(name, value)
            setattr(a, name, host)
            setattr(a, name + "_ptr", pointer)
            setattr(a, name + "_stride", stride)
        self._scales_key = key

    def _query_args(self, name: str, t) -> tuple[int, int]:
        """(data_ptr, row stride) of q or out. The common valid case costs one read of each attribute
        (torch's stride(i) costs twice stride()); anything else gets the full validation."""
        try:
            pointer, (rows, heads, dim), (row_stride, head_stride, unit) = t.data_ptr(), t.shape, t.stride()
            low, high = self._q_rows
            if (t.dtype is self._q_dtype and t.get_device() == self.device.index and heads == self.num_qo_heads
                    and dim == self.head_dim and low <= rows <= high and head_stride == dim and unit == 1
                    and row_stride % 8 == 0 and pointer % 16 == 0):  # 16-byte rows of 2-byte values
                return pointer, row_stride
        except (AttributeError, TypeError, ValueError):  # not a 3-d tensor: the checks say what it is
            pass
        self._check_query(name, t)
        return t.data_ptr(), t.stride(0)

    def _lse_pointer(self, lse, out) -> int:
        """data_ptr of lse, a contiguous float32 [out's rows, qo_heads]; the common valid case in a few reads."""
        try:
            if (lse.dtype is self._lse_dtype and lse.get_device() == self.device.index and lse.shape == out.shape[:2]
                    and lse.is_contiguous()):
                return lse.data_ptr()
        except AttributeError:  # not a tensor: the checks say what it is
            pass
        validation.tensor("lse", lse, dtype=self._lse_dtype, device=self.device, shape=tuple(out.shape[:2]))
        if not lse.is_contiguous():
            validation.fail("lse", "a contiguous tensor", f"strides {lse.stride()}")
        return lse.data_ptr()

    def _check_query(self, name: str, t):
        low, high = self._q_rows
        rows = t.shape[0] if getattr(t, "dim", lambda: 0)() == 3 and low <= t.shape[0] <= high else low
        validation.tensor(name, t, dtype=self._q_dtype, device=self.device, shape=(rows,) + self._q_shape[1:])
        validation.rows_16b_aligned(name, t, self.head_dim)
        if t.stride(1) != self.head_dim:
            validation.fail(name, f"heads packed densely (stride(1) == head_dim == {self.head_dim})", f"strides {t.stride()}")

    def _set_cache(self, kv_cache, a):
        """Point the arguments at K and V; a cache tensor is validated once, then recognised.

        The cache of the previous call, which the arguments still point at, costs an identity, a
        pointer and a shape test per tensor: a layer passes the same cache every step."""
        pair = isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2
        k, v = kv_cache if pair else (kv_cache, kv_cache)
        last = self._last_cache
        if (pair is last[0] and last[1]() is k and last[2]() is v and k.data_ptr() == last[3]
                and v.data_ptr() == last[4] and k.shape == last[5] and v.shape == last[6]):
            return
        self._last_cache = _NO_CACHE  # a cache refused half-way may have re-pointed K already
        self._point_at_cache(kv_cache, a)
        self._last_cache = (pair, weakref.ref(k), weakref.ref(v), k.data_ptr(), v.data_ptr(), k.shape, v.shape)

    def _point_at_cache(self, kv_cache, a):
        if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
            k, v = kv_cache
            a.k, k_strides = self._checked("k_cache", k, 4)
            a.v, v_strides = self._checked("v_cache", v, 4)
            if v_strides != k_strides:
                validation.fail("v_cache", f"the shape and strides of k_cache {tuple(k.shape)}/{k.stride()}",
                            f"{tuple(v.shape)}/{v.stride()}")
        elif isinstance(kv_cache, (tuple, list)):
            validation.fail("kv_cache", "a (k_cache, v_cache) pair or one [pages, 2, ...] tensor", f"{len(kv_cache)} tensors")
        else:
            a.k, k_strides = self._checked("kv_cache", kv_cache, 5)
            a.v = a.k + kv_cache.stride(1) * kv_cache.element_size()
        a.page_stride, a.slot_stride, a.head_stride = k_strides

    def _checked(self, name: str, t, ndim: int):
        """(data_ptr, (page, slot, head) element strides) of a validated cache tensor."""
        seen = self._kv_checked.get(id(t))
        if seen is not None and seen[0]() is t:
            pointer = t.data_ptr()
            if pointer == seen[1] and t.dtype is seen[2] and t.shape == seen[3]:  # not re-pointed by .set_()
                return pointer, seen[4]
        validation.tensor(name, t, dtype=self._kv_dtype, device=self.device, ndim=ndim)
        if ndim == 5 and t.shape[1] != 2:
            validation.fail(name, "shape [pages, 2, ...] (K then V)", f"shape {tuple(t.shape)}")
        page_view = t[:, 0] if ndim == 5 else t
        layout = "[pages, page_size, kv_heads, head_dim]" if self.spec.kv_layout == "NHD" else "[pages, kv_heads, page_size, head_dim]"
        if tuple(page_view.shape[1:]) != self._kv_shape:
            validation.fail(name, f"{self.spec.kv_layout} layout {layout} = [*, {', '.join(map(str, self._kv_shape))}]",
                        f"shape {tuple(t.shape)}")
        if page_view.shape[0] <= self._max_page:
            validation.fail(name, f"more than {self._max_page} pages (indices refer to page {self._max_page})",
                        f"{page_view.shape[0]} pages")
        validation.rows_16b_aligned(name, page_view, self.head_dim)
        slot_dim, head_dim = (1, 2) if self.spec.kv_layout == "NHD" else (2, 1)
        strides = (page_view.stride(0), page_view.stride(slot_dim), page_view.stride(head_dim))
        validation.strides_fit_int32(name, strides)
        if len(self._kv_checked) > 1024:
            self._kv_checked.clear()
        self._kv_checked[id(t)] = (weakref.ref(t), t.data_ptr(), t.dtype, t.shape, strides)
        return t.data_ptr(), strides


# _last_cache before any: (pair?, weak K, weak V, K and V pointers, K and V shapes); matches nothing.
_NO_CACHE = (None, lambda: None, lambda: None, 0, 0, None, None)


def _scale_key(value):
    """What identifies a scale argument: a tensor by its memory and version (in-place writes bump it)."""
    if hasattr(value, "data_ptr"):
        return (value.data_ptr(), value._version, value.dtype, value.device, value.shape)
    return value


_MAX_SETUPS = 64  # distinct plan() configurations remembered per BatchDecode (then forgotten at once)


class _Setup(typing.NamedTuple):
    """What plan()'s scalar arguments decide, worked out once per configuration (BatchDecode._make_setup)."""

    spec: DecodeSpec
    kernel: Kernel
    loaded: LoadedKernel
    params: dict           # the mask's parameters, validated
    sm_scale_log2: float
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: object        # torch dtypes of q/out and of the cache
    kv_dtype: object
    kv_shape: tuple        # a cache page's shape (NHD or HND)
    mask_generation: int   # masks.generation when made: a later registration may change the kernel


class _Capacity(typing.NamedTuple):  # a NamedTuple: built every plan(), in a third of a frozen dataclass's time
    batch: int
    tokens: int
    work: int


class _PlanBuffers:
    """The work list on the GPU (one int32 buffer at fixed offsets) and the fp32 split partials.

    plan() fills a pinned staging copy and sends it with one asynchronous copy; the next plan()
    waits for that copy before reusing the staging memory. Addresses never change, so CUDA-graph
    replays read the newest plan. (On a CPU device, for the tests, the copy is a plain one.)
    """

    # work_items: ITEM_INTS int32 per item (decode_common.cuh's WorkItem), first so its records are
    # 16-byte aligned; the rest are the merges' (req_*, token_request, num_tokens).
    FIELDS = ("work_items", "num_tokens", "req_qo_indptr", "req_work_indptr", "token_request")

    def __init__(self, capacity: _Capacity, partial_rows: int, head_dim: int, merge_groups: int, device):
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
        self.copies = _StreamCopies(device)
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
        self._mask_params, self._mask_values, self._decode_params = None, [], None

    def decode_params(self, mask_params: tuple, values: list) -> ctypes.Array:
        """The decode kernel's void*[]: the Args struct, then each mask parameter's value.

        Kept while the mask's parameters stay the same, the values written in place, so plan()
        keeps its prepared launch too."""
        if mask_params != self._mask_params:
            self._mask_values = [MASK_PARAM_CTYPES[p.kind]() for p in mask_params]
            self._decode_params = (ctypes.c_void_p * (1 + len(self._mask_values)))(
                ctypes.addressof(self.decode_args), *(ctypes.addressof(v) for v in self._mask_values))
            self._mask_params = mask_params
        for slot, value in zip(self._mask_values, values):
            slot.value = value
        return self._decode_params

    def fits(self, capacity: _Capacity, partial_elems: int, merge_groups: int) -> bool:
        c = self.capacity
        return (capacity.work <= c.work and capacity.batch <= c.batch and capacity.tokens <= c.tokens
                and partial_elems <= self.tmp_o.numel() and merge_groups <= self.merge_counters.numel())

    def write(self, tables, synced_stream=None):
        """A plan's work list (tables: host_plan's NumpyTables or NativeTables) to the GPU.
        synced_stream: a stream on which the host has just waited for a copy queued after this
        buffer's last copy (None: none)."""
        if synced_stream is None or synced_stream != self.copies.marked_stream:
            self.copies.wait()  # the previous plan's copy has read the staging memory
        tables.write(self.host, self.starts, self.staging.data_ptr())
        self.copies.copy(self.device_buffer.data_ptr(), self.staging.data_ptr(), 4 * len(self.host), _HOST_TO_DEVICE,
                         mark=True)


class _PageIdRange:
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
        self.copies = _StreamCopies(device)
        self.pending = 0

    def start(self, indices, count: int):
        if count > self.COPY_LIMIT or (count > 1 and indices.stride(0) != 1):
            import torch

            torch.aminmax(indices[:count], out=(self.reduced[0], self.reduced[1]))
            indices, count = self.reduced, 2
        if count:
            self.copies.copy(self.host.data_ptr(), indices.data_ptr(), 4 * count, _DEVICE_TO_HOST, mark=True)
        self.pending = count

    def wait(self) -> int:
        """How many values (the page ids, or their [min, max]) have landed at the start of host."""
        if self.pending:
            self.copies.wait()
        return self.pending


def decode(q, kv_cache, indptr, indices, last_page_len, *, page_size: int | None = None, engine: Engine | None = None,
           return_lse: bool = False, kv_layout: str = "NHD", k_scale=None, v_scale=None, **plan_options):
    """One-shot convenience for scripts: plan and run in one call (serving code should reuse a BatchDecode)."""
    k = kv_cache[0] if isinstance(kv_cache, (tuple, list)) else kv_cache[:, 0]
    if page_size is None:
        page_size = k.shape[1] if kv_layout.upper() == "NHD" else k.shape[2]
    num_kv_heads = k.shape[2] if kv_layout.upper() == "NHD" else k.shape[1]
    decoder = BatchDecode(engine, device=q.device)
    decoder.plan(indptr, indices, last_page_len, q.shape[1], num_kv_heads, q.shape[2], page_size,
                 q_dtype=normalize_dtype(q.dtype), kv_dtype=normalize_dtype(k.dtype, "kv_dtype", KV_DTYPES),
                 kv_layout=kv_layout, **plan_options)
    return decoder.run(q, kv_cache, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
