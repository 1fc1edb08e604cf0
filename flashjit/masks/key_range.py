"""The `key_range` mask: each query token sees one range of the request's keys, given per token.

Query token t of the batch (token q_idx of request r, t = range_qo_indptr[r] + q_idx) sees the keys
range_begin[t] <= kv_pos < range_end[t]. Any mask whose visible keys form one interval per query
token can be computed on the host and served this way; context-parallel decode
(flashjit.parallel) does so for causal and sliding-window masks over a shard, whose local keys
stand for global positions further on. The planner walks [min range_begin, max range_end) of each
request's tokens (kv_span), so keys before and after every range are never read.

Parameters: range_qo_indptr (int32 [batch + 1], each request's first query token, the plan's
qo_indptr), range_begin and range_end (int32 [tokens]). key_range_params builds them.
"""

from __future__ import annotations

import numpy as np

from .. import validation

MASK = "key_range"
PARAMS = {"range_qo_indptr": "int_tensor", "range_begin": "int_tensor", "range_end": "int_tensor"}


def key_range_params(qo_indptr, begin, end, *, device="cuda") -> dict:
    """mask_params for plan(mask="key_range"): qo_indptr [batch + 1], begin and end [tokens] (host arrays)."""
    import torch

    as_tensor = lambda values: torch.tensor(np.asarray(values, dtype=np.int64).tolist() or [0],  # noqa: E731
                                            dtype=torch.int32, device=device)
    return {"range_qo_indptr": as_tensor(qo_indptr), "range_begin": as_tensor(begin), "range_end": as_tensor(end)}


def kv_span(kv_lens, q_lens, params):
    """Each request's union of its tokens' ranges, clipped to [0, kv_len). Checks the parameters
    against the plan (one copy of each to the host)."""
    qo = validation.host_int_array("mask param range_qo_indptr", params["range_qo_indptr"])
    begin = validation.host_int_array("mask param range_begin", params["range_begin"])
    end = validation.host_int_array("mask param range_end", params["range_end"])
    batch, tokens = len(kv_lens), int(np.sum(q_lens))
    if len(qo) < batch + 1 or qo[0] != 0 or np.any(np.diff(qo[:batch + 1]) != q_lens):
        validation.fail("mask param range_qo_indptr", f"the plan's qo_indptr ({batch + 1} offsets starting at 0)",
                        qo[:8].tolist())
    if len(begin) < tokens or len(end) < tokens:
        validation.fail("mask params range_begin, range_end", f"{tokens} values each (one per query token)",
                        f"{len(begin)} and {len(end)}")
    span_begin, span_end = np.zeros_like(kv_lens), np.zeros_like(kv_lens)
    for r in range(batch):
        lo, hi = int(qo[r]), int(qo[r + 1])
        if hi == lo:
            continue
        b = np.clip(begin[lo:hi], 0, kv_lens[r])
        e = np.clip(end[lo:hi], 0, kv_lens[r])
        live = e > b
        if live.any():
            span_begin[r], span_end[r] = b[live].min(), e[live].max()
    return span_begin, span_end


def reference(q_pos, kv_pos, request, params):
    """Torch predicate: begin[t] <= kv_pos < end[t] for the request's tokens t."""
    import torch

    q_idx = (q_pos - q_pos[:1]).long()  # q_pos is the request's column kv_len - q_len + i
    first = int(params["range_qo_indptr"][request])
    tokens = (first + q_idx).to(params["range_begin"].device)
    begin = params["range_begin"][tokens].long().to(kv_pos.device)
    end = params["range_end"][tokens].long().to(kv_pos.device)
    return (kv_pos >= begin) & (kv_pos < end) & torch.ones_like(kv_pos, dtype=torch.bool)


def sample_params(rng, kv_lens, q_lens, page_size, device):
    """Ranges empty, whole, inside a page, across pages, and past the end."""
    qo, begin, end = [0], [], []
    for kv_len, q_len in zip(kv_lens, q_lens):
        for _ in range(q_len):
            kind = rng.choice(["whole", "inside", "across", "empty", "past"])
            if kind == "whole" or kv_len == 0:
                b, e = 0, kv_len
            elif kind == "inside":
                b = rng.randrange(kv_len)
                e = min(kv_len, b + rng.randint(1, max(1, page_size // 2)))
            elif kind == "across":
                b = rng.randrange(kv_len)
                e = rng.randint(b, kv_len)
            elif kind == "empty":
                b = e = rng.randrange(kv_len + 1)
            else:
                b, e = rng.randrange(kv_len), kv_len + page_size
            begin.append(b)
            end.append(e)
        qo.append(qo[-1] + q_len)
    return key_range_params(qo, begin, end, device=device)
