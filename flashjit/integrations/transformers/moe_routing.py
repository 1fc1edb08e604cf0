"""Top-k expert routing near ties, for the greedy oracle (greedy_oracle.py).

A mixture-of-experts router picks each token's k experts by its k largest logits. Where the k-th
and (k+1)-th logits are closer than rounding moves them, two fp16 forwards of the same tokens may
pick different experts, and every logit downstream then moves by a share of a whole expert's output
(tenths, on the tests' random models): a jump no measure of one fp16 forward's rounding error
bounds. The oracle therefore also accepts a sequence that is the float32 argmax under a routing
flipped at such ties (flipped()), choosing among the ties that near_ties() finds.

The routers read are gpt-oss's (transformers' GptOssTopKRouter: forward(hidden) returns the router
logits, the top-k weights and the top-k expert indices); other models have none here.
"""

from __future__ import annotations

import contextlib

import torch


def routers(model) -> list:
    """The model's top-k routers this module reads, in module order (empty for a dense model)."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, GptOssTopKRouter)]


@contextlib.contextmanager
def recorded_router_logits(model):
    """Yields a list that receives, per router of routers(model), the float32 router logits
    [tokens, experts] of the last forward run inside the block."""
    found = routers(model)
    logits = [None] * len(found)

    def record(i):
        def hook(module, args, output):
            logits[i] = output[0].detach().reshape(-1, output[0].shape[-1]).float()
        return hook

    handles = [router.register_forward_hook(record(i)) for i, router in enumerate(found)]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


def near_ties(model, logits32: list, logits16: list, noise_factor: float, limit: int) -> list[tuple[int, int]]:
    """(router, token) pairs of routers(model) whose float32 gap between the k-th and next expert
    logit is at most noise_factor x the largest fp16 - float32 difference of that token's router
    logits (recorded_router_logits of a float32 and an fp16 forward of the same tokens): the routings
    rounding can flip. The `limit` nearest (by gap over noise), nearest first."""
    ties = []
    for r, (router, exact, rounded) in enumerate(zip(routers(model), logits32, logits16)):
        top_k = router.top_k
        if exact is None or rounded is None or exact.shape[-1] <= top_k:
            continue
        values = exact.topk(top_k + 1, dim=-1).values
        gap = values[:, top_k - 1] - values[:, top_k]
        noise = (rounded - exact).abs().amax(dim=-1)
        for t in (gap <= noise_factor * noise).nonzero()[:, 0].tolist():
            ties.append((float(gap[t] / noise[t]) if noise[t] > 0 else 0.0, r, t))  # 0 / 0: an exact tie
    return [(r, t) for _, r, t in sorted(ties)[:limit]]


@contextlib.contextmanager
def flipped(model, ties):
    """Within the block, router r of routers(model) routes each token t of the (r, t) pairs in
    `ties` to its (k+1)-th expert in place of its k-th, weighting the new top k as the router does
    (a softmax over their logits, in the logits' dtype)."""
    found = routers(model)
    tokens: dict = {}
    for r, t in ties:
        tokens.setdefault(r, []).append(t)

    def flip(rows):
        def hook(module, args, output):
            logits, scores, indices = output  # [tokens, experts], [tokens, k], [tokens, k]
            k = indices.shape[-1]
            values, experts = logits.topk(k + 1, dim=-1)
            at = torch.tensor(rows, device=logits.device)
            chosen = torch.cat((values[at, :k - 1], values[at, k:]), dim=-1)
            scores, indices = scores.clone(), indices.clone()
            scores[at] = torch.softmax(chosen, dim=-1, dtype=chosen.dtype).to(scores.dtype)
            indices[at, k - 1] = experts[at, k].to(indices.dtype)
            return logits, scores, indices
        return hook

    handles = [found[r].register_forward_hook(flip(rows)) for r, rows in tokens.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
