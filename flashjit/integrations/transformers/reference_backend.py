"""A decode backend with BatchDecode's plan()/run() over flashjit.serving.reference: the float32
torch oracle, on any device. The CPU tests run the adapter end to end with it; on a GPU it checks
the adapter's page tables apart from the kernels."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ...serving.reference import decode_reference


class ReferenceDecode:
    """plan() records the page table; run() computes decode_reference in float32, returned in q's dtype.

    With use_cuda_graph=True it mimics BatchDecode's GPU-planned mode for the adapter's CUDA-graph
    steps: graph_page_table and graph_page_ids are buffers of the sizes given, and replan() plans
    from whatever they hold (batch, indptr, last_page_len, qo_indptr, page ids)."""

    def __init__(self, device=None, *, use_cuda_graph: bool = False, max_batch_size: int | None = None,
                 max_num_pages: int | None = None, max_tokens: int | None = None, max_q_len: int | None = None):
        self.device = device
        self.plans = 0  # plans made, so tests can count them
        self._plan = None
        self.graph_page_table = self.graph_page_ids = None
        if use_cuda_graph:
            int32 = dict(dtype=torch.int32, device=device)
            self.graph_page_table = SimpleNamespace(
                batch=torch.zeros(1, **int32), indptr=torch.zeros(max_batch_size + 1, **int32),
                last_page_len=torch.zeros(max_batch_size, **int32), qo_indptr=torch.zeros(max_batch_size + 1, **int32))
            self.graph_page_ids = torch.zeros(max_num_pages, **int32)
            self.max_q_len, self.max_tokens = max_q_len, max_tokens

    def replan(self):
        """A plan from the graph buffers' contents (read on the host: this backend is never captured)."""
        t = self.graph_page_table
        b = int(t.batch[0])
        if self.max_q_len is not None and b and int((t.qo_indptr[1:b + 1] - t.qo_indptr[:b]).max()) > self.max_q_len:
            raise ValueError(f"replan(): a request has more than max_q_len={self.max_q_len} query tokens")
        p = self._plan
        p.update(indptr=t.indptr[:b + 1].clone(), indices=self.graph_page_ids.clone(),
                 last_page_len=t.last_page_len[:b].clone(), qo_indptr=t.qo_indptr[:b + 1].clone())

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, qo_indptr=None, mask: str = "none", window_left: int | None = None,
             sm_scale: float | None = None, logits_soft_cap: float | None = None, sinks=None, **_options):
        params = None if window_left is None else {"window_left": window_left}
        variant_params = {}
        if logits_soft_cap:
            variant_params["logits_soft_cap"] = logits_soft_cap
        if sinks is not None:
            variant_params["sinks"] = sinks
        variant = {(): "none", ("logits_soft_cap",): "soft_cap", ("sinks",): "sinks"}.get(
            tuple(variant_params), "soft_cap_sinks")
        self._plan = dict(indptr=indptr, indices=indices, last_page_len=last_page_len, qo_indptr=qo_indptr,
                          mask=mask, mask_params=params, sm_scale=sm_scale, page_size=page_size, variant=variant,
                          variant_params=variant_params)
        self.plans += 1
        return self

    def point_variant_at(self, name: str, tensor):
        """BatchDecode's: the plan's tensor variant parameter `name` is tensor from now on."""
        if name not in self._plan["variant_params"]:
            raise ValueError(f"name: expected a tensor parameter of the planned variant {self._plan['variant']!r}, "
                             f"got {name!r}")
        self._plan["variant_params"][name] = tensor

    def run(self, q, kv_cache, *, out=None):
        p = self._plan
        if p is None:
            raise RuntimeError("ReferenceDecode.run() called before plan()")
        k, v = kv_cache
        if k.shape[1] != p["page_size"]:
            raise ValueError(f"kv_cache: expected NHD pages of {p['page_size']} tokens, got shape {tuple(k.shape)}")
        result, _ = decode_reference(q, k, v, p["indptr"], p["indices"], p["last_page_len"],
                                     qo_indptr=p["qo_indptr"], mask=p["mask"], mask_params=p["mask_params"],
                                     sm_scale=p["sm_scale"], variant=p["variant"], variant_params=p["variant_params"])
        result = result.to(q.dtype)
        if self.graph_page_table is not None:  # rows past the plan's tokens are left alone, as BatchDecode does
            rows = int(p["qo_indptr"][-1])
            if out is None:
                out = q.new_zeros(q.shape)
            out[:rows].copy_(result[:rows])
            return out
        if out is None:
            return result
        out.copy_(result)
        return out
