"""The `causal` mask: query token i of a request's q_len sees the keys at positions <= kv_len - q_len + i."""

from __future__ import annotations

MASK = "causal"
PARAMS: dict = {}


def reference(q_pos, kv_pos, request, params):
    return kv_pos <= q_pos
