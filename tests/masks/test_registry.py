"""Mask registry: built-ins, user masks (register_mask, FLASHJIT_TEMPLATE_PATH, template_dirs), rejects."""

from __future__ import annotations

import os
import re

import pytest

import flashjit
from flashjit import DecodeSpec, Engine, SpecError, register_mask
from flashjit.masks.registry import MaskParam, masks
from flashjit.jit.render import render

from built_ins import BUILT_IN_MASKS

# Each built-in's parameters, as docs/masks.md documents them: the fields of its kernel argument struct.
BUILT_INS = {
    "none": (),
    "causal": (),
    "sliding_window": (MaskParam("window_left", "int"),),
    "block_sparse": (MaskParam("block_size", "int"), MaskParam("block_indptr", "int_tensor"),
                     MaskParam("block_indices", "int_tensor")),
    "tree": (MaskParam("tree_mask", "int_tensor"), MaskParam("tree_qo_indptr", "int_tensor")),
    "sink_window": (MaskParam("num_sink", "int"), MaskParam("window_left", "int"),
                    MaskParam("first_q_pos", "int_tensor")),
    "key_range": (MaskParam("range_qo_indptr", "int_tensor"), MaskParam("range_begin", "int_tensor"),
                  MaskParam("range_end", "int_tensor")),
}


def decode_signature(source: str) -> str:
    match = re.search(r"flashjit_decode\(([^)]*)\)", source)
    assert match, "rendered source has no flashjit_decode entry point"
    return match.group(1)


def test_the_table_holds_every_built_in():
    assert sorted(BUILT_INS) == sorted(BUILT_IN_MASKS)


@pytest.mark.parametrize("name, params", BUILT_INS.items())
def test_built_ins_present(name, params):
    assert name in masks
    assert name in masks.names()
    mask = masks.get(name)
    assert mask.name == name and mask.params == params
    assert not mask.template.startswith("/")  # built-ins resolve through the package loader


def test_built_in_spans_and_references():
    assert masks.get("sliding_window").kv_span is not None
    assert masks.get("block_sparse").kv_span is not None
    assert masks.get("none").kv_span is None and masks.get("none").reference is None
    assert masks.get("causal").reference is not None


def test_param_ctypes():
    mask = masks.get("block_sparse")
    assert [p.ctype for p in mask.params] == ["int", "const int* __restrict__", "const int* __restrict__"]
    assert mask.param_names == ("block_size", "block_indptr", "block_indices")


def test_register_mask_compiles_with_no_engine_change(isolated_masks, mask_file, tmp_path, engine, compile_log):
    path = mask_file(tmp_path, "even_keys", "return (kv_pos & 1) == 0 && kv_pos <= q_pos;")
    mask = register_mask("even_keys", path)
    assert mask.template == str(path.resolve()) and mask.params == ()
    spec = DecodeSpec(64, mask="even_keys", arch="sm_90")
    kernel = engine.get_kernel(spec)
    assert kernel.cubin[:4] == b"\x7fELF"
    assert kernel.mask is mask
    source = engine.source(spec)
    assert "return (kv_pos & 1) == 0 && kv_pos <= q_pos;" in source and "// mask: even_keys" in source
    assert len(compile_log()) == 1 and spec.name in compile_log()[0]


def test_template_path_env_registers_masks_with_params(isolated_masks, mask_file, tmp_path, monkeypatch):
    folder = tmp_path / "user_masks"
    mask_file(folder, "below_foo", "return kv_pos < params.foo;", header="{# params: foo:int #}\n")
    assert "below_foo" not in masks
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", str(folder))
    assert "below_foo" in masks
    assert masks.get("below_foo").params == (MaskParam("foo", "int"),)
    source = render(DecodeSpec(64, mask="below_foo", arch="sm_90"))
    assert decode_signature(source) == "decode::Args args, int mask_foo"
    assert "params.foo = mask_foo;" in source
    assert "return kv_pos < params.foo;" in source


def test_template_path_env_several_folders(isolated_masks, mask_file, tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    mask_file(first, "mask_a", "return true;")
    mask_file(second / "masks", "mask_b", "return false;")  # a masks/ subfolder is scanned too
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", os.pathsep.join([str(first), str(second)]))
    assert {"mask_a", "mask_b"} <= set(masks.names())


@pytest.mark.parametrize("header, expected", [
    ("{# params: foo:int #}", (MaskParam("foo", "int"),)),
    # Jinja's whitespace-trimming comment: the closing '-' is syntax, not a parameter.
    ("{#- params: foo:int -#}", (MaskParam("foo", "int"),)),
    ("{# params: lo hi:float idx:int_tensor #}",
     (MaskParam("lo", "int"), MaskParam("hi", "float"), MaskParam("idx", "int_tensor"))),
    ("", ()),
])
def test_params_header(isolated_masks, mask_file, tmp_path, header, expected):
    mask_file(tmp_path, "hdr", "return true;", header=header + "\n")
    (found,) = masks.add_template_dir(tmp_path)
    assert found.name == "hdr" and found.params == expected


def test_header_params_reach_the_signature_in_order(isolated_masks, mask_file, tmp_path):
    mask_file(tmp_path, "multi", "return kv_pos >= params.lo && params.hi > 0.f && params.idx != nullptr;",
              header="{#- params: lo:int hi:float idx:int_tensor -#}\n")
    masks.add_template_dir(tmp_path)
    source = render(DecodeSpec(64, mask="multi", arch="sm_90"))
    assert decode_signature(source) == ("decode::Args args, int mask_lo, float mask_hi, "
                                        "const int* __restrict__ mask_idx")


def test_engine_template_dirs(isolated_masks, mask_file, tmp_path):
    mask_file(tmp_path / "tpl", "from_engine", "return kv_pos + 4 > q_pos;")
    assert "from_engine" not in masks
    Engine(cache_dir=tmp_path / "cache", template_dirs=[tmp_path / "tpl"])
    assert "from_engine" in masks
    assert DecodeSpec(64, mask="from_engine", arch="sm_90").mask == "from_engine"


def test_template_dir_skips_base_and_non_identifiers(isolated_masks, mask_file, tmp_path):
    mask_file(tmp_path, "base", "return true;")
    mask_file(tmp_path, "not-a-name", "return true;")
    mask_file(tmp_path, "ok_name", "return true;")
    assert [m.name for m in masks.add_template_dir(tmp_path)] == ["ok_name"]
    assert "base" not in masks and "not-a-name" not in masks


def test_template_dir_must_exist(isolated_masks, tmp_path):
    with pytest.raises(SpecError) as info:
        Engine(cache_dir=tmp_path / "cache", template_dirs=[tmp_path / "missing"])
    assert info.value.field == "template_dirs" and "missing" in str(info.value)


@pytest.mark.parametrize("name", ["1mask", "my-mask", "two words", "", "a.b"])
def test_bad_mask_names_rejected(isolated_masks, mask_file, tmp_path, name):
    path = mask_file(tmp_path, "good", "return true;")
    with pytest.raises(SpecError) as info:
        register_mask(name, path)
    assert info.value.field == "mask" and info.value.value == name
    assert name not in masks


def test_non_string_name_rejected(isolated_masks, mask_file, tmp_path):
    with pytest.raises(SpecError):
        register_mask(42, mask_file(tmp_path, "good", "return true;"))


@pytest.mark.parametrize("params, field", [
    ({"window": "double"}, "mask param 'window' kind"),
    ({"bad-name": "int"}, "mask params"),
    (["ok", "9lives"], "mask params"),
])
def test_bad_params_rejected(isolated_masks, mask_file, tmp_path, params, field):
    with pytest.raises(SpecError) as info:
        register_mask("params_mask", mask_file(tmp_path, "p", "return true;"), params)
    assert info.value.field == field
    assert "params_mask" not in masks


def test_list_params_are_ints(isolated_masks, mask_file, tmp_path):
    mask = register_mask("listed", mask_file(tmp_path, "p", "return true;"), ["a", "b"])
    assert mask.params == (MaskParam("a", "int"), MaskParam("b", "int"))


def test_missing_template_file_rejected(isolated_masks, tmp_path):
    with pytest.raises(SpecError) as info:
        register_mask("ghost", tmp_path / "ghost.cuh.j2")
    assert info.value.field == "template_path"
    assert "ghost" not in masks


def test_name_collision_needs_replace(isolated_masks, mask_file, tmp_path):
    first = mask_file(tmp_path / "1", "dup", "return true;")
    second = mask_file(tmp_path / "2", "dup", "return false;")
    register_mask("dup", first)
    register_mask("dup", first)  # the same definition again is fine
    with pytest.raises(SpecError) as info:
        register_mask("dup", second)
    assert "replace=True" in str(info.value)
    assert masks.get("dup").template == str(first.resolve())
    generation = masks.generation
    register_mask("dup", second, replace=True)
    assert masks.get("dup").template == str(second.resolve())
    assert masks.generation > generation  # what was looked up before knows to look again


def test_built_in_cannot_be_overwritten_silently(isolated_masks, mask_file, tmp_path):
    with pytest.raises(SpecError):
        register_mask("causal", mask_file(tmp_path, "causal", "return true;"))
    assert masks.get("causal").template == "masks/causal.cuh.j2"


def test_get_unknown_mask(isolated_masks):
    with pytest.raises(SpecError) as info:
        masks.get("nope")
    assert info.value.field == "mask" and "causal" in info.value.accepted


def test_register_mask_is_public():
    assert flashjit.register_mask is register_mask
