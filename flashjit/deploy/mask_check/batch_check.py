"""One paged batch through BatchDecode, compared with the torch reference.

check_batch(engine, batch, mask, params) plans and runs BatchDecode on one paged batch under
every split policy (SPLITS), with outputs poisoned with NaN first, twice: with the batch's random
queries, and with zero queries. Zero queries give every visible key the same weight, so a row's
LSE is ln(number of visible keys): an exact count that a missed or an extra key fails
(COUNT_LSE_ATOL), however long the row. Each run is compared with
flashjit.serving.reference.decode_reference, which applies the mask's torch predicate. A mask
without a predicate (a template folder's mask) is compared with its own unsplit run instead: that
checks the span, the kv_position mapping and split/merge consistency, not the predicate.
With a variant, the reference applies its torch hooks too; a zero query then gives each row the
lse ln(N e^logits(0) + e^sink), as exact a count as without one.
"""

from __future__ import annotations

import dataclasses

from ...masks.registry import masks

SPLITS = ("auto", "one", "two", "many")  # planner's choice, no split, two chunks, 16-token chunks
PROBES = ("random q", "zero q")
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}  # relative (Frobenius) error of out
LSE_ATOL, LSE_RTOL = 2e-2, 1e-3
COUNT_LSE_ATOL = 5e-5  # zero q: ln(N + 1) - ln(N) > 1.9e-4 for the N <= 5000 keys of random_lengths


def split_options(split: str, kv_lens) -> dict:
    """plan() keywords of a split policy."""
    return {"auto": {}, "one": {"disable_split_kv": True},
            "two": {"chunk_tokens": max(1, -(-max(kv_lens, default=1) // 2))},
            "many": {"chunk_tokens": 16}}[split]


def plan_and_run(engine, batch, mask: str, params: dict, split: str = "auto", *, q=None, tensor_cores=None,
                 variant: str = "none", variant_params: dict | None = None):
    """BatchDecode on a flashjit.deploy.random_batches.PagedBatch; out and lse start as NaN. Returns (out, lse, decoder)."""
    import torch

    from ...serving.batch_decode import BatchDecode

    q = batch.q if q is None else q
    num_kv_heads = batch.k_cache.shape[2 if batch.kv_layout == "NHD" else 1]
    decoder = BatchDecode(engine, device=q.device)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, q.shape[1], num_kv_heads, q.shape[2],
                 batch.page_size, qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, q_dtype=q.dtype,
                 kv_layout=batch.kv_layout, tensor_cores=tensor_cores, **split_options(split, batch.kv_lens),
                 **({} if variant == "none" else {"variant": variant, "variant_params": variant_params}))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    decoder.run(q, (batch.k_cache, batch.v_cache), out=out, lse=lse)
    return out, lse, decoder


def compare(out, lse, ref, ref_lse, *, tolerance: float, lse_atol: float = LSE_ATOL,
            lse_rtol: float = LSE_RTOL) -> tuple[float, float, list[str]]:
    """(relative error of out, max lse error, failures) of one run against a reference."""
    from ..random_batches import rel_error

    failures = []
    nan_rows = int(out.isnan().any(-1).sum())
    if nan_rows:
        failures.append(f"NaN in {nan_rows} output rows (never written?)")
    if lse.isnan().any():
        failures.append(f"NaN in {int(lse.isnan().sum())} lse entries")
    err = rel_error(out, ref)
    if not err <= tolerance:
        failures.append(f"out: relative error {err:.2e} > {tolerance:.0e}")
    finite = ref_lse.isfinite()
    disagree = lse.isfinite() != finite
    if disagree.any():
        failures.append(f"{int(disagree.sum())} (token, head) rows disagree with the reference on being fully masked")
    both = finite & lse.isfinite()
    diff = (lse[both] - ref_lse[both]).abs()
    lse_err = float(diff.max()) if diff.numel() else 0.0
    if diff.numel() and (diff > lse_atol + lse_rtol * ref_lse[both].abs()).any():
        failures.append(f"lse: max error {lse_err:.2e} (atol {lse_atol:.0e})")
    if (~finite).any() and not (out[~finite] == 0).all():
        failures.append("fully masked rows are not 0")
    return err, lse_err, failures


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One plan + run of a batch, compared with the reference."""

    spec: str       # the kernel that ran (DecodeSpec.name)
    split: str      # one of SPLITS
    probe: str      # one of PROBES
    rel_err: float
    lse_err: float
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures


def check_batch(engine, batch, mask: str, params: dict, *, splits=SPLITS, probes=PROBES,
                tensor_cores=None, variant: str = "none", variant_params: dict | None = None) -> list[RunResult]:
    """Every split policy x probe of one batch against decode_reference (see the module docstring),
    under an attention variant (flashjit.masks.variants) when one is named."""
    import torch

    from ...serving.reference import decode_reference
    from ...jit.dtypes import normalize_dtype

    has_reference = masks.get(mask).reference is not None
    tolerance = TOLERANCE[normalize_dtype(batch.q.dtype)]
    order = sorted(splits, key=lambda s: s != "one")  # without a reference the unsplit run is the baseline
    results = []
    for probe in probes:
        q = batch.q if probe == "random q" else torch.zeros_like(batch.q)
        ref = ref_lse = None
        if has_reference:
            ref, ref_lse = decode_reference(q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                            batch.last_page_len, qo_indptr=batch.qo_indptr, mask=mask,
                                            mask_params=params, kv_layout=batch.kv_layout, variant=variant,
                                            variant_params=variant_params)
        for split in order:
            out, lse, decoder = plan_and_run(engine, batch, mask, params, split, q=q, tensor_cores=tensor_cores,
                                             variant=variant, variant_params=variant_params)
            if ref is None:
                ref, ref_lse = out.float(), lse.clone()
            err, lse_err, failures = compare(out, lse, ref, ref_lse, tolerance=tolerance,
                                             **({"lse_atol": COUNT_LSE_ATOL, "lse_rtol": 0.0}
                                                if probe == "zero q" else {}))
            results.append(RunResult(decoder.spec.name, split, probe, err, lse_err, tuple(failures)))
    return results
