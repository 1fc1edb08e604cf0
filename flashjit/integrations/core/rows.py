"""Which rows of a step flashjit's decode kernels serve, and which go to a prefill kernel.

A framework that reorders its batch (vLLM's reorder_batch_threshold) puts the requests with few
query tokens first: decodes (one token) and speculative verification (1 + k tokens), then longer
prefill chunks. The decode kernels take up to max_decode_q_len query tokens a request (at most
16); the leading run of such rows is theirs, everything from the first longer row on is prefill.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...kernels.decode.spec import MAX_Q_LEN
from ... import validation


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """The step's rows [0, num_decodes) for the decode kernels, [num_decodes, num_reqs) for prefill."""

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    max_decode_q_len: int  # the largest query count among the decode rows (1 when there are none)

    @property
    def num_reqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def pure_decode(self) -> bool:
        return self.num_prefills == 0


def check_decode_q_len(max_decode_q_len: int) -> int:
    """The decode rows' query-token limit, checked against what the kernels take (1..16)."""
    n = max_decode_q_len
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_Q_LEN:
        validation.fail("max_decode_q_len", f"an int in 1..{MAX_Q_LEN} (query tokens the decode kernels take)",
                        max_decode_q_len)
    return max_decode_q_len


def split_rows(query_start_loc_cpu, num_reqs: int, max_decode_q_len: int) -> RowSplit:
    """The split of a step whose query offsets ([num_reqs + 1], on the host) are given.

    Rows without query tokens (a graph's padding requests) count as decodes while no prefill row
    came before them."""
    check_decode_q_len(max_decode_q_len)
    offsets = validation.indptr_array("query_start_loc_cpu", query_start_loc_cpu[: num_reqs + 1], length=num_reqs + 1)
    q_lens = offsets[1:] - offsets[:-1]
    longer = np.flatnonzero(q_lens > max_decode_q_len)
    num_decodes = int(longer[0]) if longer.size else num_reqs
    decode_tokens = int(offsets[num_decodes])
    largest = int(q_lens[:num_decodes].max(initial=1))
    return RowSplit(num_decodes, decode_tokens, num_reqs - num_decodes, int(offsets[num_reqs]) - decode_tokens,
                    max(1, largest))
