"""One paged batch through BatchDecode, compared with the torch reference row by row.

check_batch(engine, batch, mask, params) plans and runs BatchDecode on one paged batch under
every split policy (SPLITS), with outputs poisoned with NaN first, twice: with the batch's random
queries, and with zero queries. Each run is compared with
flashjit.serving.reference.decode_reference, which applies the mask's torch predicate, one row
(query token x query head) at a time (flashjit.serving.exactness: tolerances from the dtypes).
Zero queries give every visible key the same weight, so a row's LSE is ln(number of visible keys):
an exact count that a missed or an extra key fails, however long the row
(exactness.check_key_counts). A mask without a predicate (a template folder's mask) is compared
with its own unsplit run instead: that checks the span, the kv_position mapping and split/merge
consistency, not the predicate (the built-in "none" has no predicate and is judged by the
reference). With a variant, the reference applies its torch hooks too; a zero
query then gives each row the lse ln(N e^logits(0) + e^sink): still a count where the variant has
no logits hook (the sink is added), else compared with the reference's LSE.
"""

from __future__ import annotations

import dataclasses
import os

from ...masks.registry import masks
from ...masks.variants import variants
from ...serving import exactness

# planner's choice, no split, two chunks, 16-token chunks, fixed 48-token items (each read by its CTAs alone)
SPLITS = ("auto", "one", "two", "many", "fixed")
PROBES = ("random q", "zero q")


def has_reference(mask_def) -> bool:
    """Whether decode_reference judges the mask: it has a torch predicate, or it is a built-in
    without one ("none": every key visible). A template folder's mask has neither."""
    return mask_def.reference is not None or not os.path.isabs(mask_def.template)


def split_options(split: str, kv_lens) -> dict:
    """plan() keywords of a split policy."""
    return {"auto": {}, "one": {"disable_split_kv": True},
            "two": {"chunk_tokens": max(1, -(-max(kv_lens, default=1) // 2))},
            "many": {"chunk_tokens": 16}, "fixed": {"fixed_split_tokens": 48}}[split]


def quantized_cache(batch, kv_dtype: str | None):
    """(cache the kernel reads, (k_scale, v_scale), (k, v) the reference reads) of a batch: its own
    16-bit cache, or for an fp8 kv_dtype the cache quantized with one scale per tensor, which the
    reference reads dequantized in float32."""
    if kv_dtype is None or not str(kv_dtype).startswith(("float8", "e4m3", "e5m2")):
        return (batch.k_cache, batch.v_cache), (None, None), (batch.k_cache, batch.v_cache)
    from ...serving.quantize import dequantize_kv, quantize_kv

    (k8, k_scale), (v8, v_scale) = (quantize_kv(c, kv_dtype, kv_layout=batch.kv_layout)
                                    for c in (batch.k_cache, batch.v_cache))
    return ((k8, v8), (k_scale.item(), v_scale.item()),
            (dequantize_kv(k8, k_scale, kv_layout=batch.kv_layout), dequantize_kv(v8, v_scale, kv_layout=batch.kv_layout)))


def plan_and_run(engine, batch, mask: str, params: dict, split: str = "auto", *, q=None, tensor_cores=None,
                 variant: str = "none", variant_params: dict | None = None, kv_dtype: str | None = None,
                 cache=None):
    """BatchDecode on a flashjit.deploy.random_batches.PagedBatch; out and lse start as NaN. Returns
    (out, lse, decoder). kv_dtype, cache: an fp8 cache and its scales (quantized_cache) instead of the batch's."""
    import torch

    from ...serving.batch_decode import BatchDecode

    q = batch.q if q is None else q
    (k, v), (k_scale, v_scale), _ = cache or quantized_cache(batch, kv_dtype)
    num_kv_heads = batch.k_cache.shape[2 if batch.kv_layout == "NHD" else 1]
    decoder = BatchDecode(engine, device=q.device)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, q.shape[1], num_kv_heads, q.shape[2],
                 batch.page_size, qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, q_dtype=q.dtype,
                 kv_dtype=kv_dtype, kv_layout=batch.kv_layout, tensor_cores=tensor_cores,
                 **split_options(split, batch.kv_lens),
                 **({} if variant == "none" else {"variant": variant, "variant_params": variant_params}))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    decoder.run(q, (k, v), out=out, lse=lse, **({} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}))
    return out, lse, decoder


def compare(out, lse, ref, ref_lse, tolerance: exactness.Tolerance) -> tuple[float, float, list[str]]:
    """(worst row's relative error of out, worst row's lse error, failures) of one run against a
    reference (exactness.check_rows)."""
    result = exactness.check_rows(out, lse, ref, ref_lse, tolerance)
    return result.worst_out, result.worst_lse, list(result.failures)


def run_tolerance(q_dtype, kv_dtype=None, variant: str = "none") -> exactness.Tolerance:
    """exactness.tolerance of a decode run: the variant's logits hook, if any, runs on the hardware's tanh."""
    return exactness.tolerance(q_dtype, kv_dtype, approx_logits=variants.get(variant).logits is not None)


def count_failures(lse, ref_lse, variant: str = "none", variant_params: dict | None = None) -> list[str]:
    """A zero-query run's key counts (exactness.check_key_counts) against the reference's, for a
    variant without a logits hook (its sink, if any, added); [] for one with a logits hook, whose
    zero-query LSE is no count (check_rows compares it)."""
    variant_def = variants.get(variant)
    if variant_def.logits is not None:
        return []
    sink = None
    if variant_def.sink is not None:
        import torch

        sink = variant_def.sink(torch.arange(lse.shape[1], device=lse.device), dict(variant_params or {})).float()
    return list(exactness.check_key_counts(lse, exactness.key_counts(ref_lse, sink), sink=sink))


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One plan + run of a batch, compared with the reference."""

    spec: str       # the kernel that ran (DecodeSpec.name)
    split: str      # one of SPLITS
    probe: str      # one of PROBES
    rel_err: float  # the worst row's relative error of out
    lse_err: float  # the worst row's lse error
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures


def check_batch(engine, batch, mask: str, params: dict, *, splits=SPLITS, probes=PROBES,
                tensor_cores=None, variant: str = "none", variant_params: dict | None = None,
                kv_dtype: str | None = None) -> list[RunResult]:
    """Every split policy x probe of one batch against decode_reference (see the module docstring),
    under an attention variant (flashjit.masks.variants) when one is named, over the batch's cache
    quantized to kv_dtype when that is an fp8 type (the reference reads it dequantized)."""
    import torch

    from ...serving.reference import decode_reference
    from ...jit.dtypes import normalize_dtype

    judged = has_reference(masks.get(mask))
    cache = quantized_cache(batch, kv_dtype)
    k_ref, v_ref = cache[2]
    tolerance = run_tolerance(batch.q.dtype, kv_dtype or batch.k_cache.dtype, variant)
    order = sorted(splits, key=lambda s: s != "one")  # without a reference the unsplit run is the baseline
    results = []
    for probe in probes:
        q = batch.q if probe == "random q" else torch.zeros_like(batch.q)
        ref = ref_lse = None
        if judged:
            ref, ref_lse = decode_reference(q, k_ref, v_ref, batch.indptr, batch.indices,
                                            batch.last_page_len, qo_indptr=batch.qo_indptr, mask=mask,
                                            mask_params=params, kv_layout=batch.kv_layout, variant=variant,
                                            variant_params=variant_params)
        for split in order:
            out, lse, decoder = plan_and_run(engine, batch, mask, params, split, q=q, tensor_cores=tensor_cores,
                                             variant=variant, variant_params=variant_params, kv_dtype=kv_dtype,
                                             cache=cache)
            if ref is None:
                ref, ref_lse = out.float(), lse.clone()
            err, lse_err, failures = compare(out, lse, ref, ref_lse, tolerance)
            if probe == "zero q":
                failures += count_failures(lse, ref_lse, variant, variant_params)
            results.append(RunResult(decoder.spec.name, split, probe, err, lse_err, tuple(failures)))
    return results
