"""Block tables for the integration tests: each row's blocks shuffled from block 1 on (block 0, the
null block, is never used)."""

from __future__ import annotations

import numpy as np
import torch


def block_table_of(seq_lens, block_size, width, rng, shared=0, num_blocks=None) -> torch.Tensor:
    """[rows, width] int32 block ids, distinct and drawn from 1 to num_blocks - 1 (just enough for the
    table where None); the first `shared` blocks of every row are row 0's."""
    pages = [-(-n // block_size) for n in seq_lens]
    if num_blocks is None:
        num_blocks = 1 + sum(pages) + width * len(seq_lens)
    ids = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((len(seq_lens), width), dtype=np.int32)
    at = 0
    for r, p in enumerate(pages):
        own = 0 if r == 0 else min(shared, p)  # row 0's shared blocks are drawn once
        table[r, :own] = table[0, :own]
        table[r, own:p] = ids[at:at + p - own]
        at += p - own
    return torch.from_numpy(table)
