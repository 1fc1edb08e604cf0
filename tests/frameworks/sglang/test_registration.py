"""flashjit's SGLang plugin against the real SGLang 0.5.23: its own plugin loader finds and runs the
entry point, its argument parser then takes flashjit as the decode backend beside fa3 for prefill,
and another SGLang release is refused by name."""

from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("sglang")

from sglang.srt import plugins as sglang_plugins  # noqa: E402
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from flashjit.integrations.sglang import plugin  # noqa: E402

FLAGS = ["--model-path", "dummy", "--decode-attention-backend", "flashjit", "--prefill-attention-backend", "fa3"]


@pytest.fixture
def unregistered(monkeypatch):
    """SGLang's registry and choices without flashjit, as before the plugin ran (restored after)."""
    backends, choices = dict(ATTENTION_BACKENDS), list(ATTENTION_BACKEND_CHOICES)
    ATTENTION_BACKENDS.pop("flashjit", None)
    ATTENTION_BACKEND_CHOICES[:] = [name for name in choices if name != "flashjit"]
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    yield
    ATTENTION_BACKENDS.clear()
    ATTENTION_BACKENDS.update(backends)
    ATTENTION_BACKEND_CHOICES[:] = choices


def test_sglangs_own_loader_finds_and_runs_the_entry_point(unregistered):
    found = sglang_plugins.load_plugins_by_group(sglang_plugins.GENERAL_PLUGINS_GROUP)
    assert found["flashjit"][0] is plugin.register and found["flashjit"][1] == "flashjit"
    assert "flashjit" not in ATTENTION_BACKENDS
    sglang_plugins.load_plugins()
    assert ATTENTION_BACKENDS["flashjit"] is plugin.create_backend
    assert ATTENTION_BACKEND_CHOICES.count("flashjit") == 1


def test_the_parser_takes_flashjit_for_decode_beside_fa3_for_prefill(unregistered):
    with pytest.raises(SystemExit):  # argparse: invalid choice, until the plugin has run
        prepare_server_args(FLAGS)
    sglang_plugins.load_plugins()
    args = prepare_server_args(FLAGS)
    assert args.decode_attention_backend == "flashjit" and args.prefill_attention_backend == "fa3"


def test_registering_again_changes_nothing(unregistered):
    plugin.register()
    choices, factory = list(ATTENTION_BACKEND_CHOICES), ATTENTION_BACKENDS["flashjit"]
    plugin.register()
    assert ATTENTION_BACKEND_CHOICES == choices and ATTENTION_BACKENDS["flashjit"] is factory


def test_the_installed_release_is_the_supported_one():
    assert plugin.check_sglang_version() == importlib.metadata.version("sglang") == plugin.SUPPORTED_SGLANG
    assert plugin.check_sglang_version("0.5.23.post1") == "0.5.23.post1"


@pytest.mark.parametrize("other", ["0.5.22", "0.5.24", "0.6.0", "0.5.23rc1", "nightly"])
def test_another_release_is_refused_naming_both(other, unregistered, monkeypatch):
    with pytest.raises(ImportError, match=rf"written for SGLang 0\.5\.23 .*installed: SGLang {other}"):
        plugin.check_sglang_version(other)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: other)
    with pytest.raises(ImportError, match=f"installed: SGLang {other}"):
        plugin.register()
    assert "flashjit" not in ATTENTION_BACKENDS and "flashjit" not in ATTENTION_BACKEND_CHOICES
