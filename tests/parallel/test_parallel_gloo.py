"""Context-parallel decode over gloo process groups of 2 and 4 CPU processes: each rank decodes its
shard (ReferenceDecoder), the states travel by all-gather or all-to-all, and every rank's merged
output equals the float32 reference decode of the whole cache (parallel_cases.gloo_worker)."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

import parallel_cases


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_merge_to_the_single_decode(world, tmp_path):
    mp.spawn(parallel_cases.gloo_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)
