"""flashjit.env: one typed accessor per environment variable, one truth parser, one warning per bad value."""

from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path

import pytest

from flashjit import env

PACKAGE = Path(env.__file__).resolve().parent


@pytest.fixture(autouse=True)
def clean(monkeypatch, caplog):
    """No flashjit variable set and no warning remembered, as in a fresh process."""
    for name in ("FLASHJIT_CACHE_DIR", "FLASHJIT_NO_COMPILE", "FLASHJIT_LOCK_TIMEOUT", "FLASHJIT_TEMPLATE_PATH",
                 "FLASHJIT_HOST_NATIVE", "CC", "CXX", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(env, "_warned", set())
    caplog.set_level(logging.WARNING, logger="flashjit")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashjit" and r.levelno == logging.WARNING]


# ---- the truth parser ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["1", "true", "yes", "on", "TRUE", " Yes ", "On\n"])
def test_parse_flag_true(text):
    assert env.parse_flag(text) is True


@pytest.mark.parametrize("text", ["0", "false", "no", "off", "FALSE", " No ", "\tOFF"])
def test_parse_flag_false(text):
    assert env.parse_flag(text) is False


@pytest.mark.parametrize("text", ["", " ", "2", "y", "n", "enabled", "truee", "-1"])
def test_parse_flag_other(text):
    assert env.parse_flag(text) is None


# ---- flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [(None, False), ("", False), ("  ", False), ("1", True), ("true", True),
                                            ("YES", True), (" on ", True), ("0", False), ("off", False)])
def test_no_compile(monkeypatch, caplog, text, expected):
    if text is not None:
        monkeypatch.setenv("FLASHJIT_NO_COMPILE", text)
    assert env.no_compile() is expected
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("text, expected", [(None, True), ("", True), ("1", True), ("on", True), ("0", False),
                                            ("false", False), (" No ", False), ("OFF", False)])
def test_host_native(monkeypatch, caplog, text, expected):
    if text is not None:
        monkeypatch.setenv("FLASHJIT_HOST_NATIVE", text)
    assert env.host_native() is expected
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("name, accessor, default", [("FLASHJIT_NO_COMPILE", env.no_compile, False),
                                                     ("FLASHJIT_HOST_NATIVE", env.host_native, True),
                                                     ("FLASHJIT_VLLM_FP8_QUERIES", env.vllm_fp8_queries, True)])
def test_a_bad_flag_gives_the_default_and_warns_once_per_value(monkeypatch, caplog, name, accessor, default):
    monkeypatch.setenv(name, "enabled")
    assert accessor() is default and accessor() is default
    monkeypatch.setenv(name, "maybe")
    assert accessor() is default
    warnings = warnings_of(caplog)
    assert len(warnings) == 2 and name in warnings[0] and "'enabled'" in warnings[0] and "'maybe'" in warnings[1]
    assert "1/true/yes/on" in warnings[0]


# ---- values -------------------------------------------------------------------------------------

def test_cache_dir(monkeypatch):
    assert env.cache_dir() is None
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", "")
    assert env.cache_dir() is None
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", "/srv/kernels")
    assert env.cache_dir() == Path("/srv/kernels")
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", "~/kernels")
    assert env.cache_dir() == Path.home() / "kernels"


@pytest.mark.parametrize("text, expected", [(None, 120.0), ("", 120.0), (" ", 120.0), ("2.5", 2.5), (" 7 ", 7.0),
                                            ("0", 0.0), ("1e3", 1000.0)])
def test_lock_timeout(monkeypatch, caplog, text, expected):
    if text is not None:
        monkeypatch.setenv("FLASHJIT_LOCK_TIMEOUT", text)
    assert env.lock_timeout() == expected
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("text", ["soon", "-1", "-0.5", "nan", "1,5"])
def test_a_bad_lock_timeout_gives_the_default_and_warns_once(monkeypatch, caplog, text):
    monkeypatch.setenv("FLASHJIT_LOCK_TIMEOUT", text)
    assert env.lock_timeout() == env.DEFAULT_LOCK_TIMEOUT_S and env.lock_timeout() == env.DEFAULT_LOCK_TIMEOUT_S
    (warning,) = warnings_of(caplog)
    assert warning == f"FLASHJIT_LOCK_TIMEOUT={text!r} is not a number of seconds from 0 to 86400; using 120"


def test_template_path(monkeypatch, tmp_path):
    assert env.template_path() == []
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", "")
    assert env.template_path() == []
    first, second = tmp_path / "a", tmp_path / "b c"
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", os.pathsep.join([str(first), "", str(second), ""]))
    assert env.template_path() == [first, second]


def test_compilers_and_cuda_toolkit(monkeypatch):
    assert env.cc() == "" and env.cxx() == "" and env.cuda_toolkit() == ("", "")
    monkeypatch.setenv("CC", "  ccache gcc -m64 ")
    monkeypatch.setenv("CXX", "clang++ ")
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda-12.9")
    assert env.cc() == "ccache gcc -m64" and env.cxx() == "clang++" and env.cuda_toolkit() == ("/opt/cuda-12.9", "")


def test_accessors_read_at_each_call(monkeypatch):
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")
    assert env.no_compile()
    monkeypatch.setenv("FLASHJIT_NO_COMPILE", "0")
    assert not env.no_compile()


# ---- one module -----------------------------------------------------------------------------------

def test_only_env_reads_the_environment():
    """Every os.environ / os.getenv read in flashjit/ is in env.py, except `flashjit doctor`'s
    listing of every FLASHJIT_* variable that is set."""
    readers = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.setdefault(str(path.relative_to(PACKAGE)), []).append(node.lineno)
    assert set(readers) <= {"env.py", "deploy/cli_doctor.py"}, readers


def test_the_docstring_table_names_every_variable_and_accessor():
    source = Path(env.__file__).read_text()
    table = env.__doc__
    for name in set(re.findall(r'"(FLASHJIT_[A-Z_]+|CC|CXX|CUDA_HOME|CUDA_PATH)"', source)):
        assert name in table, name
    for accessor in ("cache_dir", "no_compile", "lock_timeout", "template_path", "host_native", "cc", "cxx", "cuda_toolkit"):
        assert f"{accessor}()" in table and callable(getattr(env, accessor))


def test_env_imports_nothing_from_flashjit_but_errors():
    tree = ast.parse(Path(env.__file__).read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    imported += [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
                 if a.name.startswith("flashjit")]
    assert set(imported) <= {"errors"}, imported


def test_vllm_backend_settings(monkeypatch, caplog):
    assert env.vllm_decode_q_len() is None and env.vllm_share_prefixes()
    monkeypatch.setenv("FLASHJIT_VLLM_DECODE_Q_LEN", " 4 ")
    monkeypatch.setenv("FLASHJIT_VLLM_SHARE_PREFIXES", "off")
    assert env.vllm_decode_q_len() == 4 and not env.vllm_share_prefixes()
    for bad in ("17", "0", "four"):
        monkeypatch.setenv("FLASHJIT_VLLM_DECODE_Q_LEN", bad)
        assert env.vllm_decode_q_len() is None
    assert "FLASHJIT_VLLM_DECODE_Q_LEN='four' is not a query-token count in 1..16" in caplog.text


@pytest.mark.parametrize("text", ["inf", "1e309", "86401", "1e12"])
def test_a_lock_timeout_past_the_accepted_range_gives_the_default(monkeypatch, caplog, text):
    """A timeout too long to wait out (a day and more) would wait forever behind a stopped process."""
    monkeypatch.setenv("FLASHJIT_LOCK_TIMEOUT", text)
    assert env.lock_timeout() == env.DEFAULT_LOCK_TIMEOUT_S
    (warning,) = warnings_of(caplog)
    assert warning == f"FLASHJIT_LOCK_TIMEOUT={text!r} is not a number of seconds from 0 to 86400; using 120"


def test_the_longest_accepted_lock_timeout(monkeypatch, caplog):
    monkeypatch.setenv("FLASHJIT_LOCK_TIMEOUT", "86400")
    assert env.lock_timeout() == 86400.0 and warnings_of(caplog) == []
