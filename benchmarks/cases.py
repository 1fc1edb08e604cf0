"""The benchmark's rows (CASES) and the arithmetic of a row: its request lengths, the bytes it
attends, its bandwidth. Pure Python and CPU torch: nothing here needs a GPU."""

from __future__ import annotations

import dataclasses
import math
import re

HEADS_QO, HEADS_KV, PAGE = 32, 8, 16  # the default head configuration (Llama-3-8B) and page size


@dataclasses.dataclass(frozen=True)
class Spread:
    """count requests with lengths drawn from low..high, log-uniform (log=True) or uniform."""
    count: int
    low: int
    high: int
    log: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    kv_len: int | None = None   # every request's length; None: drawn from spreads
    spreads: tuple = ()         # Spread parts of a mixed batch, drawn in order from one seeded generator
    head_dim: int = 128
    heads_qo: int = HEADS_QO
    heads_kv: int = HEADS_KV
    page_size: int = PAGE
    window: int | None = None   # sliding window (window_left)
    sinks: int | None = None    # with window: StreamingLLM sink tokens (mask sink_window)
    kv_dtype: str | None = None  # fp8 cache ("float8_e4m3fn", "float8_e5m2"); None: bf16
    base: str | None = None     # the bf16 row of the same shape, for the fp8 speedup
    kv_layout: str = "NHD"
    quick: bool = False
    variant: str | None = None  # attention variant (soft_cap, sinks): flashjit.masks.variants; None: none
    logits_soft_cap: float = 50.0  # the soft_cap rows' cap (Gemma 2's)

    def __post_init__(self):
        if (self.kv_len is None) == (not self.spreads):
            raise ValueError(f"{self.name}: give kv_len or spreads, not both or neither")
        if self.spreads and sum(s.count for s in self.spreads) != self.batch:
            raise ValueError(f"{self.name}: the spreads hold {sum(s.count for s in self.spreads)} requests, "
                             f"not batch={self.batch}")

    @property
    def family(self) -> str:
        """What a row shares with the rows it can be plotted against: heads, head_dim, page, layout, dtype, mask."""
        mask = "none" if self.window is None else f"window {self.window}" + (f" sinks {self.sinks}" if self.sinks else "")
        return (f"{self.heads_qo}/{self.heads_kv} heads d{self.head_dim} p{self.page_size} {self.kv_layout} "
                f"{self.kv_dtype or 'bf16'} mask {mask}" + (f" variant {self.variant}" if self.variant else ""))


LOG_UNIFORM_64 = (Spread(64, 128, 32768, log=True),)
SKEWED_48 = (Spread(44, 128, 2048), Spread(4, 24576, 65536))  # long requests 12-512x the short ones
SKEWED_16 = (Spread(15, 256, 2048), Spread(1, 65536, 65536))  # one long-context user among short ones

CASES = [
    Case("b1 L2048", 1, 2048, quick=True),
    Case("b1 L8192", 1, 8192),
    Case("b1 L32768", 1, 32768),
    Case("b1 L131072", 1, 131072, quick=True),
    Case("b16 L512", 16, 512),
    Case("b16 L2048", 16, 2048),
    Case("b16 L8192", 16, 8192, quick=True),
    Case("b64 L2048", 64, 2048),
    Case("b64 L8192", 64, 8192, quick=True),
    Case("b256 L512", 256, 512),
    Case("b256 L2048", 256, 2048),
    Case("64 req log-uniform 128..32768", 64, spreads=LOG_UNIFORM_64, quick=True),
    Case("48 req skewed: 44 of 128..2048, 4 of 24k..64k", 48, spreads=SKEWED_48, quick=True),
    Case("16 req skewed: 15 of 256..2048, 1 of 64k", 16, spreads=SKEWED_16),
    Case("b16 L32768 window 4096", 16, 32768, window=4096, quick=True),
    Case("b16 L32768 sinks 4 + window 4096", 16, 32768, window=4096, sinks=4, quick=True),
    Case("b8 L16384 MHA 32/32", 8, 16384, heads_kv=32),
    Case("b8 L16384 MHA 32/32 e4m3", 8, 16384, heads_kv=32, kv_dtype="float8_e4m3fn", base="b8 L16384 MHA 32/32"),
    Case("b16 L8192 g8 32/4", 16, 8192, heads_kv=4),
    Case("b16 L8192 d64", 16, 8192, head_dim=64),
    Case("b16 L8192 d96", 16, 8192, head_dim=96),
    Case("b16 L8192 d96 e4m3", 16, 8192, head_dim=96, kv_dtype="float8_e4m3fn", base="b16 L8192 d96"),
    Case("b8 L8192 d96 MHA 32/32", 8, 8192, head_dim=96, heads_kv=32),  # Phi-3 mini's heads
    Case("b16 L8192 d256", 16, 8192, head_dim=256),
    Case("b16 L8192 p1", 16, 8192, page_size=1),
    Case("b16 L8192 p64", 16, 8192, page_size=64),
    Case("b16 L32768", 16, 32768, quick=True),  # the dense context of the window rows
    Case("b16 L8192 e4m3", 16, 8192, kv_dtype="float8_e4m3fn", base="b16 L8192", quick=True),
    Case("b16 L8192 HND", 16, 8192, kv_layout="HND"),
    Case("b16 L8192 e4m3 HND", 16, 8192, kv_dtype="float8_e4m3fn", base="b16 L8192 HND", kv_layout="HND"),
    Case("b16 L8192 e5m2", 16, 8192, kv_dtype="float8_e5m2", base="b16 L8192"),
    Case("b64 L8192 e4m3", 64, 8192, kv_dtype="float8_e4m3fn", base="b64 L8192", quick=True),
    # gpt-oss decode (64 query / 8 KV heads, head_dim 64): learned sinks on 128-token windows
    # (window_left 127) and on full layers, each beside the same shape without sinks (within 2%)
    *(Case(f"gpt-oss b{b} L8192 window 128{' sinks' if v else ''}", b, 8192, head_dim=64, heads_qo=64, window=127,
           variant=v) for b in (16, 32, 64) for v in (None, "sinks")),
    *(Case(f"gpt-oss b{b} L8192{' sinks' if v else ''}", b, 8192, head_dim=64, heads_qo=64, variant=v)
      for b in (16, 32, 64) for v in (None, "sinks")),
    # Gemma 2 9B decode (16 / 8 heads, head_dim 256): soft-capped logits beside none (within 5%)
    Case("gemma-2 b16 L8192 d256 16/8", 16, 8192, head_dim=256, heads_qo=16),
    Case("gemma-2 b16 L8192 d256 16/8 soft_cap", 16, 8192, head_dim=256, heads_qo=16, variant="soft_cap"),
    Case("b16 L8192 d128 soft_cap", 16, 8192, variant="soft_cap"),  # beside "b16 L8192"
    # head_dim 512 (tensor cores only): against its read floor (>= 95%)
    Case("b16 L8192 d512", 16, 8192, head_dim=512),
    Case("b16 L8192 d512 e4m3", 16, 8192, head_dim=512, kv_dtype="float8_e4m3fn", base="b16 L8192 d512"),
]

BASE_FAMILY = Case("base", 1, 1).family  # the default shape: the rows a plot puts side by side


def select_cases(cases, quick: bool = False, only: str = "") -> list[Case]:
    """The rows a run times: the quick ones with quick, those whose name matches the regular expression only."""
    pattern = re.compile(only)
    return [c for c in cases if (c.quick or not quick) and pattern.search(c.name)]


def kv_lengths(case: Case, seed: int = 0) -> list[int]:
    """Each request's length. A mixed batch draws its spreads in order from one torch generator
    (the same lengths on every machine), then shuffles them when it has several, as a server's batch
    has no order."""
    if case.kv_len is not None:
        return [case.kv_len] * case.batch
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = []
    for s in case.spreads:
        if s.log:
            draw = torch.exp(torch.empty(s.count).uniform_(math.log(s.low), math.log(s.high), generator=gen)).long()
        else:
            draw = torch.randint(s.low, s.high + 1, (s.count,), generator=gen)
        lengths += draw.tolist()
    if len(case.spreads) > 1:
        lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]
    return lengths


def attended_tokens(case: Case, kv_lens) -> int:
    """The K/V tokens the mask lets the batch read: a window counts only the window (and its sinks)."""
    if case.window is None:
        return sum(kv_lens)
    return sum(min(n, (case.sinks or 0) + case.window + 1) for n in kv_lens)


def attended_bytes(case: Case, kv_lens) -> int:
    """The bytes a step must move: the K/V attended, plus q and out (bf16, one query token per request)."""
    kv = 2 * attended_tokens(case, kv_lens) * case.heads_kv * case.head_dim * (1 if case.kv_dtype else 2)
    return kv + 2 * len(kv_lens) * case.heads_qo * case.head_dim * 2


def gb_per_s(nbytes: int, us: float | None) -> float | None:
    return nbytes / us / 1e3 if us else None
