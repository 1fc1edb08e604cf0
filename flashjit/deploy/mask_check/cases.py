"""The random cases a mask check draws: kernel shapes, request lengths, and the compile-only spec."""

from __future__ import annotations

import dataclasses
import itertools
import random

from ...errors import SpecError
from ...kernels.decode.spec import DecodeSpec

GROUPS = (1, 4, 7)
Q_LENS = (1, 4)
PAGE_SIZES = (1, 16, 64)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
NUM_KV_HEADS = 2
# A variant's cases cycle through every built-in mask (tests/deploy holds the list to the registry).
VARIANT_MASKS = ("none", "causal", "sliding_window", "sink_window", "tree", "block_sparse", "key_range")
CPU_SPEC = dict(head_dim=128, dtype="bfloat16", page_size=16, group_size=4, max_q_len=4)  # compile-only check


def random_lengths(rng: random.Random, page_size: int) -> list[int]:
    """Zero, one, page multiples and not, and a long request beside short ones."""
    lengths = [0, 1, page_size, 3 * page_size + 1, rng.randint(2, 300), rng.randint(1500, 5000)]
    rng.shuffle(lengths)
    return lengths


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    group: int
    q_len: int
    page_size: int
    tensor_cores: bool
    seed: int

    def spec(self, mask: str, arch: str, variant: str = "none") -> DecodeSpec:
        """The DecodeSpec plan() builds for this case (q_len = the longest request's query count)."""
        return DecodeSpec(self.head_dim, dtype=self.dtype, mask=mask, page_size=self.page_size,
                          group_size=self.group, max_q_len=self.q_len, arch=arch, tensor_cores=self.tensor_cores,
                          variant=variant)


def random_cases(seed: int = 0, *, groups=GROUPS, q_lens=Q_LENS, page_sizes=PAGE_SIZES) -> list[Case]:
    """Every group x query length x page size, each with a random head_dim and dtype, on both kernels."""
    rng = random.Random(seed)
    cases = []
    for group, q_len, page_size in itertools.product(groups, q_lens, page_sizes):
        head_dim, dtype = rng.choice(HEAD_DIMS), rng.choice(DTYPES)
        for tensor_cores in (False, True):
            case = Case(dtype, head_dim, group, q_len, page_size, tensor_cores, rng.randrange(1 << 30))
            try:
                case.spec("none", "sm_90")
            except SpecError:  # e.g. no tensor-core kernel for this head_dim
                continue
            cases.append(case)
    return cases
