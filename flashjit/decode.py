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
import math

import numpy as np

from . import checks
from .engine import Engine
from .kernel import MASK_PARAM_CTYPES, DecodeArgs, MergeArgs, launch
from .plan import WorkPlan, plan_work
from .spec import DecodeSpec, normalize_dtype

LOG2E = 1.4426950408889634
_default_engine: Engine | None = None


def default_engine() -> Engine:
    global _default_engine
    if _default_engine is None:
        _default_engine = Engine()
    return _default_engine


def _torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _current_stream(device_index: int) -> int:
    import torch

    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # 0.2 us instead of ~5 us
    return getter(device_index) if getter else torch.cuda.current_stream(device_index).cuda_stream


class BatchDecode:
    """Paged-KV decode attention for a batch of requests.

    >>> decoder = BatchDecode(device="cuda")
    >>> decoder.plan(indptr, indices, last_page_len, 32, 8, 128, 16, mask="causal")
    >>> out = decoder.run(q, (k_cache, v_cache))
    """

    def __init__(self, engine: Engine | None = None, device="cuda"):
        import torch

        self.engine = engine or default_engine()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            checks.fail("device", "a CUDA device", self.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._planned = False

    # ---- plan -------------------------------------------------------------------------------

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, qo_indptr=None, q_len: int | None = None, mask: str = "none",
             window_left: int | None = None, mask_params: dict | None = None, q_dtype="bfloat16",
             kv_dtype=None, kv_layout: str = "NHD", sm_scale: float | None = None,
             chunk_tokens: int | None = None, disable_split_kv: bool = False,
             tensor_cores: bool | None = None) -> "BatchDecode":
        import torch

        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("page_size", page_size)):
            if not isinstance(value, int) or value < 1:
                checks.fail(name, "a positive int", value)
        if num_qo_heads % num_kv_heads:
            checks.fail("num_qo_heads", f"a multiple of num_kv_heads={num_kv_heads}", num_qo_heads)
        indptr_h = checks.indptr_array("indptr", indptr)
        batch = len(indptr_h) - 1
        last_h = checks.host_int_array("last_page_len", last_page_len, batch)
        num_pages = np.diff(indptr_h)
        if np.any((last_h < 1) & (num_pages > 0)) or np.any(last_h > page_size) or np.any(last_h < 0):
            bad = int(np.argmax((last_h > page_size) | (last_h < 0) | ((last_h < 1) & (num_pages > 0))))
            checks.fail("last_page_len", f"values in 1..page_size={page_size} (0 only for requests with no pages)",
                        f"last_page_len[{bad}]={last_h[bad]}")
        kv_lens = np.where(num_pages > 0, (num_pages - 1) * page_size + last_h, 0)

        if qo_indptr is not None:
            qo_h = checks.indptr_array("qo_indptr", qo_indptr, length=batch + 1)
        else:
            n = 1 if q_len is None else q_len
            if not isinstance(n, int) or n < 1:
                checks.fail("q_len", "a positive int", q_len)
            qo_h = np.arange(batch + 1, dtype=np.int64) * n
        q_lens = np.diff(qo_h)  # the query tokens are the request's newest positions (kv_len - q_len + i)

        checks.tensor("indices", indices, dtype=torch.int32, device=self.device, ndim=1)
        if len(indices) < indptr_h[-1]:
            checks.fail("indices", f"at least indptr[-1]={indptr_h[-1]} page ids", len(indices))
        if indptr_h[-1] > 0:
            used = indices[: int(indptr_h[-1])]
            low, high = int(used.min()), int(used.max())  # one sync, here rather than per run()
            if low < 0:
                checks.fail("indices", "page ids >= 0", low)
        else:
            high = -1
        self._max_page = high

        spec = DecodeSpec(head_dim=head_dim, dtype=q_dtype, kv_dtype=kv_dtype, mask=mask, page_size=page_size,
                          group_size=num_qo_heads // num_kv_heads, max_q_len=max(1, int(q_lens.max(initial=1))),
                          kv_layout=kv_layout, tensor_cores=tensor_cores,
                          arch=f"sm_{''.join(map(str, torch.cuda.get_device_capability(self.device)))}")
        kernel = self.engine.get_kernel(spec)
        loaded = kernel.loaded(self.device.index)
        params = self._mask_params(kernel.mask, window_left, mask_params)

        span_begin, span_end = np.zeros_like(kv_lens), kv_lens
        if kernel.mask.kv_span is not None:
            span_begin, span_end = kernel.mask.kv_span(kv_lens, q_lens, params)
            span_end = np.minimum(span_end, np.iinfo(np.int32).max)
        if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
            checks.fail("chunk_tokens", "a positive int", chunk_tokens)
        if disable_split_kv:
            chunk_tokens = max(1, int(np.max(span_end - span_begin, initial=1)))
        tiling = kernel.tiling
        work = plan_work(span_begin, span_end, qo_h, ctas_per_item=num_kv_heads * tiling.row_tiles,
                         max_ctas=loaded.num_sms * loaded.ctas_per_sm, granularity=tiling.tile_tokens,
                         chunk_tokens=chunk_tokens)

        self.spec, self.kernel, self.work = spec, kernel, work
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        self.batch_size, self.num_tokens = batch, work.num_tokens
        self._q_dtype, self._kv_dtype = _torch_dtype(spec.dtype), _torch_dtype(spec.kv_dtype)
        self._upload(work, kv_lens, indptr_h, indices)
        self._build_args(kernel, loaded, work, params, indices,
                         (1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)) * LOG2E)
        self._planned = True
        return self

    def _mask_params(self, mask, window_left, mask_params) -> dict:
        params = dict(mask_params or {})
        if window_left is not None:
            params["window_left"] = window_left
        missing = [p for p in mask.param_names if p not in params]
        unknown = [p for p in params if p not in mask.param_names]
        if missing or unknown:
            checks.fail(f"mask_params for mask {mask.name!r}", f"exactly {list(mask.param_names)}",
                        f"missing {missing}, unknown {unknown}")
        for p in mask.params:
            value = params[p.name]
            if p.kind == "int" and (not isinstance(value, (int, np.integer)) or value < 0):
                checks.fail(f"mask param {p.name}", "a non-negative int", value)
        return params

    def _upload(self, work: WorkPlan, kv_lens, indptr_h, indices):
        """Pack the work list into one int32 buffer and copy it to the GPU once."""
        import torch

        parts = [np.array([work.num_work]), work.work_request, work.work_begin, work.work_end,
                 kv_lens, indptr_h[:-1], work.req_qo_indptr, work.req_work_indptr, work.token_request]
        host = torch.from_numpy(np.concatenate(parts).astype(np.int32))
        self._plan_buffer = host.pin_memory().to(self.device, non_blocking=True)
        offsets = np.cumsum([0] + [len(p) for p in parts])
        base = self._plan_buffer.data_ptr()
        self._ptr = {name: base + 4 * int(offsets[i]) for i, name in enumerate(
            ("num_work", "work_request", "work_begin", "work_end", "req_kv_len", "req_page_begin",
             "req_qo_indptr", "req_work_indptr", "token_request"))}
        self._indices = indices
        if work.needs_merge:
            rows = work.num_work * self.spec.max_q_len * self.num_qo_heads
            self._tmp_o = torch.empty(rows * self.head_dim, dtype=torch.float32, device=self.device)
            self._tmp_lse = torch.empty(rows, dtype=torch.float32, device=self.device)
        else:
            self._tmp_o = self._tmp_lse = None

    def _build_args(self, kernel, loaded, work: WorkPlan, params: dict, indices, sm_scale_log2: float):
        import torch

        p = self._ptr
        a = DecodeArgs()
        for name in ("num_work", "work_request", "work_begin", "work_end", "req_kv_len", "req_page_begin",
                     "req_qo_indptr", "req_work_indptr"):
            setattr(a, name, p[name])
        a.page_indices = indices.data_ptr()
        a.tmp_o = self._tmp_o.data_ptr() if self._tmp_o is not None else 0
        a.tmp_lse = self._tmp_lse.data_ptr() if self._tmp_lse is not None else 0
        a.num_qo_heads = self.num_qo_heads
        a.sm_scale_log2 = sm_scale_log2
        self._decode_args = a

        self._mask_values, self._mask_tensors = [], []
        for param in kernel.mask.params:
            value = params[param.name]
            if param.kind == "int_tensor":
                checks.tensor(f"mask param {param.name}", value, dtype=torch.int32, device=self.device, ndim=1)
                self._mask_tensors.append(value)  # keep alive while planned
                value = value.data_ptr()
            self._mask_values.append(MASK_PARAM_CTYPES[param.kind](value))
        self._decode_params = (ctypes.c_void_p * (1 + len(self._mask_values)))(
            ctypes.addressof(a), *(ctypes.addressof(v) for v in self._mask_values))
        self._decode_grid = (work.num_work, self.num_kv_heads, kernel.tiling.row_tiles)
        self._decode_fn = loaded.decode

        m = MergeArgs()
        m.tmp_o, m.tmp_lse = a.tmp_o, a.tmp_lse
        m.token_request, m.req_qo_indptr, m.req_work_indptr = p["token_request"], p["req_qo_indptr"], p["req_work_indptr"]
        m.num_qo_heads = self.num_qo_heads
        self._merge_args = m
        self._merge_params = (ctypes.c_void_p * 1)(ctypes.addressof(m))
        self._merge_grid = (work.num_tokens, self.num_qo_heads, 1)
        self._merge_fn = loaded.merge if work.needs_merge else None

    # ---- run --------------------------------------------------------------------------------

    def run(self, q, kv_cache, *, out=None, lse=None, return_lse: bool = False):
        """Attention of q over the planned cache; returns out (and lse, natural log, if asked)."""
        if not self._planned:
            raise RuntimeError("BatchDecode.run() called before plan()")
        k, v = self._split_cache(kv_cache)
        tokens, heads, dim = self.num_tokens, self.num_qo_heads, self.head_dim
        checks.tensor("q", q, dtype=self._q_dtype, device=self.device, shape=(tokens, heads, dim))
        checks.rows_16b_aligned("q", q, dim)
        if out is None:
            out = q.new_empty((tokens, heads, dim))
        else:
            checks.tensor("out", out, dtype=self._q_dtype, device=self.device, shape=(tokens, heads, dim))
            checks.rows_16b_aligned("out", out, dim)
        if return_lse and lse is None:
            lse = q.new_empty((tokens, heads), dtype=__import__("torch").float32)
        if lse is not None:
            checks.tensor("lse", lse, dtype=__import__("torch").float32, device=self.device, shape=(tokens, heads))
            if not lse.is_contiguous():
                checks.fail("lse", "a contiguous tensor", f"strides {lse.stride()}")

        a = self._decode_args
        a.q, a.q_stride = q.data_ptr(), q.stride(0)
        a.k, a.v = k.data_ptr(), v.data_ptr()
        a.out, a.out_stride = out.data_ptr(), out.stride(0)
        a.lse = lse.data_ptr() if lse is not None else 0
        stream = _current_stream(self.device.index)
        t = self.kernel.tiling
        launch(self._decode_fn, self._decode_grid, t.block, self._decode_params, stream, t.smem_bytes)
        if self._merge_fn is not None:
            m = self._merge_args
            m.out, m.out_stride, m.lse = a.out, a.out_stride, a.lse
            launch(self._merge_fn, self._merge_grid, t.merge_block, self._merge_params, stream)
        return (out, lse) if return_lse else out

    def _split_cache(self, kv_cache):
        """(k, v) views of the cache, checked against the plan; sets the stride arguments."""
        import torch

        if isinstance(kv_cache, (tuple, list)):
            if len(kv_cache) != 2:
                checks.fail("kv_cache", "a (k_cache, v_cache) pair or one [pages, 2, ...] tensor", f"{len(kv_cache)} tensors")
            k, v = kv_cache
            checks.tensor("k_cache", k, dtype=self._kv_dtype, device=self.device, ndim=4)
            checks.tensor("v_cache", v, dtype=self._kv_dtype, device=self.device, ndim=4)
            if k.shape != v.shape or k.stride() != v.stride():
                checks.fail("v_cache", f"the shape and strides of k_cache {tuple(k.shape)}/{k.stride()}",
                            f"{tuple(v.shape)}/{v.stride()}")
        else:
            checks.tensor("kv_cache", kv_cache, dtype=self._kv_dtype, device=self.device, ndim=5)
            if kv_cache.shape[1] != 2:
                checks.fail("kv_cache", "shape [pages, 2, ...] (K then V)", f"shape {tuple(kv_cache.shape)}")
            k, v = kv_cache[:, 0], kv_cache[:, 1]
        if self.spec.kv_layout == "NHD":
            expected = (self.page_size, self.num_kv_heads, self.head_dim)
            slot_dim, head_dim_ = 1, 2
        else:
            expected = (self.num_kv_heads, self.page_size, self.head_dim)
            slot_dim, head_dim_ = 2, 1
        if tuple(k.shape[1:]) != expected:
            layout = "[pages, page_size, kv_heads, head_dim]" if self.spec.kv_layout == "NHD" else "[pages, kv_heads, page_size, head_dim]"
            checks.fail("kv_cache", f"{self.spec.kv_layout} layout {layout} = [*, {', '.join(map(str, expected))}]",
                        f"shape {tuple(k.shape)}")
        if k.shape[0] <= self._max_page:
            checks.fail("kv_cache", f"more than {self._max_page} pages (indices refer to page {self._max_page})",
                        f"{k.shape[0]} pages")
        checks.rows_16b_aligned("kv_cache", k, self.head_dim)
        a = self._decode_args
        a.page_stride, a.slot_stride, a.head_stride = k.stride(0), k.stride(slot_dim), k.stride(head_dim_)
        return k, v


def decode(q, kv_cache, indptr, indices, last_page_len, *, page_size: int | None = None, engine: Engine | None = None,
           return_lse: bool = False, kv_layout: str = "NHD", **plan_options):
    """One-shot convenience for scripts: plan and run in one call (serving code should reuse a BatchDecode)."""
    k = kv_cache[0] if isinstance(kv_cache, (tuple, list)) else kv_cache[:, 0]
    if page_size is None:
        page_size = k.shape[1] if kv_layout.upper() == "NHD" else k.shape[2]
    num_kv_heads = k.shape[2] if kv_layout.upper() == "NHD" else k.shape[1]
    decoder = BatchDecode(engine, device=q.device)
    decoder.plan(indptr, indices, last_page_len, q.shape[1], num_kv_heads, q.shape[2], page_size,
                 q_dtype=normalize_dtype(q.dtype), kv_dtype=normalize_dtype(k.dtype, "kv_dtype"),
                 kv_layout=kv_layout, **plan_options)
    return decoder.run(q, kv_cache, return_lse=return_lse)
