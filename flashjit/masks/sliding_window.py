"""The `sliding_window` mask: causal, and a query at position q_pos sees the keys from
q_pos - window_left on (window_left + 1 keys at most). The planner reads only each request's window
(kv_span), on the host or, in CUDA-graph mode, on the GPU (DEVICE_SPAN: the template's span_begin hook)."""

from __future__ import annotations

MASK = "sliding_window"
PARAMS = {"window_left": "int"}
DEVICE_SPAN = True


def kv_span(kv_lens, q_lens, params):
    import numpy as np

    begin = np.maximum(kv_lens - q_lens - int(params["window_left"]), 0)
    return begin, kv_lens


def reference(q_pos, kv_pos, request, params):
    return (kv_pos <= q_pos) & (kv_pos >= q_pos - int(params["window_left"]))


def sample_params(rng, kv_lens, q_lens, page_size, device):
    return {"window_left": rng.choice([0, 37, 300])}
