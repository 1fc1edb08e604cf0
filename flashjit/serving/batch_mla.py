"""BatchDecodeMLA: multi-head latent attention decode (DeepSeek-V3/R1, Kimi-K2). plan() once per batch
composition, run() once per layer.

The cache is FlashInfer's paged layout with one latent head: CSR `indptr` [B+1] into `indices`
(page ids), `last_page_len` [B], and per token a c_kv row (512) and a k_pe row (64), as
ckv [pages, page_size, 512] and kpe [pages, page_size, 64], or one [pages, page_size, 576] cache.
Queries are q_nope [tokens, heads, 512] (already absorbed into the latent space) and
q_pe [tokens, heads, 64]; the output is [tokens, heads, 512]. Several query tokens per request
(multi-token prediction, speculative decoding) attend causally.

The lifecycle is BatchDecode's (serving/decoder.py): the same host planner (page-table checks,
split-KV chunk search, work records), work-list buffers, CUDA-graph limits and fused split merge;
only the kernel family (MLASpec) and its arguments (kernels/mla/args.MLAArgs) differ.
"""

from __future__ import annotations

import ctypes
import typing
import weakref

from .. import validation
from ..jit.engine import Engine
from ..jit.launch import PreparedLaunch
from ..kernels.mla.args import MLAArgs
from ..kernels.mla.spec import MLASpec
from ..kernels.worklist_kernel import Kernel, LoadedKernel
from ..small_arrays import largest
from ..worklist.host import HostPlanner
from ..worklist.tables import Tables
from .buffers import Capacity, PageIdRange, PlanBuffers
from .decoder import Decoder
from .plan_setup import LOG2E
from .run_checks import MAX_VALIDATED_CACHES, scale_key

LATENT_DIM, ROPE_DIM = 512, 64


class MLASetup(typing.NamedTuple):
    """What plan()'s scalars decide: the spec, its kernel (built or found, and loaded), the scale."""

    spec: MLASpec
    kernel: Kernel
    loaded: LoadedKernel
    sm_scale_log2: float
    num_heads: int
    page_size: int
    q_dtype: object  # torch dtypes of the queries/output and of the cache
    kv_dtype: object


class MLAPlan(typing.NamedTuple):
    """What one plan() produced; replaced whole by the next."""

    setup: MLASetup
    tables: Tables
    buffers: PlanBuffers
    page_ids: object
    max_page: int
    batch_size: int
    num_tokens: int
    max_rows: int  # q/out rows run() accepts: the tokens, or the CUDA-graph capacity
    args: MLAArgs
    launch: PreparedLaunch

    @property
    def spec(self) -> MLASpec:
        return self.setup.spec

    @property
    def work(self):
        return self.tables.work_plan(self.buffers.host, self.buffers.starts)


class BatchDecodeMLA(Decoder):
    """MLA decode attention for a batch of requests.

    >>> decoder = BatchDecodeMLA(device="cuda")
    >>> decoder.plan(indptr, indices, last_page_len, num_heads=16, page_size=64, sm_scale=192 ** -0.5)
    >>> out = decoder.run(q_nope, q_pe, ckv_cache, kpe_cache)
    """

    def __init__(self, engine: Engine | None = None, device="cuda", *, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_num_pages: int | None = None, max_tokens: int | None = None,
                 max_q_len: int | None = None, page_ids_buffer=None, arch: str | None = None, load_kernel=None,
                 current_stream=None, host_planner: HostPlanner | None = None,
                 page_id_range: PageIdRange | None = None):
        """The keywords are BatchDecode's (use_cuda_graph with max_batch_size and max_num_pages fixes
        the buffers and the kernel at the first plan, so a captured run() replays correctly after later
        plans; arch, load_kernel, current_stream, host_planner and page_id_range let tests plan without
        a GPU)."""
        super().__init__(engine, device, use_cuda_graph=use_cuda_graph, max_batch_size=max_batch_size,
                         max_num_pages=max_num_pages, max_tokens=max_tokens, max_q_len=max_q_len,
                         page_ids_buffer=page_ids_buffer, arch=arch, load_kernel=load_kernel,
                         current_stream=current_stream, host_planner=host_planner, page_id_range=page_id_range)
        self._plan: MLAPlan | None = None
        self._setups: dict = {}

    # ---- plan -------------------------------------------------------------------------------

    def plan(self, indptr, indices, last_page_len, num_heads: int, page_size: int, *, sm_scale: float,
             qo_indptr=None, q_len: int | None = None, q_dtype="bfloat16", kv_dtype=None,
             chunk_tokens: int | None = None, disable_split_kv: bool = False,
             check_page_ids: bool = True) -> "BatchDecodeMLA":
        """Plans a batch for every layer's run().

        num_heads: query heads (per GPU) of the one latent head; sm_scale: the softmax scale (for
        DeepSeek-V3, qk_head_dim ** -0.5 times the YaRN mscale squared); qo_indptr or q_len: query
        tokens per request (1-4, causal); kv_dtype: the cache's dtype (default q_dtype; fp8 "e4m3"
        or "e5m2" with scales given to run()). chunk_tokens forces the split-KV chunk;
        disable_split_kv reads each request in one work item. check_page_ids as BatchDecode's.
        """
        for name, value in (("num_heads", num_heads), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                validation.fail(name, "a positive int", value)
        scale = validation.positive_float32("sm_scale", sm_scale, LOG2E)
        if not isinstance(check_page_ids, bool):
            validation.fail("check_page_ids", "True or False", check_page_ids)
        graph, previous = self._graph, self._plan
        tables, page_range = self._read_batch(indptr, indices, last_page_len, page_size, qo_indptr, q_len,
                                              check_page_ids)
        num_page_ids = tables.num_page_ids
        try:
            kernel_q_len = tables.max_q_len if graph is None else graph.kernel_q_len(tables.max_q_len, previous)
            setup = self._setup(num_heads, page_size, scale, q_dtype, kv_dtype, kernel_q_len)
            if graph is not None:
                graph.check_kernel(setup, previous)
            work, capacity = self._split(setup, tables, chunk_tokens, disable_split_kv, previous)
        finally:
            landed, max_page = self._page_ids_landed(page_range)
        buffers = self._buffers_for(capacity, setup, previous)

        # Every argument is valid: from here on the new plan replaces the previous one.
        self._validated_caches.clear()
        self._scales_pointed_at = None  # a new plan may have new arguments or another cache dtype
        buffers.write(tables, synced_stream=page_range.copies.marked_stream if landed else None)
        tiling = setup.kernel.tiling
        args = self._args_for(buffers, previous)
        page_ids = indices if graph is None else graph.hold_page_ids(indices, int(num_page_ids))
        args.page_indices = page_ids.data_ptr()
        args.num_heads, args.sm_scale_log2 = num_heads, setup.sm_scale_log2
        grid = tiling.grid(capacity.work if graph is not None else work.num_work)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(args)) if previous is None or previous.args is not args \
            else previous.launch.params
        launch = PreparedLaunch.update(None if previous is None else previous.launch, setup.loaded.decode, grid,
                                       tiling.block, params, tiling.smem_bytes,
                                       setup.kernel.programmatic_launch)
        rows = work.num_tokens if graph is None else capacity.tokens
        self._plan = MLAPlan(setup, tables, buffers, page_ids, max_page, tables.batch, work.num_tokens, rows, args,
                             launch)
        return self

    def _setup(self, num_heads, page_size, scale, q_dtype, kv_dtype, kernel_q_len) -> MLASetup:
        key = (num_heads, page_size, scale, str(q_dtype), str(kv_dtype), kernel_q_len)
        found = self._setups.get(key)
        if found is not None:
            return found
        spec = MLASpec(num_heads=num_heads, dtype=str(q_dtype).removeprefix("torch."),
                       kv_dtype=None if kv_dtype is None else str(kv_dtype).removeprefix("torch."),
                       page_size=page_size, max_q_len=kernel_q_len, arch=self._arch)
        kernel = self.engine.get_kernel(spec)
        loaded = self._load_kernel(kernel, self.device.index)
        import torch

        setup = MLASetup(spec, kernel, loaded, scale * LOG2E, num_heads, page_size, getattr(torch, spec.dtype),
                         getattr(torch, spec.kv_dtype))
        if len(self._setups) >= 64:
            self._setups.clear()
        self._setups[key] = setup
        return setup

    def _split(self, setup: MLASetup, tables, chunk_tokens, disable_split_kv: bool, previous):
        if chunk_tokens is not None and (type(chunk_tokens) is not int or not 1 <= chunk_tokens <= validation.INT32_MAX):
            validation.fail("chunk_tokens", f"a positive int up to {validation.INT32_MAX}", repr(chunk_tokens))
        planned = chunk_tokens is None or disable_split_kv  # at most a wave of items a request
        if disable_split_kv:
            chunk_tokens = max(1, largest(tables.kv_lens, 1))
        tiling, loaded, graph = setup.kernel.tiling, setup.loaded, self._graph
        ctas_per_item, max_ctas = tiling.row_tiles, loaded.num_sms * loaded.ctas_per_sm
        capacity = None if graph is None else graph.capacity(setup.spec, tables.batch, tables.num_tokens,
                                                             max(tables.batch, max_ctas // ctas_per_item), previous,
                                                             planned_chunk=planned)
        work = tables.plan(None, None, ctas_per_item=ctas_per_item, max_ctas=max_ctas, granularity=tiling.tile_tokens,
                           chunk_tokens=chunk_tokens, max_items=capacity.work if capacity else None)
        if capacity is None:
            capacity = Capacity(tables.batch, work.num_tokens, work.num_work)
        elif work.num_work > capacity.work:
            validation.fail("chunk_tokens", f"at most {capacity.work} work items (CUDA-graph capacity)",
                            f"{work.num_work} items of {work.chunk_tokens} tokens")
        return work, capacity

    def _buffers_for(self, capacity: Capacity, setup: MLASetup, previous) -> PlanBuffers:
        partial_rows = capacity.work * setup.spec.max_q_len * setup.num_heads
        merge_groups = capacity.batch * setup.kernel.tiling.row_tiles
        return self._buffers_with(capacity, partial_rows, LATENT_DIM, merge_groups, previous)

    def _args_for(self, buffers: PlanBuffers, previous) -> MLAArgs:
        """The launch arguments over these buffers: the previous plan's where the buffers are the same
        (a captured graph holds their address), else new ones."""
        if previous is not None and previous.buffers is buffers:
            return previous.args
        a = MLAArgs()
        p = buffers.pointers
        a.work_items, a.req_work_indptr = p["work_items"], p["req_work_indptr"]
        a.tmp_o, a.tmp_lse = buffers.tmp_o.data_ptr(), buffers.tmp_lse.data_ptr()
        a.merge_counters, a.tile_counters = buffers.merge_counters.data_ptr(), buffers.tile_counters.data_ptr()
        a.ckv_scale = a.kpe_scale = 1.0
        return a

    # ---- what the current plan decided ------------------------------------------------------

    @property
    def spec(self) -> MLASpec:
        return self._current().setup.spec

    @property
    def kernel(self) -> Kernel:
        return self._current().setup.kernel

    def _current(self) -> MLAPlan:
        if self._plan is None:
            raise RuntimeError("BatchDecodeMLA has no plan yet: call plan() first")
        return self._plan

    # ---- run --------------------------------------------------------------------------------

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache=None, *, out=None, lse=None, return_lse: bool = False,
            ckv_scale=None, kpe_scale=None):
        """MLA attention of the queries over the planned cache; returns out (and lse, natural log).

        q_nope [tokens, heads, 512], q_pe [tokens, heads, 64]; ckv_cache [pages, page_size, 512] and
        kpe_cache [pages, page_size, 64], or kpe_cache None and one [pages, page_size, 576] cache;
        out [tokens, heads, 512] (heads packed). fp8 caches need ckv_scale (the cache holds
        c_kv / ckv_scale), and kpe_scale where k_pe has its own (default ckv_scale): each a positive
        float or a float32 tensor of one value on the device, read at launch (so CUDA-graph
        replays see its current value). In CUDA-graph mode q/out may have up to the capacity's rows.
        Allocates only out/lse when they are not given; never synchronizes (except once to check the
        values of a scale tensor it has not seen). Under torch.compile, run() is the operator
        torch.ops.flashjit.mla_decode (serving/torch_ops.py), which runs the plan current when it runs.
        """
        if self._compiling():  # (the operator's kernel is this method, called outside any tracing)
            from .torch_ops import mla_decode as traced_mla_decode

            return traced_mla_decode(self._op_handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse,
                                     ckv_scale, kpe_scale)
        plan = self._current()
        a = plan.args
        a.q_nope, a.q_nope_stride, a.q_nope_head_stride = self._rows("q_nope", q_nope, LATENT_DIM, plan)
        a.q_pe, a.q_pe_stride, a.q_pe_head_stride = self._rows("q_pe", q_pe, ROPE_DIM, plan)
        if q_pe.shape[0] != q_nope.shape[0]:
            validation.fail("q_pe", f"{q_nope.shape[0]} rows, as q_nope", q_pe.shape[0])
        self._point_at_cache(a, plan, ckv_cache, kpe_cache)
        scales = (scale_key(ckv_scale), scale_key(kpe_scale))
        if scales != self._scales_pointed_at:
            self._scales_pointed_at = None  # a kpe_scale refused after ckv_scale was set leaves no stale match
            self._point_at_scales(a, plan.setup, ckv_scale, kpe_scale)
            self._scales_pointed_at = scales
        if out is None:
            out = q_nope.new_empty((q_nope.shape[0], plan.setup.num_heads, LATENT_DIM))
        a.out, a.out_stride, head_stride = self._rows("out", out, LATENT_DIM, plan)
        if head_stride != LATENT_DIM or out.shape[0] != q_nope.shape[0]:
            validation.tensor("out", out, shape=(q_nope.shape[0], plan.setup.num_heads, LATENT_DIM))
            validation.fail("out", f"heads packed densely (stride(1) == {LATENT_DIM})", f"strides {out.stride()}")
        if return_lse and lse is None:
            lse = out.new_empty(out.shape[:2], dtype=self._lse_dtype)
        a.lse = 0 if lse is None else self._lse_pointer(lse, out)
        if plan.max_rows:  # a plan without query tokens launches nothing (outside CUDA-graph mode)
            plan.launch(self._current_stream(self._device_index))
        return (out, lse) if return_lse else out

    def query_form(self):
        """(dtype, heads, 512, dtype): q_nope's form and out's dtype under the current plan; None before one."""
        setup = None if self._plan is None else self._plan.setup
        return None if setup is None else (setup.q_dtype, setup.num_heads, LATENT_DIM, setup.q_dtype)

    def _rows(self, name: str, t, width: int, plan: MLAPlan) -> tuple[int, int, int]:
        """(data_ptr, token stride, head stride) of q_nope, q_pe or out: [rows, heads, width] of the
        plan's dtype, rows 16-byte aligned. The common valid case costs one read of each attribute."""
        setup = plan.setup
        try:
            pointer, (rows, heads, dim), (row_stride, head_stride, unit) = t.data_ptr(), t.shape, t.stride()
            if (t.dtype is setup.q_dtype and t.get_device() == self._device_index and heads == setup.num_heads
                    and dim == width and plan.num_tokens <= rows <= plan.max_rows and unit == 1
                    and row_stride % 8 == 0 and head_stride % 8 == 0 and pointer % 16 == 0):
                return pointer, row_stride, head_stride
        except (AttributeError, TypeError, ValueError):  # not a 3-d tensor: the checks say what it is
            pass
        import torch

        low, high = plan.num_tokens, plan.max_rows
        rows = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() == 3 and low <= t.shape[0] <= high else low
        validation.tensor(name, t, dtype=setup.q_dtype, device=self.device, shape=(rows, setup.num_heads, width))
        validation.rows_16b_aligned(name, t, width)
        return t.data_ptr(), t.stride(0), t.stride(1)

    def _point_at_cache(self, a, plan: MLAPlan, ckv_cache, kpe_cache):
        """Point the arguments at the latent cache; tensors validated against this plan are recognised."""
        one = kpe_cache is None
        a.ckv, a.ckv_page_stride, a.ckv_slot_stride = self._cache("kv_cache" if one else "ckv_cache", ckv_cache,
                                                                  LATENT_DIM + ROPE_DIM if one else LATENT_DIM, plan)
        if one:
            a.kpe = a.ckv + LATENT_DIM * ckv_cache.element_size()
            a.kpe_page_stride, a.kpe_slot_stride = a.ckv_page_stride, a.ckv_slot_stride
        else:
            a.kpe, a.kpe_page_stride, a.kpe_slot_stride = self._cache("kpe_cache", kpe_cache, ROPE_DIM, plan)

    def _cache(self, name: str, t, width: int, plan: MLAPlan) -> tuple[int, int, int]:
        """(data_ptr, page stride, slot stride) of a validated latent cache tensor."""
        seen = self._validated_caches.get((id(t), width))
        if seen is not None and seen[0]() is t:
            pointer = t.data_ptr()
            if pointer == seen[1] and t.dtype is seen[2] and t.shape == seen[3]:  # not re-pointed by .set_()
                return pointer, *seen[4]
        setup = plan.setup
        validation.tensor(name, t, dtype=setup.kv_dtype, device=self.device, ndim=3)
        if tuple(t.shape[1:]) != (setup.page_size, width):
            validation.fail(name, f"shape [pages, {setup.page_size}, {width}]", f"shape {tuple(t.shape)}")
        if t.shape[0] <= plan.max_page:
            validation.fail(name, f"more than {plan.max_page} pages (indices refer to page {plan.max_page})",
                            f"{t.shape[0]} pages")
        validation.rows_16b_aligned(name, t, width)
        strides = (t.stride(0), t.stride(1))
        validation.strides_fit_int32(name, strides)
        if len(self._validated_caches) > MAX_VALIDATED_CACHES:
            self._validated_caches.clear()
        self._validated_caches[(id(t), width)] = (weakref.ref(t), t.data_ptr(), t.dtype, t.shape, strides)
        return t.data_ptr(), *strides

    def _point_at_scales(self, a, setup: MLASetup, ckv_scale, kpe_scale):
        import torch

        fp8 = setup.spec.kv_is_fp8
        if kpe_scale is None:
            kpe_scale = ckv_scale
        for name, value in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale)):
            if not fp8 and value is not None:
                validation.fail(name, f"None for a {setup.spec.kv_dtype} cache (scales are for fp8 caches)", value)
            host, pointer, _ = validation.kv_scale(name, value, num_kv_heads=1, device=self.device, required=fp8)
            if pointer and not torch.cuda.is_current_stream_capturing():
                validation.tensor_scale_values(name, value)
            setattr(a, name, host)
            setattr(a, name + "_ptr", pointer)

