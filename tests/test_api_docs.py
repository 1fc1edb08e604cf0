"""docs/api.md against the code: every signature it documents names the parameters the callable
has, in order, of the same kind (positional or keyword-only), with the same defaults."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import flashjit
from flashjit.masks import registry
from flashjit.serving import torch_ops
from flashjit.serving.reference import decode_reference

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()

# The documented name (as api.md writes it before the parenthesis) -> what it documents.
DOCUMENTED = {
    "DecodeSpec": flashjit.DecodeSpec,
    "Engine": flashjit.Engine,
    "BatchDecode": flashjit.BatchDecode,
    "plan": flashjit.BatchDecode.plan,
    "run": flashjit.BatchDecode.run,
    "point_variant_at": flashjit.BatchDecode.point_variant_at,
    "decode": flashjit.decode,
    "decode_reference": decode_reference,
    "BatchDecodeMLA": flashjit.BatchDecodeMLA,
    ".plan": flashjit.BatchDecodeMLA.plan,
    ".run": flashjit.BatchDecodeMLA.run,
    "merge_states": flashjit.merge_states,
    "merge_state": flashjit.merge_state,
    "quantize_kv": flashjit.quantize_kv,
    "dequantize_kv": flashjit.dequantize_kv,
    "register_mask": registry.register_mask,
    "torch.ops.flashjit.decode": torch_ops.DECODE_SCHEMA,
}
# A signature is set in bold or starts its line; a call in running text is an example, not checked.
SIGNATURE = re.compile(r"(?:\*\*|^)`(?P<name>\.?[A-Za-z_][\w.]*)\((?P<params>[^`]*)\)`", re.MULTILINE)


def documented_signatures():
    found = []
    for match in SIGNATURE.finditer(API):
        params = match["params"].strip()
        if match["name"] in DOCUMENTED and params and not params.startswith("..."):  # not a call in prose
            found.append((match["name"], params))
    return found


def split_params(text: str) -> list[str]:
    """Top-level comma-separated parts (defaults may hold brackets or strings with commas)."""
    parts, depth, current, quote = [], 0, "", None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def actual_parameters(target) -> list[tuple[str, str, object]]:
    """(name, kind, default) of the callable's parameters (self left out), or of an operator schema."""
    if isinstance(target, str):  # a torch.library schema: "name(Type arg, ...) -> ()"
        inner = target[target.index("(") + 1:target.rindex(") ->")]
        return [(part.split()[-1], "positional", inspect.Parameter.empty) for part in split_params(inner)]
    params = inspect.signature(target).parameters.values()
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional", inspect.Parameter.KEYWORD_ONLY: "keyword",
             inspect.Parameter.VAR_KEYWORD: "var_keyword", inspect.Parameter.VAR_POSITIONAL: "var_positional"}
    return [(p.name, kinds[p.kind], p.default) for p in params if p.name != "self"]


def documented_parameters(text: str):
    """(name, kind, default text or None) of each documented parameter, and whether '...' ends them."""
    out, kind, more = [], "positional", False
    for part in split_params(text):
        if part == "*":
            kind = "keyword"
        elif part == "...":
            more = True
        elif part.startswith("**"):
            out.append((part[2:], "var_keyword", None))
        else:
            name, eq, default = part.partition("=")
            out.append((name.strip(), kind, default.strip() if eq and default.strip() else None))
    return out, more


@pytest.mark.parametrize("name, params", documented_signatures(), ids=lambda v: v if len(v) < 30 else v[:30])
def test_each_documented_signature_is_the_codes(name, params):
    documented, more = documented_parameters(params)
    actual = actual_parameters(DOCUMENTED[name])
    if more:
        actual = actual[:len(documented)]
    assert [(n, k) for n, k, _ in documented] == [(n, k) for n, k, _ in actual], name
    for (param, _, text), (_, _, default) in zip(documented, actual):
        if text is not None:
            assert ast.literal_eval(text) == default, f"{name}: {param}={text}, the code's default is {default!r}"


def test_every_documented_callable_has_its_signature_in_api_md():
    assert {name for name, _ in documented_signatures()} == set(DOCUMENTED)


def test_a_changed_signature_would_be_caught():
    documented, _ = documented_parameters('q, kv_cache, *, out=None, lse=None, return_lse=True')
    actual = actual_parameters(flashjit.BatchDecode.run)
    assert [(n, k) for n, k, _ in documented] != [(n, k) for n, k, _ in actual]
