"""A decode backend with BatchDecode's plan()/run() over flashjit.serving.reference: the float32
torch oracle, on any device. The CPU tests run the adapter end to end with it; on a GPU it checks
the adapter's page tables apart from the kernels."""

from __future__ import annotations

from ...serving.reference import decode_reference


class ReferenceDecode:
    """plan() records the page table; run() computes decode_reference in float32, returned in q's dtype."""

    def __init__(self, device=None):
        self.device = device
        self.plans = 0  # plans made, so tests can count them
        self._plan = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, qo_indptr=None, mask: str = "none", window_left: int | None = None,
             sm_scale: float | None = None, **_options):
        params = None if window_left is None else {"window_left": window_left}
        self._plan = dict(indptr=indptr, indices=indices, last_page_len=last_page_len, qo_indptr=qo_indptr,
                          mask=mask, mask_params=params, sm_scale=sm_scale, page_size=page_size)
        self.plans += 1
        return self

    def run(self, q, kv_cache, *, out=None):
        p = self._plan
        if p is None:
            raise RuntimeError("ReferenceDecode.run() called before plan()")
        k, v = kv_cache
        if k.shape[1] != p["page_size"]:
            raise ValueError(f"kv_cache: expected NHD pages of {p['page_size']} tokens, got shape {tuple(k.shape)}")
        result, _ = decode_reference(q, k, v, p["indptr"], p["indices"], p["last_page_len"],
                                     qo_indptr=p["qo_indptr"], mask=p["mask"], mask_params=p["mask_params"],
                                     sm_scale=p["sm_scale"])
        result = result.to(q.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out
