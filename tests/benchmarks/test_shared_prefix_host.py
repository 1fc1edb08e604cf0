"""benchmarks/shared_prefix_host.py runs on the CPU: it builds the C host planner and times both patterns."""

from __future__ import annotations

import re

import pytest

from benchmarks import shared_prefix_host
from flashjit.jit.host_library import compiler


@pytest.mark.skipif(compiler() is None, reason="no host C compiler")
def test_both_patterns_are_timed(capsys):
    shared_prefix_host.main(["--calls", "3"])
    lines = capsys.readouterr().out.splitlines()
    timed = [re.fullmatch(r"shared-prefix detection, 256 requests, (.+): ([0-9.]+) us", line) for line in lines]
    assert [match.group(1) for match in timed if match] == ["none shared", "16 prompts x 16 samples"]
    assert all(float(match.group(2)) > 0 for match in timed)
