"""vLLM's attention-benchmark batch grammar, and the per-row output check of
benchmarks/serving_backends.py (CPU-testable: tests/benchmarks/test_serving_specs.py).

A spec is segments joined by "_", each `<count>?q<q_len>[k](s<seq_len>[k])?(p<shared>[k])?`:
count requests of q_len new tokens over seq_len keys (default seq_len = q_len: a prefill from
scratch), "k" multiplying by 1024. `p<shared>` is flashjit's extension: the segment's requests
share their first `shared` keys' blocks (n samples of one prompt, prefix-cached).

    8q1s1k            8 decodes over 1024 keys
    2q2k_32q1s1k      2 prefills of 2048 tokens and 32 decodes over 1024 keys
    16q1s9kp8k        16 samples of one 8192-token prompt, decoding at 9216 keys
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

SEGMENT = re.compile(r"^(\d+)?q(\d+)(k?)(?:s(\d+)(k?))?(?:p(\d+)(k?))?$")


@dataclasses.dataclass(frozen=True)
class Segment:
    count: int
    q_len: int
    seq_len: int
    shared: int = 0  # leading keys whose blocks every request of the segment shares


def _value(digits: str, k: str) -> int:
    return int(digits) * (1024 if k else 1)


def parse_spec(text: str) -> list[Segment]:
    """The segments of a spec; ValueError naming the bad segment and the grammar."""
    segments = []
    for part in text.strip().split("_"):
        m = SEGMENT.match(part)
        if not m:
            raise ValueError(f"batch spec {text!r}: segment {part!r} is not <count>?q<len>[k](s<len>[k])?(p<len>[k])?")
        count = int(m.group(1) or 1)
        q_len = _value(m.group(2), m.group(3))
        seq_len = _value(m.group(4), m.group(5)) if m.group(4) else q_len
        shared = _value(m.group(6), m.group(7)) if m.group(6) else 0
        if count < 1 or q_len < 1 or seq_len < q_len or shared > seq_len - q_len:
            raise ValueError(f"batch spec {text!r}: segment {part!r} needs count >= 1, 1 <= q_len <= seq_len and "
                             "shared keys before the new tokens (p <= s - q)")
        segments.append(Segment(count, q_len, seq_len, shared))
    return segments


@dataclasses.dataclass
class Requests:
    """One row per request, decode rows (q_len <= threshold) first, as vLLM reorders a batch."""

    seq_lens: list
    query_lens: list
    shared: list  # leading shared keys of each request
    group: list   # the segment each request came from (requests of a group share their blocks)


def requests_of(segments: list[Segment], decode_q_len: int) -> Requests:
    rows = [(s.q_len > decode_q_len, g, s) for g, s in enumerate(segments) for _ in range(s.count)]
    rows.sort(key=lambda row: row[0])  # stable: decodes first, segments in order
    return Requests([s.seq_len for _, _, s in rows], [s.q_len for _, _, s in rows], [s.shared for _, _, s in rows],
                    [g for _, g, _ in rows])


def block_table(requests: Requests, block_size: int, num_blocks: int, rng) -> np.ndarray:
    """[requests, blocks] int32 of shuffled blocks from 1 on (vLLM's block 0 is its null block);
    requests of one segment with shared keys list the same leading blocks."""
    pages = [-(-s // block_size) for s in requests.seq_lens]
    table = np.zeros((len(pages), max(pages) + 1), dtype=np.int32)
    pool = iter(rng.permutation(np.arange(1, num_blocks)))
    prompt_blocks: dict = {}
    for r, p in enumerate(pages):
        shared = requests.shared[r] // block_size
        if shared:
            first = prompt_blocks.setdefault(requests.group[r], [next(pool) for _ in range(shared)])
            table[r, :shared] = first
        table[r, shared:p] = [next(pool) for _ in range(p - shared)]
    return table


def slot_mapping(requests: Requests, table: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of every new token (block * block_size + offset), request after request."""
    slots = []
    for r, (s, q) in enumerate(zip(requests.seq_lens, requests.query_lens)):
        positions = np.arange(s - q, s)
        slots.append(table[r, positions // block_size].astype(np.int64) * block_size + positions % block_size)
    return np.concatenate(slots)


def row_errors(out, ref, query_start_loc, num_decode_tokens: int) -> list[tuple[int, str, float]]:
    """(request, "decode" or "prefill", relative error) of every request's rows of out against ref."""
    errors = []
    qsl = [int(x) for x in query_start_loc]
    for r in range(len(qsl) - 1):
        a, b = qsl[r], qsl[r + 1]
        diff = (out[a:b].float() - ref[a:b].float()).norm()
        error = float(diff / ref[a:b].float().norm().clamp_min(1e-6))
        errors.append((r, "prefill" if a >= num_decode_tokens else "decode", error))
    return errors


def check_rows(name: str, out, ref, query_start_loc, num_decode_tokens: int, tolerance: dict) -> float:
    """The largest row error, or AssertionError naming the implementation, the row and its error.
    tolerance: {"decode": ..., "prefill": ...}."""
    worst = 0.0
    for r, kind, error in row_errors(out, ref, query_start_loc, num_decode_tokens):
        if not error <= tolerance[kind]:
            raise AssertionError(f"{name}: request {r} ({kind} rows) has relative error {error:.3g} "
                                 f"(tolerance {tolerance[kind]:g})")
        worst = max(worst, error)
    return worst
