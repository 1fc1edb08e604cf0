"""BatchDecode: the serving API. plan() once per batch composition, run() once per layer.

Conventions follow FlashInfer's paged KV cache: CSR `indptr` [B+1] into `indices` (physical
page ids), `last_page_len` [B] (tokens in each request's last page), a cache of
[pages, page_size, kv_heads, head_dim] (NHD) or [pages, kv_heads, page_size, head_dim] (HND),
as separate K and V tensors or one [pages, 2, ...] tensor. Queries are [tokens, qo_heads, head_dim].

plan() validates its scalars into PlanScalars (plan_setup), reads the batch (serving/decoder.py),
makes the work list the way the decoder's mode and the batch call for (serving/planning.py: eager,
eager shared prefix, CUDA graph planned on the GPU or on the host), copies it to the GPU once and
builds the launch arguments, all gathered in one Plan (plan_state) that replaces the previous one
whole. run() checks the tensors, patches the pointers and launches: no allocation when `out` (and
`lse`) are given, no host synchronization.
"""

from __future__ import annotations

import operator
import weakref

from .. import validation
from ..jit.dtypes import KV_DTYPES, QUERY_DTYPES, normalize_dtype
from ..jit.engine import Engine
from ..kernels.decode.spec import FP8_QUERY_DTYPE
from ..masks.params import TENSOR_KINDS
from ..masks.registry import masks
from ..worklist.host import HostPlanner
from ..worklist.record import PLAN_MAX_BATCH
from . import run_checks, variant_args
from .buffers import PageIdRange, PlanBuffers
from .decoder import Decoder
from .device_planner import DeviceTables
from .plan_setup import MAX_SETUPS, PlanScalars, Setup, make_setup
from .plan_state import Plan, prepare_launches, split_rule
from .planning import Batch, choose_planning, reads_page_ids
from .run_checks import NO_CACHE, scale_key


def _of_plan(path: str, doc: str) -> property:
    """A read-only attribute of the current plan (path: dotted, in Plan); AttributeError before the first."""
    read = operator.attrgetter(path)

    def get(self):
        if self._plan is None:
            raise AttributeError(f"BatchDecode has no plan yet: {path.rpartition('.')[2]} is set by plan()")
        return read(self._plan)

    return property(get, doc=doc)


class BatchDecode(Decoder):
    """Paged-KV decode attention for a batch of requests.

    >>> decoder = BatchDecode(device="cuda")
    >>> decoder.plan(indptr, indices, last_page_len, 32, 8, 128, 16, mask="causal")
    >>> out = decoder.run(q, (k_cache, v_cache))
    """

    def __init__(self, engine: Engine | None = None, device="cuda", *, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_num_pages: int | None = None, max_tokens: int | None = None,
                 max_q_len: int | None = None, page_ids_buffer=None, arch: str | None = None, load_kernel=None, current_stream=None,
                 host_planner: HostPlanner | None = None, page_id_range: PageIdRange | None = None):
        """use_cuda_graph: run() launches fixed-size grids over fixed buffers, so a captured run()
        replays correctly after a new plan() with other lengths and page tables. Needs
        max_batch_size (requests) and max_num_pages (page ids in one plan's indices; plan() copies
        them into a buffer of that size), optionally max_q_len (query tokens per request any plan
        may have, default the first plan's largest) and max_tokens (query tokens in all, default
        max_batch_size x max_q_len). page_ids_buffer: an int32 device tensor the caller owns and
        writes the page ids into; the kernels read it in place (plan() gets it, or a tensor
        sharing its storage from the start, as indices), and max_num_pages defaults to its length.
        graph_page_ids is the buffer in use, either way. Every plan() then uses one kernel, built for max_q_len, so
        the heads, head_dim, dtypes, mask and page size must stay the same, while the query tokens
        per request may vary up to max_q_len (speculative decoding). The head counts, sm_scale, the
        mask's and the variant's parameters (window_left, a tensor's address) are part of the
        captured launch too: plan() refuses a change of them (write new values into the same tensors).

        The other keywords replace what the decoder asks of its device, so tests can plan without
        a GPU: arch ("sm_90"; default the device's; given, the device may be the CPU, where copies
        are plain copies), load_kernel(kernel, device index) -> LoadedKernel (default
        Kernel.loaded; its occupancy and SM count size the split), current_stream(device index) ->
        the stream handle run() launches on (default torch's current stream), host_planner
        (default over the C helper built in the engine's cache) and page_id_range (the reader of
        the page ids' range)."""
        super().__init__(engine, device, use_cuda_graph=use_cuda_graph, max_batch_size=max_batch_size,
                         max_num_pages=max_num_pages, max_tokens=max_tokens, max_q_len=max_q_len,
                         page_ids_buffer=page_ids_buffer, arch=arch, load_kernel=load_kernel,
                         current_stream=current_stream, host_planner=host_planner, page_id_range=page_id_range)
        self._plan: Plan | None = None
        # Memos, each named for what it saves, and why it pays:
        # (scalars, their types) -> {kernel query tokens: Setup}: a serving loop plans one configuration a step.
        self._setup_for_scalars: dict = {}
        # The cache the arguments point at (NO_CACHE: none): a layer passes the same cache every step.
        self._cache_pointed_at = NO_CACHE
        # (decode args, fp8 cache, KV heads) those scales were checked for: a plan changing none keeps them.
        self._scales_checked_for = None

    # ---- plan -------------------------------------------------------------------------------

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, qo_indptr=None, q_len: int | None = None, mask: str = "none",
             window_left: int | None = None, mask_params: dict | None = None, q_dtype="bfloat16",
             kv_dtype=None, kv_layout: str = "NHD", sm_scale: float | None = None,
             chunk_tokens: int | None = None, disable_split_kv: bool = False,
             fixed_split_tokens: int | None = None, tensor_cores: bool | None = None,
             check_page_ids: bool = True, variant: str | None = None, variant_params: dict | None = None,
             logits_soft_cap: float | None = None, sinks=None, share_prefixes: bool | None = None,
             out_dtype=None) -> "BatchDecode":
        """Plans a batch for every layer's run(); see docs/api.md for the arguments.

        check_page_ids: read the page ids' range back from the GPU, so that a negative id fails
        here and run() refuses a cache with too few pages. That waits for the work already queued
        on the current stream. False skips it (no synchronization: plan() can overlap the GPU's
        previous step); the caller then guarantees 0 <= id < the cache's page count, as FlashInfer's
        plan() assumes.

        fixed_split_tokens: cut every request into work items of this many span positions, each
        read by its own CTAs alone, so a request's output is bitwise the same in any batch planned
        with the same kernel (docs/api.md, batch invariance).
        variant, variant_params: how visible scores become weights (docs/masks.md, "Variants"), e.g.
        variant="sinks", variant_params={"sinks": t}. FlashInfer's names select the built-ins:
        logits_soft_cap=50.0 (soft_cap; 0.0 or None: none) and sinks=t (a float32 tensor of one
        logit per query head), both together soft_cap_sinks.
        q_dtype, out_dtype: the queries' dtype and the output's (None: q_dtype's). Over an e4m3 cache
        the queries may be e4m3 too (q_dtype="float8_e4m3fn", out_dtype 16-bit), as vLLM quantizes
        them for FA3: they then scale with K (pass k_scale times the query scale).
        share_prefixes: neighbouring requests whose page lists start with the same page ids read
        those pages once for all of them, where the plan allows it (docs/shared_prefix.md). None (the
        default): in eager plans; CUDA-graph mode keeps its GPU planner and plans every request
        alone. True: in CUDA-graph mode too, which then plans on the host with the shared kernel
        from the first plan on. False: every request alone.
        """
        if share_prefixes is not None and not isinstance(share_prefixes, bool):
            validation.fail("share_prefixes", "None, True or False", share_prefixes)
        rule = split_rule(chunk_tokens, fixed_split_tokens, disable_split_kv)
        variant, variant_params = variant_args.resolve(variant, variant_params, logits_soft_cap, sinks)
        scalars = PlanScalars(num_qo_heads, num_kv_heads, head_dim, page_size, mask, window_left, q_dtype, kv_dtype,
                              kv_layout, sm_scale, tensor_cores, variant, out_dtype)
        key, known = self._known_setups(scalars, mask_params, variant_params)
        if known is None:
            validation.head_counts(num_qo_heads, num_kv_heads, page_size)
        # The query tokens are each request's newest positions (kv_len - q_len + i).
        graph, previous = self._graph, self._plan
        tables, page_range = self._read_batch(indptr, indices, last_page_len, page_size, qo_indptr, q_len,
                                              check_page_ids, reads_page_ids(graph, share_prefixes))
        batch = Batch(indptr, indices, last_page_len, qo_indptr, q_len, check_page_ids, tensor_cores)
        shared_setup = lambda setup: self._shared_setup(setup, scalars, mask_params, key, variant_params)  # noqa: E731
        try:
            kernel_q_len = tables.max_q_len if graph is None else graph.kernel_q_len(tables.max_q_len, previous)
            setup = self._setup(scalars, mask_params, variant_params, kernel_q_len, key, known)
            planning = choose_planning(graph, share_prefixes, setup, rule, batch)
            setup = planning.kernel_setup(setup, shared_setup)
            if graph is not None:
                graph.check_kernel(setup, previous)
            work, capacity = planning.size(setup, tables, rule, graph, previous)
        finally:
            landed, max_page = self._page_ids_landed(page_range)
        setup, tables, work, capacity = planning.share(setup, tables, work, capacity, batch, rule, self._host_planner,
                                                       page_range, shared_setup)
        buffers = self._buffers_for(capacity, setup, previous)

        # Every argument is valid, every value checked to fit the C type it goes into (nothing below
        # raises): from here on the new plan replaces the previous one.
        self._validated_caches.clear()  # cache tensors are validated against this plan (page count, shape)
        self._cache_pointed_at = NO_CACHE
        # A page-id range that landed was copied after the previous plan's work list, on the same
        # stream if the copies say so: then the staging memory is free without a wait of its own.
        tables = planning.write(buffers, tables, batch, page_range.copies.marked_stream if landed else None)
        a = buffers.decode_args  # the work-list pointers are in already; the tensors' come with run()
        page_ids = indices if graph is None else graph.hold_page_ids(indices, int(tables.num_page_ids))
        a.page_indices, a.num_page_ids = page_ids.data_ptr(), int(tables.num_page_ids)
        if previous is None or previous.setup is not setup or previous.buffers is not buffers:
            decode_params = self._write_scalars(setup, buffers)
        else:  # the same setup over the same buffers: the arguments hold its scalars already
            decode_params = previous.decode_launch.params
        decode_launch, merge_prepared, merge_launch = prepare_launches(setup, buffers, work, decode_params,
                                                                       graph is not None, previous)
        planning.start(setup, buffers, rule, lambda: self._current_stream(self._device_index))
        num_tokens = tables.num_tokens
        query_form = (num_tokens, num_tokens if graph is None else capacity.tokens, setup.q_dtype, setup.num_qo_heads,
                      setup.head_dim, setup.out_dtype)
        self._plan = Plan(setup, tables, buffers, page_ids, max_page, tables.batch, num_tokens, query_form, a,
                          buffers.merge_args, decode_launch, merge_prepared, merge_launch)
        return self

    def _known_setups(self, scalars: PlanScalars, mask_params, variant_params) -> tuple:
        """(memo key, {kernel query tokens: Setup} made for these scalars before, or None). Plans
        given mask tensors, or variant tensors, have no key: they make their setup each time."""
        variant_key = variant_args.memo_key(variant_params)  # None: tensors among them, as for mask_params
        if mask_params is not None or variant_key is None:
            return None, None
        key = (scalars, scalars.types(), variant_key)
        try:
            return key, self._setup_for_scalars.get(key)
        except TypeError:  # an unhashable argument: the checks of make_setup say what is wrong with it
            return None, None

    def _setup(self, scalars: PlanScalars, mask_params, variant_params, kernel_q_len: int, key, known) -> Setup:
        """The per-request setup of these scalars at kernel_q_len query tokens: the memo's, unless a
        mask or variant was registered since."""
        setup = None if known is None else known.get(kernel_q_len)
        if setup is None or setup.mask_generation != masks.generation:
            setup = make_setup(scalars, mask_params, kernel_q_len, engine=self.engine, arch=self._arch,
                               device=self.device, load_kernel=self._load_kernel, variant_params=variant_params)
            if key is not None:
                if len(self._setup_for_scalars) >= MAX_SETUPS:
                    self._setup_for_scalars.clear()
                self._setup_for_scalars.setdefault(key, {})[kernel_q_len] = setup
        return setup

    def _shared_setup(self, setup: Setup, scalars: PlanScalars, mask_params, key, variant_params) -> Setup:
        """The setup of the shared-prefix kernel beside setup (memoized with it, at (its query tokens,
        True)): a tensor-core one, whatever plan() would have picked for rows of one request."""
        kernel_q_len = setup.spec.max_q_len
        memo = None if key is None else self._setup_for_scalars.get(key)
        found = None if memo is None else memo.get((kernel_q_len, True))
        if found is None or found.mask_generation != setup.mask_generation:
            found = make_setup(scalars.on_tensor_cores(), mask_params, kernel_q_len, engine=self.engine,
                               arch=self._arch, device=self.device, load_kernel=self._load_kernel,
                               variant_params=variant_params, shared_prefix=True)
            if memo is not None:
                memo[(kernel_q_len, True)] = found
        return found

    def _buffers_for(self, capacity, setup: Setup, previous: Plan | None) -> PlanBuffers:
        """The previous plan's buffers where the new one fits in them, else new ones (never in CUDA-graph mode)."""
        partial_rows = capacity.partial_slots * setup.spec.max_q_len * setup.num_qo_heads
        merge_groups = capacity.batch * setup.num_kv_heads * setup.kernel.tiling.row_tiles
        return self._buffers_with(capacity, partial_rows, setup.head_dim, merge_groups, previous)

    def _write_scalars(self, setup: Setup, buffers: PlanBuffers):
        """The setup's scalars into the buffers' launch arguments (they hold another setup's); returns
        the decode kernel's params array, with the mask parameters' values."""
        a, m = buffers.decode_args, buffers.merge_args
        a.num_qo_heads = m.num_qo_heads = setup.num_qo_heads
        a.sm_scale_log2 = setup.sm_scale_log2
        checked_for = (a, setup.spec.kv_is_fp8, setup.num_kv_heads)  # what run() checks the scales against
        if checked_for != self._scales_checked_for:
            self._scales_pointed_at, self._scales_checked_for = None, checked_for  # run() checks and sets them again
        mask_params, variant_params, values = setup.kernel.mask.params, setup.kernel.variant.params, []
        for params, given in ((mask_params, setup.params), (variant_params, setup.variant_params)):
            for param in params:  # the kernel's order: the mask's, then the variant's
                value = given[param.name]  # a tensor among them stays alive in the setup, held by the plan
                values.append(value.data_ptr() if param.kind in TENSOR_KINDS else value)
        return buffers.decode_params(mask_params + variant_params, values)

    # ---- what the current plan decided ------------------------------------------------------

    def replan(self):
        """Queues the GPU planner on the current stream over the page table as graph_page_table
        holds it now. Captured at the start of a CUDA-graph step (before the first run()), it makes
        every replay plan for the lengths the caller wrote into graph_page_table in place, with no
        plan() in between. plan() queues the planner itself: a step that calls plan() and replays a
        graph of run()s alone plans once."""
        plan = self._plan
        if plan is None or not isinstance(plan.tables, DeviceTables):
            if plan is None:
                why = "there is no plan"
            elif self._graph is None:
                why = "no CUDA graph mode (use_cuda_graph=True)"
            else:
                why = self._graph.host_planned_because(plan.setup) or "the current plan was made on the host"
            raise RuntimeError("replan() needs a plan made on the GPU (use_cuda_graph=True, max_batch_size up to "
                               f"{PLAN_MAX_BATCH}, fewer on GPUs of about 100 KB of shared memory a block, and "
                               f"a mask without host-side spans: none, causal, sliding_window): {why}")
        self._graph.planner(self._current_stream(self._device_index))

    @property
    def graph_page_table(self):
        """CUDA-graph mode planned on the GPU: the page-table buffer its planner reads (see
        device_planner.PageTable and replan()); None otherwise."""
        planner = None if self._graph is None else self._graph.planner
        return None if planner is None else planner.page_table

    spec = _of_plan("setup.spec", "The current plan's DecodeSpec.")
    kernel = _of_plan("setup.kernel", "The current plan's Kernel.")
    num_qo_heads = _of_plan("setup.num_qo_heads", "Query heads of the current plan.")
    num_kv_heads = _of_plan("setup.num_kv_heads", "KV heads of the current plan.")
    head_dim = _of_plan("setup.head_dim", "head_dim of the current plan.")
    page_size = _of_plan("setup.page_size", "Tokens per cache page of the current plan.")
    batch_size = _of_plan("batch_size", "Requests in the current plan.")
    num_tokens = _of_plan("num_tokens", "Query tokens in the current plan.")

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

        A plan without query tokens (an empty batch, e.g. a data-parallel rank with no decodes this
        step) checks the tensors and returns the empty out (and lse) without a launch; in CUDA-graph
        mode it launches its fixed grid, whose items are then all padding, so the capture holds it.

        Under torch.compile, run() is the operator torch.ops.flashjit.decode (serving/torch_ops.py),
        which runs the plan current when the compiled code runs; plan() stays outside the compiled code.
        """
        if self._compiling():  # (the operator's kernel is this method, called outside any tracing)
            from .torch_ops import decode as traced_decode

            return traced_decode(self._op_handle, q, kv_cache, out, lse, return_lse, k_scale, v_scale)
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchDecode.run() called before plan()")
        a = plan.decode_args
        self._point_at_cache(kv_cache, a, plan)
        # Scales given, or others held from an earlier call ((None, None) is the key of neither):
        if k_scale is not None or v_scale is not None or self._scales_pointed_at != (None, None):
            self._point_at_scales(a, k_scale, v_scale, plan)
        form = plan.query_form
        a.q, a.q_stride = self._query_args("q", q, plan, form[2])
        if out is None:
            out = q.new_empty((q.shape[0],) + form[3:5], dtype=form[5])  # (qo heads, head_dim)
        a.out, a.out_stride = out_pointer, out_stride = self._query_args("out", out, plan, form[5])
        if return_lse and lse is None:
            lse = q.new_empty(out.shape[:2], dtype=self._lse_dtype)
        a.lse = lse_pointer = 0 if lse is None else self._lse_pointer(lse, out)
        if not form[1]:  # no query rows at all (an empty batch, outside CUDA-graph mode): no grid
            return (out, lse) if return_lse else out

        stream = self._current_stream(self._device_index)
        plan.decode_launch(stream)
        merge = plan.merge_launch
        if merge is not None:
            m = plan.merge_args
            m.out, m.out_stride, m.lse = out_pointer, out_stride, lse_pointer
            merge(stream)
        return (out, lse) if return_lse else out

    def point_variant_at(self, name: str, tensor) -> None:
        """Point the current plan's tensor variant parameter `name` (e.g. "sinks") at another tensor of
        the planned one's dtype, shape and device, without planning again: layers that each have their
        own sinks share one plan. run() reads it from its next launch on (a captured run() keeps the
        one it was captured with); the caller keeps the tensor alive while it is in use."""
        variant_args.repoint_tensor(self._plan, name, tensor)

    def query_form(self):
        """(q's dtype, qo heads, head_dim, out's dtype) under the current plan; None before one."""
        return None if self._plan is None else self._plan.query_form[2:]

    def _point_at_cache(self, kv_cache, a, plan: Plan):
        """Point the arguments at K and V; the cache they point at already is recognised in a few tests."""
        pair = isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2
        k, v = kv_cache if pair else (kv_cache, kv_cache)
        last = self._cache_pointed_at
        if (pair is last[0] and last[1]() is k and last[2]() is v and k.data_ptr() == last[3]
                and v.data_ptr() == last[4] and k.shape == last[5] and v.shape == last[6]):
            return
        self._cache_pointed_at = NO_CACHE  # a cache refused half-way may have re-pointed K already
        run_checks.point_at_cache(kv_cache, a, plan, self.device, self._validated_caches)
        self._cache_pointed_at = (pair, weakref.ref(k), weakref.ref(v), k.data_ptr(), v.data_ptr(), k.shape, v.shape)

    def _point_at_scales(self, a, k_scale, v_scale, plan: Plan):
        """Point the arguments at the scales; unchanged scales (the common case) cost one comparison."""
        key = (scale_key(k_scale), scale_key(v_scale))
        if key == self._scales_pointed_at:
            return
        self._scales_pointed_at = None  # a v_scale refused after k_scale was set leaves no stale match
        run_checks.point_at_scales(a, k_scale, v_scale, plan.setup, self.device)
        self._scales_pointed_at = key

    def _query_args(self, name: str, t, plan: Plan, dtype) -> tuple[int, int]:
        """(data_ptr, row stride) of q or out, which must be of dtype. The common valid case costs one
        read of each attribute (torch's stride(i) costs twice stride()); anything else gets the full
        validation."""
        try:
            pointer, (rows, heads, dim), (row_stride, head_stride, unit) = t.data_ptr(), t.shape, t.stride()
            low, high, _, qo_heads, head_dim, _ = plan.query_form
            if (t.dtype is dtype and t.get_device() == self._device_index and heads == qo_heads
                    and dim == head_dim and low <= rows <= high and head_stride == dim and unit == 1
                    and row_stride * t.itemsize % 16 == 0 and pointer % 16 == 0):  # 16-byte rows
                return pointer, row_stride
        except (AttributeError, TypeError, ValueError):  # not a 3-d tensor: the checks say what it is
            pass
        run_checks.check_query(name, t, plan, self.device, dtype)
        return t.data_ptr(), t.stride(0)


def decode(q, kv_cache, indptr, indices, last_page_len, *, page_size: int | None = None, engine: Engine | None = None,
           return_lse: bool = False, kv_layout: str = "NHD", k_scale=None, v_scale=None, **plan_options):
    """One-shot convenience for scripts: plan and run in one call (serving code should reuse a BatchDecode)."""
    k = kv_cache[0] if isinstance(kv_cache, (tuple, list)) else kv_cache[:, 0]
    if page_size is None:
        page_size = k.shape[1] if kv_layout.upper() == "NHD" else k.shape[2]
    num_kv_heads = k.shape[2] if kv_layout.upper() == "NHD" else k.shape[1]
    decoder = BatchDecode(engine, device=q.device)
    decoder.plan(indptr, indices, last_page_len, q.shape[1], num_kv_heads, q.shape[2], page_size,
                 q_dtype=normalize_dtype(q.dtype, "q", QUERY_DTYPES + (FP8_QUERY_DTYPE,)),
                 kv_dtype=normalize_dtype(k.dtype, "kv_dtype", KV_DTYPES), kv_layout=kv_layout, **plan_options)
    return decoder.run(q, kv_cache, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
