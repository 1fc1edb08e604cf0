"""What a mask check found: compile rows, GPU cases, the host replay, and how the CLI prints them."""

from __future__ import annotations

import dataclasses

from .batch_check import PROBES, SPLITS, RunResult
from .cases import Case
from .host_replay import HostResult


@dataclasses.dataclass(frozen=True)
class CompileResult:
    spec: str
    arch: str
    result: str     # "compiled", "hit (disk)", "hit (memory)" or "FAIL"
    seconds: float
    error: str = ""


@dataclasses.dataclass(frozen=True)
class CaseResult:
    case: Case
    spec: str
    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    params: str
    runs: tuple[RunResult, ...]
    error: str = ""  # an exception that stopped the case

    @property
    def passed(self) -> bool:
        return not self.error and all(r.passed for r in self.runs)


@dataclasses.dataclass
class Report:
    mask: str
    compiled: list[CompileResult] = dataclasses.field(default_factory=list)
    cases: list[CaseResult] = dataclasses.field(default_factory=list)
    host: HostResult | None = None
    gpu: str | None = None  # the device the cases ran on; None: skipped
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (all(c.result != "FAIL" for c in self.compiled) and all(c.passed for c in self.cases)
                and (self.host is None or self.host.passed))

    def tables(self) -> list[tuple[str, tuple, list[tuple]]]:
        """(title, header, rows) for the CLI to print."""
        tables = []
        if self.compiled:
            tables.append((f"compile: mask {self.mask!r}", ("spec", "arch", "result", "seconds"),
                           [(c.spec, c.arch, c.result, f"{c.seconds:.2f}") for c in self.compiled]))
        if self.cases:
            rows = []
            for c in self.cases:
                passed = sum(r.passed for r in c.runs)
                rows.append((c.spec, f"{passed}/{len(c.runs)}",
                             f"{max((r.rel_err for r in c.runs), default=0.0):.1e}",
                             f"{max((r.lse_err for r in c.runs if r.probe == 'zero q'), default=0.0):.1e}",
                             "PASS" if c.passed else "FAIL"))
            tables.append((f"GPU check on {self.gpu}: {len(SPLITS)} split policies x {len(PROBES)} probes "
                           f"per kernel", ("kernel", "runs ok", "worst row err", "worst row zero-q lse err", "result"), rows))
        return tables

    def failures(self) -> list[str]:
        lines = [f"FAIL compile {c.spec}: {c.error}" for c in self.compiled if c.result == "FAIL"]
        lines += [f"FAIL host check: {f}" for f in (self.host.failures if self.host else ())]
        for c in self.cases:
            where = f"kv_lens={list(c.kv_lens)} q_lens={list(c.q_lens)} params: {c.params}"
            if c.error:
                lines.append(f"FAIL {c.spec}: {c.error} ({where})")
            for r in c.runs:
                if not r.passed:
                    lines.append(f"FAIL {r.spec} split={r.split} probe={r.probe}: {'; '.join(r.failures)} ({where})")
        return lines
