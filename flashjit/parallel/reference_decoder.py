"""ReferenceDecoder: BatchDecode's plan()/run() surface computed by decode_reference, on any device.

The shard attention of context-parallel decode is injectable (a factory of decoders); this one
runs where BatchDecode cannot, the CPU (gloo tests, a host without a GPU), with the same
conventions: float32 math, natural-log lse, o = 0 and lse = -inf for rows without a visible key.
Under torch.compile its run() is torch.ops.flashjit.decode, as BatchDecode's is: a compiled model
step checks on the CPU what it will do with BatchDecode on the GPU.
"""

from __future__ import annotations

import math

from ..jit.dtypes import normalize_dtype
from ..serving.reference import decode_reference


class ReferenceDecoder:
    """plan(...) keeps the page table and mask; run(q, kv_cache, out=, lse=) fills out and lse."""

    def __init__(self, engine=None, device="cpu"):
        import torch

        from ..serving import torch_ops

        self.device = device
        self._plan = None
        self._form = None  # query_form() of the current plan
        self._compiling = torch.compiler.is_compiling
        self._op_handle = torch_ops.register(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, qo_indptr=None,
             mask="none", window_left=None, mask_params=None, sm_scale=None, kv_layout="NHD", q_dtype=None,
             **ignored):
        import torch

        params = dict(mask_params or {})
        if window_left is not None:
            params["window_left"] = window_left
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        self._plan = (indptr, indices, last_page_len, qo_indptr, mask, params, scale, kv_layout)
        if q_dtype is not None and not isinstance(q_dtype, torch.dtype):  # the reference takes float32 too
            q_dtype = getattr(torch, normalize_dtype(q_dtype))
        self._form = (q_dtype, num_qo_heads, head_dim, None)
        return self

    def query_form(self):
        """(q dtype or None for any, qo heads, head_dim, out dtype or None for q's) of the current
        plan; None before one."""
        return self._form

    def run(self, q, kv_cache, *, out=None, lse=None, return_lse=False, k_scale=None, v_scale=None):
        if self._compiling():
            from ..serving.torch_ops import decode as traced_decode

            return traced_decode(self._op_handle, q, kv_cache, out, lse, return_lse, k_scale, v_scale)
        indptr, indices, last, qo_indptr, mask, params, scale, layout = self._plan
        k, v = kv_cache if isinstance(kv_cache, (tuple, list)) else (kv_cache[:, 0], kv_cache[:, 1])
        k = k.float() * (1.0 if k_scale is None else float(k_scale))
        v = v.float() * (1.0 if v_scale is None else float(v_scale))
        ref, ref_lse = decode_reference(q, k, v, indptr, indices, last, qo_indptr=qo_indptr, mask=mask,
                                        mask_params=params, sm_scale=scale, kv_layout=layout)
        out = ref.to(q.dtype) if out is None else out.copy_(ref)
        if lse is not None:
            lse.copy_(ref_lse)
        elif return_lse:
            lse = ref_lse
        return (out, lse) if return_lse else out
