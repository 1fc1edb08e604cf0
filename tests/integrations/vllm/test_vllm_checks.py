"""FLASHJIT's vLLM refusal reasons on CPU (checks.py imports no vLLM; the backends' own tests run in
the frameworks venv)."""

from __future__ import annotations

import pytest

from flashjit.integrations.vllm.checks import REFUSED_SETTINGS, mla_refusal_reasons, refusal_reasons, takes_fp8_queries

SERVED = dict(head_size=128, dtype="torch.bfloat16", kv_cache_dtype="auto", block_size=16, capability=(9, 0))


def test_a_served_configuration_has_no_reason():
    assert refusal_reasons(**SERVED) == []
    assert refusal_reasons(**SERVED, **{setting: False for setting in REFUSED_SETTINGS}) == []


@pytest.mark.parametrize("setting", sorted(REFUSED_SETTINGS))
def test_each_switch_on_gives_its_own_reason(setting):
    assert refusal_reasons(**SERVED, **{setting: True}) == [REFUSED_SETTINGS[setting]]


def test_every_switch_is_reported_at_once():
    reasons = refusal_reasons(**SERVED, attn_type="encoder_only", **{setting: True for setting in REFUSED_SETTINGS})
    assert len(reasons) == len(REFUSED_SETTINGS) + 1 and reasons[0].startswith("attention type encoder_only")


def test_an_unknown_switch_is_named():
    with pytest.raises(TypeError, match="use_sprase.*use_sparse"):
        refusal_reasons(**SERVED, use_sprase=True)


def test_mla_shares_the_switches_but_not_the_mla_refusal():
    served = dict(SERVED, head_size=576, block_size=64)
    assert mla_refusal_reasons(**served, use_mla=True) == []
    assert mla_refusal_reasons(**served, use_mla=True, use_dcp=True) == [REFUSED_SETTINGS["use_dcp"]]
    assert mla_refusal_reasons(**served, use_mla=False)[0].startswith("non-MLA attention")


@pytest.mark.parametrize("kv_cache_dtype, enabled, expected", [
    ("fp8", True, True), ("fp8_e4m3", True, True), ("fp8", False, False), ("fp8_e5m2", True, False),
    ("auto", True, False), ("bfloat16", True, False),
])
def test_layers_ask_for_e4m3_queries_over_an_e4m3_cache_unless_turned_off(kv_cache_dtype, enabled, expected):
    assert takes_fp8_queries(kv_cache_dtype, enabled) is expected
