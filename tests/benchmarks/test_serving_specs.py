"""benchmarks/serving_specs.py: vLLM's batch grammar (with flashjit's shared-prefix extension), the
batches it lays out and the per-row output check of benchmarks/serving_backends.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.serving_specs import (Segment, block_table, check_rows, parse_spec, requests_of, row_errors,
                                      slot_mapping)


@pytest.mark.parametrize("text, segments", [
    ("8q1s1k", [Segment(8, 1, 1024)]),
    ("64q1s4k", [Segment(64, 1, 4096)]),
    ("2q2k_32q1s1k", [Segment(2, 2048, 2048), Segment(32, 1, 1024)]),
    ("q2k", [Segment(1, 2048, 2048)]),
    ("16q1s9kp8k", [Segment(16, 1, 9216, 8192)]),
    ("4q4s1000", [Segment(4, 4, 1000)]),
])
def test_parse_spec(text, segments):
    assert parse_spec(text) == segments


@pytest.mark.parametrize("text", ["8x1s1k", "q0", "2q4s2", "q1s1kp2k", "8q1s1k_", "0q1s1k"])
def test_parse_spec_refuses_bad_segments(text):
    with pytest.raises(ValueError, match="batch spec"):
        parse_spec(text)


def test_requests_put_decode_rows_first_and_share_blocks_within_a_segment():
    requests = requests_of(parse_spec("2q2k_3q1s100p64_2q4s50"), decode_q_len=4)
    assert requests.query_lens == [1, 1, 1, 4, 4, 2048, 2048]
    assert requests.seq_lens == [100, 100, 100, 50, 50, 2048, 2048]
    table = block_table(requests, 16, 2000, np.random.default_rng(0))
    assert (table[:3, :4] == table[0, :4]).all() and len(set(table[:3, 4].tolist())) == 3  # 64 keys: 4 shared blocks
    used = np.concatenate([table[r, : -(-s // 16)] for r, s in enumerate(requests.seq_lens)])
    assert 0 not in used and len(set(used.tolist())) == len(used) - 2 * 4  # only the shared blocks repeat
    slots = slot_mapping(requests, table, 16)
    assert len(slots) == sum(requests.query_lens) and slots[0] == table[0, 99 // 16] * 16 + 99 % 16


def test_check_rows_names_the_row_off_the_reference():
    ref = torch.randn(6, 2, 8)
    out = ref.clone()
    out[4:6] += 0.5 * ref[4:6].norm() / 4  # the prefill request of rows 4..5
    qsl = [0, 1, 2, 4, 6]
    errors = row_errors(out, ref, qsl, num_decode_tokens=4)
    assert [kind for _, kind, _ in errors] == ["decode", "decode", "decode", "prefill"]
    assert errors[0][2] == 0 and errors[3][2] > 0.1
    assert check_rows("x", out, ref, qsl, 4, {"decode": 1e-2, "prefill": 1.0}) == errors[3][2]
    with pytest.raises(AssertionError, match="flashjit: request 3 \\(prefill rows\\)"):
        check_rows("flashjit", out, ref, qsl, 4, {"decode": 1e-2, "prefill": 1e-2})


def test_a_checked_replay_schedules_first_and_sees_a_replay_that_writes_nothing():
    from benchmarks.serving_backends import checked_replay

    ref, qsl = torch.randn(4, 2, 8), [0, 1, 2, 3, 4]
    check = lambda name, got, tol: check_rows(name, got, ref, qsl, 4, tol)  # noqa: E731
    tolerance = {"decode": 1e-2, "prefill": 1e-2}
    out, order = torch.zeros_like(ref), []

    class Graph:
        def __init__(self, writes: bool):
            self.writes = writes

        def replay(self):
            order.append("replay")
            if self.writes:
                out.copy_(ref)

    assert checked_replay("right", Graph(True), out, check, tolerance, before=lambda: order.append("schedule")) == 0
    assert order == ["schedule", "replay"]
    with pytest.raises(AssertionError, match="stale"):  # the previous replay's output is not taken for this one's
        checked_replay("stale", Graph(False), out, check, tolerance)
