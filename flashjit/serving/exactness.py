"""Exactness against the float32 reference, judged row by row.

A row is one (query token, query head) of a step: an output vector and its LSE. A kernel that
skips a 16-key chunk of a 5000-key request moves that request's rows by about sqrt(16 / 5000) of
their norm and nothing else, which one relative error over the whole batch dilutes below any
useful tolerance; judged per row it stands 4-6x above the rounding a correct kernel makes.

Tolerances come from the dtypes (tolerance()): a correct kernel rounds each output value once to
its 16-bit type (relative u_out, the unit roundoff) and, on tensor cores, each softmax weight to
the MMA's 16-bit type before P V (u_p: the cache's type, f16 for fp8 caches); everything else is
fp32 with approximate exp2 / log2 (relative 2^-22). A row's relative error is then at most about
u_out + sqrt(2) u_p even where two keys carry it; the bound allows 2 (u_out + u_p). The LSE is
an fp32 sum of unrounded weights, exact to ~1e-5; a variant whose logits hook uses the hardware's
tanh (relative 2^-11) moves every score by up to 2^-11 of its size and gets APPROX_LOGITS more.

Zero queries give every visible key the weight 1 (check_key_counts): the LSE is ln(number of keys
read), one key more or fewer moves it by 1/N, so the count is exact at any length the fp32 LSE
resolves (COUNT_SLACK keys, a 2^-20 relative error of the LSE at 64k keys).
"""

from __future__ import annotations

import dataclasses

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
FP8_MMA_DTYPE = "float16"  # fp8 caches convert to f16 for the tensor cores (decode_tc_fp8.cuh)
FLOAT32_FLOOR = 1e-5       # fp32 accumulation and the approximate exp2 / log2, relative
LSE_ATOL = 1e-3            # natural log; a dropped 16-key chunk of a 5000-key row moves it ~3e-3
APPROX_LOGITS = 4e-3       # tanh.approx's 2^-11 of a score (|s| <= 8), added to out and lse
COUNT_SLACK = 0.4          # keys: exp(lse) within this of the count; one key more or less is 1
SINK_COUNT_SLACK = 2.0 ** -16  # of e^sink, added to COUNT_SLACK: a sink's weight reaches the LSE through the
#                                kernel's exp2/log2 approximations (measured: 2.2e-6 of e^12.35), so above
#                                e^sink ~ 4e4 the count probe no longer resolves one key; check_rows still does


def _dtype_name(dtype) -> str:
    name = str(dtype).lower().removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16", "fp32": "float32",
               "f32": "float32", "float": "float32", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
    return aliases.get(name, name)


def unit_roundoff(dtype) -> float:
    """The largest relative rounding error of dtype (a torch dtype or its name): 2^-8 for bf16."""
    name = _dtype_name(dtype)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {sorted(UNIT_ROUNDOFF)} (an output or MMA type), got {dtype!r}")
    return UNIT_ROUNDOFF[name]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """out: a row's ||out - ref|| / ||ref||; lse: a row's |lse - ref_lse| (natural log)."""

    out: float
    lse: float


def tolerance(q_dtype, kv_dtype=None, *, out_dtype=None, mma_dtype=None, approx_logits: bool = False) -> Tolerance:
    """The per-row bounds of a kernel with queries (and output, unless out_dtype) of q_dtype over a
    kv_dtype cache (default: q_dtype), whose P V runs in mma_dtype (default: the cache's 16-bit type,
    f16 for an fp8 cache; MLA converts fp8 latents to the query's type). approx_logits: a variant's
    logits hook runs on the hardware's tanh."""
    kv = _dtype_name(kv_dtype if kv_dtype is not None else q_dtype)
    if mma_dtype is None:
        mma_dtype = FP8_MMA_DTYPE if kv.startswith("float8") else kv
    u_p = unit_roundoff(mma_dtype)
    u_out = unit_roundoff(out_dtype if out_dtype is not None else q_dtype)
    extra = APPROX_LOGITS if approx_logits else 0.0
    return Tolerance(out=2 * (u_out + u_p) + FLOAT32_FLOOR + extra, lse=LSE_ATOL + extra)


@dataclasses.dataclass(frozen=True)
class RowCheck:
    """What check_rows found: the worst row of each kind, as (token, head), and every failure."""

    tolerance: Tolerance
    worst_out: float
    worst_out_row: tuple[int, int] | None
    worst_lse: float
    worst_lse_row: tuple[int, int] | None
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return (f"worst row out {self.worst_out:.2e} (tol {self.tolerance.out:.1e}) at (token, head) "
                f"{self.worst_out_row}, lse {self.worst_lse:.2e} (tol {self.tolerance.lse:.1e}) at {self.worst_lse_row}")


def _row_of(flat_index: int, heads: int) -> tuple[int, int]:
    return divmod(int(flat_index), heads)


def _first_rows(mask, heads: int, limit: int = 3) -> str:
    import torch

    rows = torch.nonzero(mask.reshape(-1)).flatten()[:limit].tolist()
    return ", ".join(str(_row_of(i, heads)) for i in rows)


def row_errors(out, ref):
    """[tokens, heads] of ||out - ref|| / ||ref|| per row (rows whose reference is 0 give ||out||)."""
    diff = (out.float() - ref.float()).norm(dim=-1)
    scale = ref.float().norm(dim=-1)
    return diff / scale.where(scale > 0, scale.new_ones(()))


def check_rows(out, lse, ref, ref_lse, tol: Tolerance) -> RowCheck:
    """out [tokens, heads, dim] (and lse [tokens, heads], or None) against the reference, row by row.

    Fails: a NaN anywhere; a row whose relative error exceeds tol.out; a reference row of 0 (no key,
    or only a sink) whose output is not exactly 0; a row whose LSE is finite where the reference's
    is not, or the reverse; a finite LSE off by more than tol.lse."""
    heads = out.shape[1]
    failures = []
    nan_rows = out.isnan().any(-1)
    if nan_rows.any():
        failures.append(f"NaN in {int(nan_rows.sum())} output rows (never written?), first {_first_rows(nan_rows, heads)}")
    errors = row_errors(out, ref).nan_to_num(nan=float("inf"))
    zero_ref = ref.float().eq(0).all(-1)
    judged = ~zero_ref & ~nan_rows
    worst_out, worst_out_row = 0.0, None
    if judged.any():
        masked = errors.where(judged, errors.new_zeros(()))
        index = int(masked.reshape(-1).argmax())
        worst_out, worst_out_row = float(masked.reshape(-1)[index]), _row_of(index, heads)
        over = judged & (errors > tol.out)
        if over.any():
            failures.append(f"{int(over.sum())} rows off the reference by more than {tol.out:.1e} (relative), "
                            f"worst {worst_out:.2e} at (token, head) {worst_out_row}")
    not_zero = zero_ref & ~nan_rows & out.float().ne(0).any(-1)
    if not_zero.any():
        failures.append(f"{int(not_zero.sum())} rows that see no key are not 0, first {_first_rows(not_zero, heads)}")
    worst_lse, worst_lse_row = 0.0, None
    if lse is not None:
        lse = lse.float()
        if lse.isnan().any():
            failures.append(f"NaN in {int(lse.isnan().sum())} lse entries, first {_first_rows(lse.isnan(), heads)}")
        finite, ref_finite = lse.isfinite(), ref_lse.isfinite()
        disagree = (finite != ref_finite) & ~lse.isnan()
        if disagree.any():
            failures.append(f"{int(disagree.sum())} rows disagree with the reference on seeing any key (lse "
                            f"finite or not), first {_first_rows(disagree, heads)}")
        both = finite & ref_finite
        if both.any():
            diff = (lse - ref_lse.float()).abs().where(both, lse.new_zeros(()))
            index = int(diff.reshape(-1).argmax())
            worst_lse, worst_lse_row = float(diff.reshape(-1)[index]), _row_of(index, heads)
            if worst_lse > tol.lse:
                failures.append(f"{int((diff > tol.lse).sum())} lse entries off by more than {tol.lse:.1e}, worst "
                                f"{worst_lse:.2e} at (token, head) {worst_lse_row}")
    return RowCheck(tol, worst_out, worst_out_row, worst_lse, worst_lse_row, tuple(failures))


def key_counts(ref_lse, sink=None):
    """[tokens, heads] int64 number of visible keys from a zero-query reference LSE: ln of the count
    (plus e^sink, sink [heads] of a variant's sink logits)."""
    total = ref_lse.double().exp()
    if sink is not None:
        total = total - sink.double().exp()[None, :]
    return total.round().long()


def check_key_counts(lse, counts, sink=None) -> tuple[str, ...]:
    """A zero-query run's LSE against the number of keys each row sees (counts [tokens, heads]):
    exp(lse) must be the count (plus e^sink, sink [heads] of a variant's sink logits) within
    COUNT_SLACK keys (plus SINK_COUNT_SLACK of e^sink); rows without keys must be -inf (or the sink).
    Returns the failures."""
    import torch

    heads = lse.shape[1]
    expected = counts.double()
    if sink is not None:
        expected = expected + sink.double().exp()[None, :]
    got = lse.double().exp()
    failures = []
    if lse.isnan().any():
        failures.append(f"NaN in {int(lse.isnan().sum())} lse entries, first {_first_rows(lse.isnan(), heads)}")
    slack = COUNT_SLACK if sink is None else COUNT_SLACK + SINK_COUNT_SLACK * sink.double().exp()[None, :]
    off = ((got - expected).abs() > slack) & ~lse.isnan()
    if off.any():
        index = int(torch.nonzero(off.reshape(-1))[0])
        token, head = _row_of(index, heads)
        failures.append(f"{int(off.sum())} rows read another number of keys than they see, first (token, head) "
                        f"{(token, head)}: {float(got[token, head]):.3f} for {float(expected[token, head]):.3f}")
    return tuple(failures)


def assert_exact(out, lse, ref, ref_lse, tol: Tolerance, where: str = "") -> RowCheck:
    """check_rows, raising AssertionError with every failure and the worst rows."""
    result = check_rows(out, lse, ref, ref_lse, tol)
    if not result.passed:
        raise AssertionError("; ".join(result.failures) + f" [{result.summary()}]" + (f" ({where})" if where else ""))
    return result

