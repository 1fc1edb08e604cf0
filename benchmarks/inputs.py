"""A row's inputs on the GPU: the paged batch, its mask parameters, its fp8 cache, its float32 reference."""

from __future__ import annotations

import dataclasses

from benchmarks.cases import Case, kv_lengths


def build_inputs(torch, case: Case, seed: int = 0, device="cuda"):
    """The row's PagedBatch: random q and caches, pages shuffled over the pool, no spare pages."""
    from flashjit.deploy.random_batches import make_batch

    return make_batch(kv_lengths(case, seed), num_qo_heads=case.heads_qo, num_kv_heads=case.heads_kv,
                      head_dim=case.head_dim, page_size=case.page_size, seed=seed, spare_pages=0,
                      kv_layout=case.kv_layout, device=device)


def mask_of(case: Case, batch) -> tuple[str, dict]:
    """The case's mask and its plan parameters."""
    if case.sinks is not None:
        from flashjit import sink_window_params

        return "sink_window", sink_window_params(batch.kv_lens, 1, num_sink=case.sinks, window_left=case.window,
                                                 device=batch.q.device)
    if case.window:
        return "sliding_window", {"window_left": case.window}
    return "none", {}


def variant_of(case: Case, batch) -> dict:
    """The case's attention variant as plan() keywords (empty for none). The sinks are seeded values
    around the scores' scale, one per query head, so the sink weighs from little to most of a row."""
    if case.variant is None:
        return {}
    import torch

    params = {}
    if "soft_cap" in case.variant:
        params["logits_soft_cap"] = case.logits_soft_cap
    if "sinks" in case.variant:
        gen = torch.Generator().manual_seed(case.heads_qo)
        params["sinks"] = (torch.randn(case.heads_qo, generator=gen) * 2).to(batch.q.device)
    return {"variant": case.variant, "variant_params": params}


@dataclasses.dataclass
class Fp8Cache:
    cache: tuple        # (k, v) in fp8
    scales: tuple       # (k_scale, v_scale) floats
    dequantized: tuple  # (k, v) float32, for the reference


def quantize(batch, case: Case) -> Fp8Cache | None:
    from flashjit.serving.quantize import dequantize_kv, quantize_kv

    if case.kv_dtype is None:
        return None
    layout = case.kv_layout
    (k, k_scale), (v, v_scale) = (quantize_kv(c, case.kv_dtype, kv_layout=layout) for c in (batch.k_cache, batch.v_cache))
    return Fp8Cache((k, v), (k_scale.item(), v_scale.item()),
                    (dequantize_kv(k, k_scale, kv_layout=layout), dequantize_kv(v, v_scale, kv_layout=layout)))


def row_tolerance(case: Case):
    """The per-row bound of the row's outputs (benchmarks.measure.row_problem): bf16 rows with P
    rounded to bf16, and a soft cap's hardware tanh where the row has one."""
    from flashjit.serving.exactness import tolerance

    return tolerance("bfloat16", mma_dtype="bfloat16", approx_logits=bool(case.variant and "soft_cap" in case.variant))


def reference(batch, case: Case, fp8: Fp8Cache | None):
    """The float32 output every implementation is checked against."""
    from flashjit.serving.reference import decode_reference

    mask, params = mask_of(case, batch)
    k, v = fp8.dequantized if fp8 else (batch.k_cache, batch.v_cache)
    out, _ = decode_reference(batch.q, k, v, batch.indptr, batch.indices, batch.last_page_len, mask=mask,
                              mask_params=params, kv_layout=case.kv_layout, **variant_of(case, batch))
    return out
