"""FlashInfer's paged decode wrappers (0.6 and 0.7 signatures) over BatchDecode: the same arguments,
defaults and conventions, so code written for `flashinfer.BatchDecodeWithPagedKVCacheWrapper` runs by
changing the import. plan() takes 0.7's keywords (q_len_per_req, is_causal, window_right) and 0.6's
positional options after page_size; run() takes 0.7's sinks per call.

Where the conventions differ, the wrappers convert: FlashInfer's LSE is base 2 (flashjit's natural
log), its fixed_split_size counts pages (flashjit's chunk_tokens, tokens), its window_left=-1 means
no window (flashjit: mask "none"), its q_scale multiplies the softmax scale (flashjit folds it with
k_scale). The float workspace buffer is accepted and unused: flashjit sizes its own buffers.

In CUDA-graph mode the kernels read the page ids from the caller's paged_kv_indices_buffer in place
(BatchDecode's page_ids_buffer), so ids a serving loop writes there with its own kernel reach every
replay; plan() given that buffer (or a prefix view of it) copies nothing.
"""

from __future__ import annotations

import functools
import typing

from ... import validation
from ...serving.batch_decode import BatchDecode
from . import arguments


def _decoder(device, **graph_options) -> BatchDecode:
    """The BatchDecode behind a wrapper (the CPU tests replace it with one planning for an injected arch)."""
    return BatchDecode(device=device, **graph_options)


class Planned(typing.NamedTuple):
    """What the last plan() leaves for run() and forward() to check, and fast_decode_plan to keep."""

    options: dict      # arguments.plan_options
    out_dtype: object  # the output's torch dtype (FlashInfer's run() keeps plan()'s o_data_type)


class BatchDecodeWithPagedKVCacheWrapper:
    """FlashInfer's decode wrapper over flashjit's BatchDecode (one per batch composition: plan()
    once, run() per layer).

    >>> wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    >>> wrapper.plan(indptr, indices, last_page_len, 32, 8, 128, 16, data_type=torch.float16)
    >>> out = wrapper.run(q, kv_cache)
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        """As FlashInfer's. use_tensor_cores is recorded (flashjit picks tensor cores per kernel);
        backend may be "auto", "fa2" or "fa3" (one kernel family here). With use_cuda_graph the
        batch size is fixed at len(paged_kv_last_page_len_buffer), and the kernels read the page ids
        from paged_kv_indices_buffer (int32, on the workspace's device) in place."""
        arguments.checked_kv_layout(kv_layout)
        arguments.check_backend(backend, jit_args, jit_kwargs)
        self.device = float_workspace_buffer.device
        graph_options = {}
        if use_cuda_graph:
            import torch

            for name, buffer in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                                 ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                                 ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not torch.is_tensor(buffer):
                    validation.fail(name, "a torch.Tensor when use_cuda_graph=True", type(buffer).__name__)
            fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != fixed_batch_size + 1:
                validation.fail("paged_kv_indptr_buffer", f"batch_size + 1 = {fixed_batch_size + 1} entries "
                                "(batch_size: len(paged_kv_last_page_len_buffer))", len(paged_kv_indptr_buffer))
            validation.tensor("paged_kv_indices_buffer", paged_kv_indices_buffer, dtype=torch.int32,
                              device=self.device, ndim=1)
            if not paged_kv_indices_buffer.is_contiguous() or paged_kv_indices_buffer.numel() < 1:
                validation.fail("paged_kv_indices_buffer", "a contiguous, non-empty int32 tensor (the kernels read it)",
                                f"shape {tuple(paged_kv_indices_buffer.shape)}, strides {paged_kv_indices_buffer.stride()}")
            graph_options = {"use_cuda_graph": True, "max_batch_size": max(1, fixed_batch_size),
                             "page_ids_buffer": paged_kv_indices_buffer}
        else:
            fixed_batch_size = 0
        self._decoder = _decoder(self.device, **graph_options)
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        self._use_tensor_cores = bool(use_tensor_cores)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        self._fixed_batch_size = fixed_batch_size
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._scales_in_use = None
        self._planned: Planned | None = None
        # The last plan() call's arguments, planned again with the sinks of the first run() given them;
        # from then on every plan() plans for sinks, and each run() points the kernel at its own.
        self._plan_call = None
        self._sinks = None  # the sinks tensor the kernel reads (kept alive here), None for a plan without

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def flashjit_decoder(self) -> BatchDecode:
        """The BatchDecode that plans and runs (its current_plan, spec, work)."""
        return self._decoder

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        """Accepted for FlashInfer's API; flashjit keeps its own buffers."""
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer

    # ---- plan ---------------------------------------------------------------------------------

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking: bool = True, block_tables=None, seq_lens=None,
             fixed_split_size=None, disable_split_kv: bool = False, q_len_per_req: int = 1, *,
             window_right: int = 0, is_causal=None, use_token_head_sf: bool = False) -> None:
        """FlashInfer's plan(): indptr [batch+1], indices (page ids), last_page_len [batch] (int32;
        CPU tensors take flashjit's fast path). Reads the page ids' range back to check them (one
        wait for the stream); fast_decode_plan does not. In CUDA-graph mode copies indptr and
        last_page_len into their buffers and indices into paged_kv_indices_buffer, unless indices is
        (a prefix of) that buffer. A request without pages attends to nothing (its output is 0).
        q_len_per_req: query tokens per request, causal among themselves unless is_causal=False
        (window_right=-1 also lifts the bound at the query's position); logits_soft_cap > 0 caps
        the logits (Gemma 2)."""
        dtypes = arguments.plan_dtypes(q_data_type, kv_data_type, data_type, o_data_type)
        options = arguments.plan_options(
            page_size=page_size, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
            window_right=window_right, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
            rope_theta=rope_theta, fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
            block_tables=block_tables, seq_lens=seq_lens, q_len_per_req=q_len_per_req, is_causal=is_causal,
            use_token_head_sf=use_token_head_sf)
        batch_size = len(last_page_len)
        self._check_graph_batch(batch_size, indices)
        indices = self._device_page_ids(indices, non_blocking)
        self._plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, dtypes,
                   options, check_page_ids=True)
        if self._use_cuda_graph:  # the buffers hold the plan's table, as FlashInfer's do
            for buffer, values in ((self._paged_kv_indptr_buf, indptr), (self._paged_kv_last_page_len_buf, last_page_len)):
                if values is not buffer:
                    buffer.copy_(values, non_blocking=non_blocking)

    begin_forward = plan

    def _check_graph_batch(self, batch_size: int, indices) -> None:
        if not self._use_cuda_graph:
            return
        if batch_size != self._fixed_batch_size:
            validation.fail("plan() in CUDA-graph mode", f"the wrapper's batch size {self._fixed_batch_size} "
                            "(len(paged_kv_last_page_len_buffer))", f"batch size {batch_size}")
        if len(indices) > len(self._paged_kv_indices_buf):
            validation.fail("indices", f"at most len(paged_kv_indices_buffer) = {len(self._paged_kv_indices_buf)} "
                            "page ids", len(indices))

    def _device_page_ids(self, indices, non_blocking: bool):
        """indices as int32 on the wrapper's device (FlashInfer moves them there too): as given when they are."""
        import torch

        if torch.is_tensor(indices) and (indices.dtype != torch.int32 or indices.device != self.device):
            return indices.to(device=self.device, dtype=torch.int32, non_blocking=non_blocking)
        return indices

    def _plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, dtypes: tuple,
              options: dict, check_page_ids: bool) -> None:
        call = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, dtypes, options,
                check_page_ids)
        self._plan_with(call, self._sinks)
        self._plan_call = call

    def _plan_with(self, call: tuple, sinks) -> None:
        indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, dtypes, options, \
            check_page_ids = call
        q_dtype, kv_dtype, out_dtype = dtypes
        self._decoder.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                           q_dtype=q_dtype, kv_dtype=kv_dtype, out_dtype=out_dtype, kv_layout=self._kv_layout,
                           check_page_ids=check_page_ids, sinks=sinks, **options)
        self._planned = Planned(options, out_dtype)

    def _use_sinks(self, sinks) -> None:
        """Serve run()'s sinks: the planned kernel re-pointed at them, or (for a plan made without
        sinks, or with sinks and now without) the last plan() made again."""
        current = self._sinks
        if sinks is current:
            return
        if sinks is not None and current is not None:
            self._decoder.point_variant_at("sinks", sinks)
        else:
            if self._decoder.use_cuda_graph and _capturing(self.device):
                arguments.not_implemented("sinks", "<changed during a CUDA-graph capture>", "a plan for sinks (or "
                                          "without them) is made outside the capture: run() once eagerly first")
            self._plan_with(self._plan_call, sinks)
        self._sinks = sinks

    # ---- run ----------------------------------------------------------------------------------

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        """FlashInfer's run(): q [batch, qo_heads, head_dim]; paged_kv_cache a (k, v) pair or one
        [pages, 2, ...] tensor in the wrapper's layout. Returns out, and with return_lse the base-2
        LSE [batch, qo_heads] (written into lse when given, as FlashInfer does even without
        return_lse). q_scale and k_scale scale the logits, v_scale the output; each may be a float
        or (k/v) a float32 tensor of 1 or num_kv_heads values. enable_pdl is accepted and unused.
        sinks: a float32 logit per query head joining each row's softmax denominator (gpt-oss); the
        first run() with sinks after a plan without them plans again (outside a CUDA-graph capture),
        later ones only point the kernel at theirs. q_len_per_req: None or plan()'s value."""
        if self._planned is None:
            raise RuntimeError("run() called before plan()")
        arguments.check_run_extras(args, self._planned.options["q_len"], q_len_per_req=q_len_per_req,
                                   skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                                   kv_cache_sf=kv_cache_sf)
        self._use_sinks(sinks)
        planned_window = self._planned.options["window_left"]
        planned_window = arguments.NO_WINDOW if planned_window is None else planned_window
        if window_left is not None and window_left != planned_window:
            validation.fail("window_left", f"plan()'s window_left={planned_window} (the kernel is planned for it)",
                            window_left)
        kv_cache = arguments.cache_for_run(paged_kv_cache, self._kv_layout)
        k_scale, v_scale = arguments.run_scales(q_scale, k_scale, v_scale)
        # A k_scale tensor times q_scale is a new tensor the kernel reads when it runs: kept alive until the next run().
        self._scales_in_use = (k_scale, v_scale)
        if not return_lse and lse is None:
            return self._decoder.run(q, kv_cache, out=out, k_scale=k_scale, v_scale=v_scale)
        out, lse = self._decoder.run(q, kv_cache, out=out, lse=lse, return_lse=True, k_scale=k_scale,
                                     v_scale=v_scale)
        arguments.lse_to_base2(lse)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None, k_scale=None, v_scale=None,
                window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None):
        """FlashInfer's deprecated forward(): run() with the plan's settings, which these must repeat."""
        self._check_forward_settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(self, q, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None, k_scale=None,
                           v_scale=None, window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                           rope_theta=None):
        """FlashInfer's deprecated forward_return_lse(): run(return_lse=True) with the plan's settings."""
        self._check_forward_settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)

    def _check_forward_settings(self, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                                rope_theta) -> None:
        """FlashInfer's forward() re-sets what plan() set; here the kernel is planned for plan()'s values."""
        if self._planned is None:
            raise RuntimeError("forward() called before plan()")
        options = arguments.plan_options(page_size=1, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                                         logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                                         rope_theta=rope_theta)
        planned = dict(self._planned.options)
        if planned["mask"] == "causal":  # forward() has no q_len_per_req: compare the window alone
            planned["mask"] = "none"
        given = {"window_left": window_left, "sm_scale": sm_scale, "logits_soft_cap": logits_soft_cap}
        for name, keys in (("window_left", ("mask", "window_left")), ("sm_scale", ("sm_scale",)),
                           ("logits_soft_cap", ("logits_soft_cap",))):
            if any(options[key] != planned[key] for key in keys):
                arguments.not_implemented(name, given[name], "forward() must repeat plan()'s value here "
                                          "(the kernel is planned for it); pass it to plan()")

    def end_forward(self) -> None:
        """FlashInfer's deprecated no-op."""


def _capturing(device) -> bool:
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's CUDA-graph decode wrapper: BatchDecodeWithPagedKVCacheWrapper with
    use_cuda_graph=True over the caller's buffers. Plan outside the graph; a captured run()
    replays correctly after each later plan(), and reads the page ids the caller writes into
    indices_buffer in place."""

    def __init__(self, workspace_buffer, indptr_buffer, indices_buffer, last_page_len_buffer, kv_layout: str = "NHD",
                 use_tensor_cores: bool = False) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


def fast_decode_plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
                     q_data_type=None, kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                     rope_theta=None, non_blocking: bool = True, fixed_split_size=None, disable_split_kv: bool = False,
                     q_len_per_req: int = 1, global_override_indptr_cpu=None) -> None:
    """FlashInfer's fast_decode_plan(wrapper, ...), used as `wrapper.plan = partial(fast_decode_plan,
    wrapper)`: plan() without its copies and checks. In CUDA-graph mode the page table is the one
    the caller wrote into the wrapper's buffers: the kernels read the ids from
    paged_kv_indices_buffer, whatever `indices` is (its length is still checked). Outside it,
    indices must already be int32 on the device. global_override_indptr_cpu replaces indptr for the
    host's planning; with page_size 1 last_page_len is not read (every page is full). The page ids
    are not read back (no synchronization): the caller vouches that they are in range."""
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper):
        validation.fail("fast_decode_plan's wrapper", "a flashjit.compat.flashinfer wrapper "
                        "(FlashInfer's own wrappers take flashinfer.fast_decode_plan)", type(self).__name__)
    if q_data_type is None and data_type is None:
        q_data_type = "float16"
    kept_output = None if self._planned is None else self._planned.out_dtype
    dtypes = arguments.plan_dtypes(q_data_type, kv_data_type, data_type, kept_output=kept_output)
    options = arguments.plan_options(
        page_size=page_size, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req)
    batch_size = len(last_page_len)
    self._check_graph_batch(batch_size, indices)
    host_indptr = indptr if global_override_indptr_cpu is None else global_override_indptr_cpu
    if page_size == 1:
        import torch

        last_page_len = torch.ones(batch_size, dtype=torch.int32)
    page_ids = self._paged_kv_indices_buf if self._use_cuda_graph else indices
    self._plan(host_indptr, page_ids, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, dtypes,
               options, check_page_ids=False)
