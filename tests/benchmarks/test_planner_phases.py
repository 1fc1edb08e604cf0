"""benchmarks/planner_phases.py without a GPU: its step arithmetic, and the stamps it reads are
compiled into the planner only when it asks for them."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.planner_phases import STAMPS, STEPS, main, step_cycles
from flashjit import DecodeSpec, Engine
from flashjit.jit.compile import compile_options


def test_step_cycles_are_the_median_gaps_between_stamps():
    rounds = [[100, 150, 190, 400, 460, 700, 710], [0, 60, 100, 300, 370, 600, 630],
              [50, 90, 130, 350, 400, 630, 650]]
    assert step_cycles(np, rounds).tolist() == [50, 40, 210, 60, 230, 20]
    assert len(STEPS) == STAMPS - 1


def ptx(source: str, *options: str) -> str:
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(source, "plan.cu", [], [])
    nvrtc.compileProgram(program, list(compile_options("sm_90")) + list(options))
    return nvrtc.getPTX(program).decode()


def test_the_planner_carries_stamps_only_when_built_for_them(tmp_path):
    source = Engine(cache_dir=tmp_path).source(DecodeSpec(head_dim=64, group_size=8, arch="sm_90"))
    plain, stamped = ptx(source), ptx(source, f"-DFJ_PLAN_STAMPS={STAMPS}")
    assert "fj_plan_stamps" not in plain and "%clock64" not in plain
    # an unmangled name, which the tool looks up in the loaded module
    assert f".b8 fj_plan_stamps[{8 * STAMPS}]" in stamped and stamped.count("%clock64") == STAMPS


def test_help_runs_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "FJ_PLAN_STAMPS" in capsys.readouterr().out
