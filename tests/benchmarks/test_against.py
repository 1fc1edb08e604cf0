"""benchmarks/against.py: a module run in a baseline tree and in this one, alternating, each child
importing from its own tree with a kernel cache of its own; refusals name what is wrong."""

from __future__ import annotations

import pytest

from benchmarks import against


def fake_baseline(root):
    """A tree whose flashjit says where it runs from and which cache it was given."""
    (root / "templates").mkdir(parents=True)
    package = root / "flashjit"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import os, sys\nprint('baseline flashjit', sys.argv[1:], os.environ['FLASHJIT_CACHE_DIR'])\n")
    return root


def test_rounds_alternate_between_the_trees(tmp_path, capfd):
    base = fake_baseline(tmp_path / "base")
    assert against.main([str(base), "--rounds", "2", "--", "flashjit", "--version"]) == 0
    out = capfd.readouterr().out.splitlines()
    headers = [line for line in out if line.startswith("== ")]
    assert [h.split(" (")[0] for h in headers] == ["== baseline", "== this tree"] * 2
    baseline_lines = [line for line in out if line.startswith("baseline flashjit")]
    assert len(baseline_lines) == 2 and all("['--version']" in line for line in baseline_lines)
    assert sum(line.startswith("flashjit ") for line in out) == 2  # this tree's own CLI
    assert len({line.split()[-1] for line in baseline_lines}) == 1  # one cache folder for the baseline's runs


def test_a_failing_child_makes_the_status_1(tmp_path, capfd):
    base = fake_baseline(tmp_path / "base")
    (base / "flashjit" / "__main__.py").write_text("raise SystemExit(3)\n")
    assert against.main([str(base), "--", "flashjit", "--version"]) == 1
    assert "== baseline: exit status 3" in capfd.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["{missing}", "--", "flashjit"], "is not a flashjit checkout"),
    (["{base}"], "name the benchmark module"),
    (["{base}", "--rounds", "0", "--", "flashjit"], "--rounds must be at least 1, got 0"),
])
def test_refusals(tmp_path, capsys, argv, message):
    base = fake_baseline(tmp_path / "base")
    argv = [a.format(base=base, missing=tmp_path / "nowhere") for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        against.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
