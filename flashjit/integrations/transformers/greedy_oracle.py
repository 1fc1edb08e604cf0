"""A float32 teacher-forced check of greedy tokens, for the tests and the benchmark of attention
inside generation (tests/gpu/test_transformers_gpu.py, benchmarks/transformers_generate.py).

Comparing two fp16 implementations token for token fails on near-ties: where a random model's two
best logits differ by less than fp16 rounding, either implementation may pick either token, and
the sequences part there. Comparing nothing past a tie would let a wrong attention pass.

This check asks of every generated token, at every position, on the implementation's own sequence:
is it an argmax of the same model in float32, fed the same tokens (teacher forcing), within the
logit error fp16 itself makes there? The fp16 error is measured, not guessed: the plain fp16 forward
of the same sequence against the float32 one (max over the vocabulary, `noise`). A token passes
when its float32 logit is within NOISE_FACTOR x noise of the float32 maximum. A position is
decisive when the float32 margin between the two best logits exceeds that tolerance: there only
the float32 argmax passes, so a wrong attention (which moves logits by far more than rounding)
fails there. `check_sequences` reports how many positions were decisive, so a test can require
that the check decided something.

Mixture-of-experts models (gpt-oss) route each token to its top-k experts, a choice that jumps
where two router logits nearly tie: there another fp16 path may take the other expert and move the
logits by far more than the plain forward's rounding (moe_routing.py). A sequence that fails is
checked again under the routings flipped at the nearest such ties (each subset of up to
MAX_FLIPPED_TIES of them): it passes if, under one routing, every token passes. One routing for the
whole sequence, as generation computes each token's experts once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .moe_routing import flipped, near_ties, recorded_router_logits

NOISE_FACTOR = 4.0  # fp16 paths round differently (kernels, accumulation order): a few times one path's error
MAX_FLIPPED_TIES = 4  # routing ties tried flipped, nearest first: 2^4 - 1 more float32 forwards, on failure only


@dataclass
class SequenceCheck:
    """Per request: positions generated, decisive positions, and the positions whose token failed."""

    positions: int
    decisive: int
    failures: list  # (position, token, float32 logit of the token, float32 max, tolerance)
    flipped: tuple = ()  # the (router, token) routings flipped for the sequence to pass (moe_routing.py)


def teacher_forced_logits(model, tokens: list[int], keep: int | None = None) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of a plain forward (no paged cache) over `tokens`; with
    keep, those of the last `keep` positions only (the model computes no others: a long prompt's
    logits over a large vocabulary would not fit)."""
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        options = {} if keep is None else {"logits_to_keep": keep}
        return model(input_ids=ids, use_cache=False, **options).logits[0].float()


def check_sequence(model32, model16, prompt: list[int], generated: list[int],
                   noise_factor: float = NOISE_FACTOR) -> SequenceCheck:
    """Checks each generated token against model32's teacher-forced argmax (see the module doc)."""
    if not generated:
        return SequenceCheck(0, 0, [])
    sequence = list(prompt) + list(generated)
    keep = len(generated) + 1  # from the prompt's last position: logits at t predict token t + 1
    with recorded_router_logits(model32) as routing32:
        exact = teacher_forced_logits(model32, sequence, keep)[:-1]
    with recorded_router_logits(model16) as routing16:
        rounded = teacher_forced_logits(model16, sequence, keep)[:-1]
    tolerance = noise_factor * (rounded - exact).abs().amax(dim=-1)
    top2 = exact.topk(2, dim=-1).values
    decisive = int((top2[:, 0] - top2[:, 1] > tolerance).sum())
    chosen = torch.tensor(generated, device=exact.device)[:, None]
    failures = _failures(exact, chosen, tolerance)
    if failures and routing32:
        ties = near_ties(model32, routing32, routing16, noise_factor, MAX_FLIPPED_TIES)
        subsets = (s for n in range(1, len(ties) + 1) for s in itertools.combinations(ties, n))
        for subset in subsets:
            with flipped(model32, subset):
                if not _failures(teacher_forced_logits(model32, sequence, keep)[:-1], chosen, tolerance):
                    return SequenceCheck(len(generated), decisive, [], subset)
    return SequenceCheck(len(generated), decisive, failures)


def _failures(logits: torch.Tensor, chosen: torch.Tensor, tolerance: torch.Tensor) -> list:
    """(position, token, its logit, max, tolerance) of each chosen token below max - tolerance."""
    best = logits.amax(dim=-1)
    got = logits.gather(1, chosen)[:, 0]
    failed = (got < best - tolerance).nonzero()[:, 0].tolist()
    return [(t, int(chosen[t, 0]), float(got[t]), float(best[t]), float(tolerance[t])) for t in failed]


def check_sequences(model32, model16, outputs: dict, noise_factor: float = NOISE_FACTOR):
    """outputs: request id -> (prompt ids, generated tokens). Returns (decisive positions, positions,
    failures as "request: position, token, logit, max, tolerance" strings)."""
    decisive = positions = 0
    failures = []
    for request, (prompt, generated) in outputs.items():
        result = check_sequence(model32, model16, prompt, generated, noise_factor)
        decisive += result.decisive
        positions += result.positions
        failures += [f"{request}: position {t}, token {tok} at {got:.3f}, max {best:.3f}, tolerance {tol:.3f}"
                     for t, tok, got, best, tol in result.failures]
    return decisive, positions, failures
