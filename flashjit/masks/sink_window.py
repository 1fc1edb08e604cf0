"""The `sink_window` mask: StreamingLLM attention, sinks plus a sliding window.

Query token q_pos sees the first ``num_sink`` keys (the attention sinks) and the keys at most
``window_left`` back (q_pos - window_left <= kv_pos), causally. The keys between the sinks and the
window of the request's first query token are never read: the planner walks the sinks followed by
the window, and the kv_position hook maps span position v to key v (v < num_sink) or v + gap, where

    gap = max(first_q_pos - window_left - num_sink, 0) rounded down to a multiple of GAP_ALIGN,
    first_q_pos = kv_len - q_len

is the number of skipped keys. The rounding keeps a span position and its key equal modulo 16, so
the kernel's loader still copies whole runs of consecutive keys of one page; it reads at most 15
keys before the window, which the mask hides. The kv_position hook sees neither kv_len nor q_len,
so each request's first query position arrives as the ``first_q_pos`` int32 tensor parameter
(sink_window_params builds it); kv_span checks it against the plan.
"""

from __future__ import annotations

import numpy as np

from .. import validation

MASK = "sink_window"
PARAMS = {"num_sink": "int", "window_left": "int", "first_q_pos": "int_tensor"}
GAP_ALIGN = 16  # a multiple of the loader's run length (at most 16 keys); the template rounds the same way


def sink_window_params(kv_lens, q_lens=1, *, num_sink: int, window_left: int, device="cuda") -> dict:
    """mask_params for plan(mask="sink_window"): kv_lens and q_lens per request (q_lens may be one int)."""
    import torch

    validation.require_cuda(torch, torch.device(device), f"sink_window_params(device={device!r})",
                            "pass device='cpu' to build the parameters on the CPU")
    kv = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    q = np.broadcast_to(np.asarray(q_lens, dtype=np.int64), kv.shape)
    return {"num_sink": int(num_sink), "window_left": int(window_left),
            "first_q_pos": torch.tensor((kv - q).tolist() or [0], dtype=torch.int32, device=device)}


def gaps(first_q_pos, num_sink: int, window_left: int) -> np.ndarray:
    """Keys skipped between the sinks and the window, per request (what kv_position adds)."""
    gap = np.maximum(np.asarray(first_q_pos, dtype=np.int64) - int(window_left) - int(num_sink), 0)
    return gap - gap % GAP_ALIGN


def kv_positions(kv_len: int, q_len: int, num_sink: int, window_left: int) -> np.ndarray:
    """The keys the kernel reads for one request, in walk order (kv_span + kv_position on the host)."""
    gap = int(gaps(kv_len - q_len, num_sink, window_left))
    v = np.arange(kv_len - gap)
    return np.where(v < num_sink, v, v + gap)


def kv_span(kv_lens, q_lens, params):
    """[0, kv_len - gap): the sinks, then the window. Checks first_q_pos (one copy to the host)."""
    first = validation.host_int_array("mask param first_q_pos", params["first_q_pos"])
    expected = kv_lens - q_lens
    if len(first) < len(expected) or np.any(first[:len(expected)] != expected):
        validation.fail("mask param first_q_pos", "kv_len - q_len per request (flashjit.masks.sink_window.sink_window_params)",
                    f"{first[:8].tolist()} for kv_lens {kv_lens[:8].tolist()}, q_lens {q_lens[:8].tolist()}")
    return np.zeros_like(kv_lens), kv_lens - gaps(expected, params["num_sink"], params["window_left"])


def reference(q_pos, kv_pos, request, params):
    """Torch predicate: causal, and a sink or inside the window."""
    sink = kv_pos < int(params["num_sink"])
    return (kv_pos <= q_pos) & (sink | (q_pos - kv_pos <= int(params["window_left"])))


def sample_params(rng, kv_lens, q_lens, page_size, device):
    """Sinks that end inside a page, on a page boundary, or span pages; windows short and long."""
    num_sink = rng.choice([0, 1, 4, page_size, page_size + 3])
    window_left = rng.choice([0, 5, 37, 300])
    return sink_window_params(kv_lens, q_lens, num_sink=num_sink, window_left=window_left, device=device)
