"""Custom masks as a product: registration (template=, folders, entry points), the tree and
sink_window built-ins (templates, spans, torch predicates, helpers), the host replay of a mask's
hooks, and `flashjit check-mask` without a GPU.

Compiles: tree and sink_window on both kernels for sm_90 (4, in a module-wide cache that the
check-mask CLI test then hits) and the worked example's mask once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import random
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import flashjit
import flashjit.deploy.random_batches
from flashjit import DecodeSpec, Engine, SpecError, register_mask
from flashjit.deploy import cli
from flashjit.deploy import mask_check as cm
from flashjit.masks import sink_window, tree
from flashjit.masks.registry import MaskDef, MaskParam, masks
from flashjit.jit.compile import compile_source
from flashjit.jit.render import render, template_root

from built_ins import BUILT_IN_MASKS, BUILT_IN_VARIANTS, HOST_SPAN_MASKS, SCALAR_PARAM_MASKS
from repo_paths import ROOT

needs_cxx = pytest.mark.skipif(cm.host_compiler() is None, reason="no host C++ compiler")


@pytest.fixture
def plugin_masks(isolated_masks):
    """isolated_masks, plus a fresh entry-point discovery that is undone afterwards."""
    saved = masks._plugins_loaded, dict(masks.plugin_errors)
    masks._plugins_loaded = False
    masks.plugin_errors.clear()
    yield masks
    masks._plugins_loaded = saved[0]
    masks.plugin_errors.clear()
    masks.plugin_errors.update(saved[1])


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


# ---- registration -------------------------------------------------------------------------------

def test_register_mask_template_keyword(isolated_masks, mask_file, tmp_path):
    path = mask_file(tmp_path, "kw", "return kv_pos <= q_pos;")
    sampler = lambda rng, kv_lens, q_lens, page_size, device: {}  # noqa: E731
    mask = register_mask("kw", template=path, sample_params=sampler)
    assert mask.template == str(path.resolve()) and mask.sample_params is sampler
    assert masks.get("kw") is mask
    assert register_mask("kw", path, template=path, sample_params=sampler) == mask  # both spellings agree


def test_register_mask_positional_still_works(isolated_masks, mask_file, tmp_path):
    mask = register_mask("pos", mask_file(tmp_path, "pos", "return true;"), {"a": "int"})
    assert mask.params == (MaskParam("a", "int"),) and mask.sample_params is None


@pytest.mark.parametrize("kwargs, field", [
    ({}, "template"),
    ({"template": "missing.cuh.j2"}, "template"),
])
def test_register_mask_needs_an_existing_template(isolated_masks, kwargs, field):
    with pytest.raises(SpecError) as info:
        register_mask("no_template", **kwargs)
    assert info.value.field == field and "no_template" not in masks


def test_register_mask_rejects_two_different_templates(isolated_masks, mask_file, tmp_path):
    a, b = mask_file(tmp_path / "a", "m", "return true;"), mask_file(tmp_path / "b", "m", "return false;")
    with pytest.raises(SpecError) as info:
        register_mask("two", a, template=b)
    assert info.value.field == "template"


def test_template_folder_mask_with_kv_position(isolated_masks, tmp_path, monkeypatch):
    folder = tmp_path / "masks_here"
    folder.mkdir()
    (folder / "stride2.cuh.j2").write_text(textwrap.dedent("""\
        {# params: unused:int #}
        {% extends "masks/base.cuh.j2" %}
        {% block kv_position %}  return 2 * v;{% endblock %}
        {% block visible %}  return kv_pos <= q_pos;{% endblock %}
        """))
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", str(folder))
    mask = masks.get("stride2")
    assert mask.params == (MaskParam("unused", "int"),) and mask.kv_span is None
    source = render(DecodeSpec(64, mask="stride2", arch="sm_90"))
    assert "return 2 * v;" in source and "params.unused = mask_unused;" in source


# ---- entry points -------------------------------------------------------------------------------

PLUGIN_MODULE = '''
from pathlib import Path

import flashjit
import flashjit.deploy.random_batches
from flashjit.masks.registry import MaskDef, MaskParam

HERE = Path(__file__).parent
CALLS = []


def _reference(q_pos, kv_pos, request, params):
    return kv_pos <= q_pos


def register():  # registers one mask itself and returns another as a dict
    CALLS.append("register")
    flashjit.register_mask("plugin_called", template=HERE / "plugin_called.cuh.j2")
    return {"name": "plugin_dict", "template": str(HERE / "plugin_dict.cuh.j2"), "params": {"n": "int"},
            "reference": _reference}


MASKS = [MaskDef("plugin_def", str(HERE / "plugin_def.cuh.j2"), (MaskParam("w", "float"),))]


def broken():
    raise RuntimeError("plugin exploded")
'''


@pytest.fixture
def installed_plugin(plugin_masks, mask_file, tmp_path, monkeypatch):
    """A distribution 'fj-test-plugin' with three flashjit.masks entry points, importable from tmp_path."""
    for name in ("plugin_called", "plugin_dict", "plugin_def"):
        mask_file(tmp_path, name, "return kv_pos <= q_pos;")
    (tmp_path / "fj_test_plugin.py").write_text(PLUGIN_MODULE)
    dist = tmp_path / "fj_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fj-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[flashjit.masks]\ncalled = fj_test_plugin:register\n"
                                           "listed = fj_test_plugin:MASKS\nbroken = fj_test_plugin:broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("fj_test_plugin", None)


def test_entry_points_register_masks_lazily(installed_plugin, caplog):
    assert masks.get("causal")  # a registered name never triggers discovery
    assert not masks._plugins_loaded and "fj_test_plugin" not in sys.modules
    assert "plugin_called" in masks  # the first miss loads every entry point, once
    assert masks._plugins_loaded
    assert sys.modules["fj_test_plugin"].CALLS == ["register"]
    assert masks.get("plugin_called").template == str(installed_plugin / "plugin_called.cuh.j2")
    by_dict = masks.get("plugin_dict")
    assert by_dict.params == (MaskParam("n", "int"),) and by_dict.reference is not None
    assert masks.get("plugin_def").params == (MaskParam("w", "float"),)
    assert {"plugin_called", "plugin_dict", "plugin_def"} <= set(masks.names())
    assert sys.modules["fj_test_plugin"].CALLS == ["register"]
    assert "plugin exploded" in masks.plugin_errors["broken"]
    assert "plugin exploded" in caplog.text


def test_failed_plugins_are_named_on_an_unknown_mask(installed_plugin):
    with pytest.raises(SpecError) as info:
        masks.get("not_anywhere")
    assert "broken" in info.value.accepted and "plugin exploded" in info.value.accepted


def test_plugin_masks_compile_like_any_other(installed_plugin):
    source = render(DecodeSpec(64, mask="plugin_def", arch="sm_90"))
    assert "float mask_w" in source and "// mask: plugin_def" in source


def test_plugin_cannot_replace_a_built_in(plugin_masks, tmp_path, monkeypatch, mask_file):
    mask_file(tmp_path, "causal", "return true;")
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [_FakeEntryPoint(
        "evil", lambda: {"name": "causal", "template": str(tmp_path / "causal.cuh.j2")})])
    masks.load_plugins()
    assert masks.get("causal").template == "masks/causal.cuh.j2"
    assert "replace=True" in masks.plugin_errors["evil"]


class _FakeEntryPoint:
    def __init__(self, name, obj):
        self.name, self.value, self._obj = name, f"fake:{name}", obj

    def load(self):
        return self._obj


# ---- tree ---------------------------------------------------------------------------------------

def test_tree_words_hand_checked():
    #   prefix -> 0 -> 1 -> 3      token 2 is a second child of 0; token 4 a second root
    assert tree.tree_words([-1, 0, 0, 1, -1]) == [0b1, 0b11, 0b101, 0b1011, 0b10000]
    assert tree.tree_words([]) == []


def test_pack_tree_mask_layout_and_sign_bit():
    chain = list(range(-1, 31))  # 32 tokens, each the child of the previous one
    params = tree.pack_tree_mask([[-1, 0], chain, []], device="cpu")
    assert params["tree_qo_indptr"].tolist() == [0, 2, 34, 34]
    assert params["tree_mask"].dtype == torch.int32 and params["tree_mask"].shape == (34,)
    assert params["tree_mask"][:2].tolist() == [1, 3]
    assert params["tree_mask"][-1].item() == -1  # all 32 bits set: bit 31 is the sign bit
    assert (params["tree_mask"][2:].long() & 0xFFFFFFFF).tolist() == [(1 << (i + 1)) - 1 for i in range(32)]


@pytest.mark.parametrize("parents, match", [
    ([0], r"parents\[0\]"),            # a token cannot extend itself
    ([-1, 1], r"parents\[1\]"),
    ([-1, -2], r"parents\[1\]"),
    ([-1] * 33, "at most 32"),
])
def test_pack_tree_mask_rejects_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        tree.pack_tree_mask([parents], device="cpu")


def _visibility(mask_name, kv_len, q_len, request, params) -> list[list[int]]:
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    kv_pos = torch.arange(kv_len)[None, :]
    visible = masks.get(mask_name).reference(q_pos, kv_pos, request, params).expand(q_len, kv_len)
    return visible.int().tolist()


def test_tree_reference_hand_checked():
    # request 1: a 4-key prefix, then draft tokens 0 (root), 1 (child of 0), 2 (root)
    params = tree.pack_tree_mask([[-1, -1], [-1, 0, -1]], device="cpu")
    assert _visibility("tree", 7, 3, 1, params) == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 1],
    ]
    assert _visibility("tree", 2, 2, 0, params) == [[1, 0], [0, 1]]  # no prefix: two sibling roots


def test_tree_kv_span_validates_against_the_plan():
    kv_lens, q_lens = np.array([10, 5]), np.array([3, 2])
    params = tree.pack_tree_mask([[-1, 0, 1], [-1, 0]], device="cpu")
    begin, end = tree.kv_span(kv_lens, q_lens, params)
    assert begin.tolist() == [0, 0] and end.tolist() == [10, 5]
    with pytest.raises(ValueError, match="tree_qo_indptr: expected the plan's qo_indptr"):
        tree.kv_span(kv_lens, np.array([2, 3]), params)
    with pytest.raises(ValueError, match="at most 32 query tokens"):
        tree.kv_span(np.array([40]), np.array([33]), params)


# ---- sink_window --------------------------------------------------------------------------------

def test_sink_window_reference_hand_checked():
    params = sink_window.sink_window_params([10], 2, num_sink=2, window_left=3, device="cpu")
    assert params["first_q_pos"].tolist() == [8]
    assert _visibility("sink_window", 10, 2, 0, params) == [
        [1, 1, 0, 0, 0, 1, 1, 1, 1, 0],  # q_pos 8: sinks 0-1, window 5-8
        [1, 1, 0, 0, 0, 0, 1, 1, 1, 1],  # q_pos 9: sinks 0-1, window 6-9
    ]


def test_sink_window_span_skips_the_pages_between():
    kv_len, q_len, page_size, num_sink, window_left = 1000, 1, 16, 4, 37
    params = sink_window.sink_window_params([kv_len], q_len, num_sink=num_sink, window_left=window_left, device="cpu")
    begin, end = sink_window.kv_span(np.array([kv_len]), np.array([q_len]), params)
    # the gap, 999 - 37 - 4 = 958 keys, rounded down to 944 (a multiple of 16): 14 keys before the window
    assert begin.tolist() == [0] and end.tolist() == [num_sink + window_left + q_len + 14]
    walked = sink_window.kv_positions(kv_len, q_len, num_sink, window_left)
    assert walked.tolist() == list(range(4)) + list(range(999 - 37 - 14, 1000))
    assert sorted({int(p) // page_size for p in walked}) == [0, 59, 60, 61, 62]  # pages 1..58 are never read
    visible = np.array(_visibility("sink_window", kv_len, q_len, 0, params), dtype=bool).any(0)
    assert set(np.flatnonzero(visible)) == set(walked.tolist()) - set(range(948, 962))  # the visible keys, and 14


@pytest.mark.parametrize("kv_len, q_len, num_sink, window_left, span", [
    (1000, 4, 4, 37, 56),   # several query tokens: the window of the first one (gap 955 -> 944)
    (30, 1, 4, 37, 30),     # window reaches the sinks: the whole request, no gap
    (42, 1, 4, 37, 42),     # window starts right after the sinks
    (43, 1, 4, 37, 43),     # one key to skip: rounded down to none
    (61, 1, 4, 37, 45),     # 19 keys to skip: 16 skipped
    (3, 1, 8, 0, 3),        # sinks longer than the request
    (500, 1, 0, 0, 4),      # no sinks, no window: the query's own key and the 3 before it (gap 499 -> 496)
])
def test_sink_window_span_lengths(kv_len, q_len, num_sink, window_left, span):
    params = {"num_sink": num_sink, "window_left": window_left, "first_q_pos": [kv_len - q_len]}
    _, end = sink_window.kv_span(np.array([kv_len]), np.array([q_len]), params)
    tight = min(kv_len, num_sink + window_left + q_len)
    assert end.tolist() == [span] and tight <= span < tight + sink_window.GAP_ALIGN
    walked = sink_window.kv_positions(kv_len, q_len, num_sink, window_left)
    assert len(walked) == span and np.all(np.diff(walked) > 0) and walked[-1] == kv_len - 1
    assert np.all((walked - np.arange(span)) % sink_window.GAP_ALIGN == 0)  # key = span position mod 16


def test_sink_window_template_rounds_the_gap_like_the_host():
    template = (template_root() / "masks" / "sink_window.cuh.j2").read_text()
    assert f"gap - gap % {sink_window.GAP_ALIGN}" in template


def test_sink_window_kv_span_rejects_stale_first_q_pos():
    params = sink_window.sink_window_params([100, 7], 1, num_sink=4, window_left=8, device="cpu")
    with pytest.raises(ValueError, match="first_q_pos: expected kv_len - q_len"):
        sink_window.kv_span(np.array([101, 7]), np.array([1, 1]), params)


# ---- built-ins: registry entries, render, compile ----------------------------------------------

@pytest.mark.parametrize("name", [name for name in BUILT_IN_MASKS if masks.get(name).params])
def test_built_ins_with_params_have_a_span_a_predicate_and_a_sampler(name):
    """Their parameters (tests/masks/test_registry.py) narrow what a request reads: the planner walks the
    span, the reference applies the predicate, and check-mask and the GPU tests sample the values."""
    mask = masks.get(name)
    assert mask.template == f"masks/{name}.cuh.j2"
    assert mask.kv_span and mask.reference and mask.sample_params


@pytest.mark.parametrize("name", [name for name in BUILT_IN_MASKS if masks.get(name).sample_params])
def test_built_in_samplers_fit_their_masks(name):
    mask = masks.get(name)
    rng = random.Random(1)
    kv_lens = cm.random_lengths(rng, 16)
    q_lens = [min(4, n) for n in kv_lens]
    params = mask.sample_params(rng, kv_lens, q_lens, 16, "cpu")
    assert set(params) == set(mask.param_names)
    if mask.kv_span:
        begin, end = mask.kv_span(np.array(kv_lens), np.array(q_lens), params)
        assert np.all(begin >= 0) and np.all(end >= begin)


TENSOR_PARAM_MASKS = tuple(name for name in BUILT_IN_MASKS if name not in SCALAR_PARAM_MASKS)


@pytest.fixture(scope="module")
def mask_cache(tmp_path_factory) -> tuple[Path, list, list]:
    """A cache holding what `check-mask NAME --arch sm_90` compiles for every built-in with tensor
    parameters, compiled in parallel once."""
    cache_dir = tmp_path_factory.mktemp("mask-cache")
    specs = [spec for name in TENSOR_PARAM_MASKS for spec in cm.compile_specs(name, ["sm_90"])]
    return cache_dir, specs, cm.compile_all(Engine(cache_dir=cache_dir), specs)


def test_tensor_param_built_ins_render_and_compile(mask_cache):
    """Each kernel reads its mask's tensors through the read-only cache, on both kernel kinds."""
    cache_dir, specs, results = mask_cache
    assert {(s.mask, s.tensor_cores) for s in specs} == set(itertools.product(TENSOR_PARAM_MASKS, (False, True)))
    assert [r.result for r in results] == ["compiled"] * len(specs), [r.error for r in results]
    engine = Engine(cache_dir=cache_dir)
    for spec in specs:
        assert engine.get_kernel(spec).cubin[:4] == b"\x7fELF"
        source = engine.source(spec)
        assert f"// mask: {spec.mask}" in source
        tensors = [p.name for p in masks.get(spec.mask).params if p.kind.endswith("tensor")]
        assert tensors and all(f"__ldg(params.{name}" in source for name in tensors), spec.name


# ---- the host replay ----------------------------------------------------------------------------

@needs_cxx
@pytest.mark.parametrize("name", BUILT_IN_MASKS)
def test_host_check_passes_built_ins(name):
    result = cm.check_on_host(name)
    assert result.requests > 20 and not result.skipped
    assert result.passed, "\n".join(result.failures)


@needs_cxx
def test_host_check_catches_a_span_that_misses_keys(isolated_masks):
    def short_span(kv_lens, q_lens, params):
        begin, end = sink_window.kv_span(kv_lens, q_lens, params)
        return begin, np.maximum(end - 1, 0)

    register_mask("short_sink", template=ROOT / "templates/masks/sink_window.cuh.j2", params=sink_window.PARAMS,
                  kv_span=short_span, reference=sink_window.reference, sample_params=sink_window.sample_params)
    result = cm.check_on_host("short_sink")
    assert not result.passed and "never read" in result.failures[0]


@needs_cxx
def test_host_check_catches_keys_read_twice(isolated_masks, tmp_path):
    path = tmp_path / "dup.cuh.j2"
    path.write_text('{% extends "masks/base.cuh.j2" %}\n{% block kv_position %}  return v / 2;{% endblock %}\n')
    register_mask("dup", template=path, reference=lambda q, k, r, p: k <= q)
    failures = "\n".join(cm.check_on_host("dup", max_failures=1000).failures)
    assert "more than once" in failures and "not increasing" in failures and "never read" in failures


@needs_cxx
def test_host_check_skips_device_only_code(isolated_masks, mask_file, tmp_path):
    register_mask("device_only", mask_file(tmp_path, "device_only", "return __shfl_sync(0xffffffffu, 1, 0);"))
    result = cm.check_on_host("device_only")
    assert result.skipped.startswith("the mask's hooks do not compile for the host") and result.passed


def test_host_check_without_a_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cm.build_host_library.cache_clear()
    try:
        result = cm.check_on_host("causal")
    finally:
        cm.build_host_library.cache_clear()
    assert result.skipped.startswith("no host C++ compiler") and result.passed


# ---- parameters for checks ----------------------------------------------------------------------

def test_parse_overrides_types_and_rejects():
    mask = masks.get("sink_window")
    assert cm.parse_overrides(mask, ["num_sink=4", "window_left=100"]) == {"num_sink": 4, "window_left": 100}
    assert cm.parse_overrides(mask, {"num_sink": "2"}) == {"num_sink": 2}
    for bad in (["nope=1"], ["num_sink"], ["num_sink=1.5"], ["first_q_pos=3"]):
        with pytest.raises(SpecError):
            cm.parse_overrides(mask, bad)


def test_sample_params_defaults_and_overrides(isolated_masks, mask_file, tmp_path):
    mask = register_mask("ints", mask_file(tmp_path, "ints", "return true;"), {"a": "int", "b": "float"})
    params = cm.sample_params(mask, random.Random(0), [5], [1], 16, "cpu", {"a": 9})
    assert params["a"] == 9 and params["b"] in cm.DEFAULT_FLOATS
    tensors = register_mask("tensors", mask_file(tmp_path, "tensors", "return true;"), {"t": "int_tensor"})
    with pytest.raises(SpecError, match="sample_params"):
        cm.sample_params(tensors, random.Random(0), [5], [1], 16, "cpu")


def test_random_cases_cover_the_grid():
    cases = cm.random_cases(0)
    assert {(c.group, c.q_len, c.page_size) for c in cases} == {
        (g, q, p) for g in cm.GROUPS for q in cm.Q_LENS for p in cm.PAGE_SIZES}
    assert {c.tensor_cores for c in cases} == {False, True}
    assert cm.random_cases(0) == cases  # reproducible
    lengths = cm.random_lengths(random.Random(0), 16)
    assert {0, 1, 16, 49} <= set(lengths)


def test_a_variant_check_cycles_through_every_built_in_mask():
    from flashjit.deploy.mask_check.cases import VARIANT_MASKS

    assert sorted(VARIANT_MASKS) == sorted(BUILT_IN_MASKS)


# ---- flashjit check-mask on the CPU -------------------------------------------------------------

def test_cli_check_mask_compiles_and_skips_the_gpu(mask_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(mask_cache[0], cache)  # holds tree's two kernels
    code, out, err = run_cli("check-mask", "tree", "--arch", "sm_90", "--cache-dir", cache)
    assert code == 0, err
    assert "decode_d128_bf16_kvbf16_tree_p16_g4_q4_nhd_sm90 " in out
    assert "decode_d128_bf16_kvbf16_tree_p16_g4_q4_nhd_sm90_tc" in out
    table = out.split("host check")[0]
    assert table.count("hit (disk)") == 2 and " compiled " not in table  # both kernels came from the cache
    assert "skipped the GPU check" in out
    assert "host check" in out and out.rstrip().endswith("check-mask tree: PASS")


@pytest.mark.parametrize("argv, message", [
    (["check-mask", "no_such_mask"], "mask='no_such_mask'"),
    (["check-mask", "sink_window", "--params", "num_sink=x"], "an int in 0..2147483647 value for 'num_sink'"),
    (["check-mask", "tree", "--arch", "sm_7"], "arch"),
])
def test_cli_check_mask_bad_arguments(argv, message, tmp_path):
    code, out, err = run_cli(*argv, "--cache-dir", tmp_path / "cache")
    assert code == 2 and message in err


def test_check_mask_report_fails_on_compile_errors(isolated_masks, mask_file, tmp_path):
    register_mask("broken", mask_file(tmp_path, "broken", "return undeclared_thing;"))
    report = cm.check_mask("broken", archs="sm_90", engine=Engine(cache_dir=tmp_path / "cache"))
    assert not report.passed
    assert any(c.result == "FAIL" for c in report.compiled)
    assert report.failures()[0].startswith("FAIL compile decode_")


# ---- the worked example of docs/masks.md ---------------------------------------------------------

def test_worked_example_mask(isolated_masks, tmp_path):
    spec_ = importlib.util.spec_from_file_location("chunked_example", ROOT / "examples/masks/chunked.py")
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    mask = module.register()
    assert isinstance(mask, MaskDef) and mask.params == (MaskParam("chunk", "int"),)
    begin, end = mask.kv_span(np.array([1000, 3]), np.array([1, 2]), {"chunk": 256})
    assert begin.tolist() == [768, 0] and end.tolist() == [1000, 3]
    with pytest.raises(ValueError, match="chunk"):
        mask.kv_span(np.array([10]), np.array([1]), {"chunk": 0})
    if cm.host_compiler():
        result = cm.check_on_host("chunked")
        assert result.passed, "\n".join(result.failures)
    kernel = Engine(cache_dir=tmp_path / "cache").get_kernel(
        DecodeSpec(128, mask="chunked", group_size=4, max_q_len=2, arch="sm_90", tensor_cores=False))
    assert kernel.cubin[:4] == b"\x7fELF"


def test_docs_name_every_built_in():
    text = (ROOT / "docs/masks.md").read_text()
    for name in BUILT_IN_MASKS + BUILT_IN_VARIANTS:
        assert f"`{name}`" in text
    assert "flashjit.masks" in text and "check-mask" in text
    assert flashjit.register_mask is register_mask


# ---- the GPU runner's wiring, with the reference standing in for the kernel ------------------------

class _ReferenceDecoder:
    """BatchDecode's plan/run surface computed by decode_reference on the CPU; `drop_key` misses one key."""

    drop_key: int | None = None

    def __init__(self, engine, device=None):
        self.spec = DecodeSpec(128, mask="none", arch="sm_90")

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, qo_indptr,
             mask, mask_params, q_dtype, kv_layout, tensor_cores, chunk_tokens=None, disable_split_kv=False,
             fixed_split_tokens=None, kv_dtype=None):
        self.args = (indptr, indices, last_page_len, qo_indptr, mask, mask_params, kv_layout)
        mask_def = masks.get(mask)
        if mask_def.kv_span:  # plan() validates the parameters through kv_span
            kv_lens = np.array([(n - 1) * page_size + int(l) if n else 0
                                for n, l in zip(np.diff(np.asarray(indptr)), last_page_len.tolist())])
            mask_def.kv_span(kv_lens, np.diff(np.asarray(qo_indptr)), mask_params)

    def run(self, q, kv_cache, *, out, lse):
        from flashjit.serving.reference import decode_reference

        indptr, indices, last, qo_indptr, mask, params, layout = self.args
        k, v = kv_cache
        if self.drop_key is not None:  # the same mask, blind to one key position of every request
            base, drop = masks.get(mask), self.drop_key
            mask = "dropped_key"
            masks.register(mask, base.template, base.params, replace=True, reference=lambda q_pos, kv_pos, r, p: (
                base.reference(q_pos, kv_pos, r, p) & (kv_pos != drop)))
        ref, ref_lse = decode_reference(q, k, v, indptr, indices, last, qo_indptr=qo_indptr, mask=mask,
                                        mask_params=params, kv_layout=layout)
        out.copy_(ref.to(out.dtype))
        lse.copy_(ref_lse)
        return out


@pytest.mark.parametrize("name", HOST_SPAN_MASKS)
def test_check_batch_wiring_on_cpu(name, monkeypatch, isolated_masks):
    """The masks whose spans the host computes from their tensors: the stand-in decoder checks their
    parameters through kv_span, as plan() does."""
    from flashjit.serving import batch_decode

    monkeypatch.setattr(batch_decode, "BatchDecode", _ReferenceDecoder)
    rng = random.Random(0)
    kv_lens = cm.random_lengths(rng, 16)
    q_lens = [min(4, n) for n in kv_lens]
    batch = flashjit.deploy.random_batches.make_batch(kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                        dtype=torch.float16, q_lens=q_lens, seed=1, device="cpu")
    params = cm.sample_params(masks.get(name), rng, kv_lens, q_lens, 16, "cpu")
    results = cm.check_batch(None, batch, name, params)
    assert sorted((r.split, r.probe) for r in results) == sorted(itertools.product(cm.SPLITS, cm.PROBES))
    assert all(r.passed for r in results), [r.failures for r in results]

    monkeypatch.setattr(_ReferenceDecoder, "drop_key", 3)
    results = cm.check_batch(None, batch, name, params)
    zero_q = [r for r in results if r.probe == "zero q"]
    assert zero_q and all(any("read another number of keys" in f for f in r.failures) for r in zero_q)


SHIFTED = """{% extends "masks/base.cuh.j2" %}
{% block state %}  int shift;{% endblock %}
{% block bind %}  params.shift = __ldg(params.starts + request);{% endblock %}
{% block kv_position %}  return v + params.shift;{% endblock %}
{% block visible %}  return kv_pos <= q_pos;{% endblock %}
"""


@needs_cxx
def test_bind_state_reaches_the_hooks_on_the_host_and_compiles(isolated_masks, tmp_path):
    """A mask whose kv_position reads a per-request value that only bind sets: the host replay
    binds as the kernels do (else every request would walk from key 0), and NVRTC compiles it."""
    path = tmp_path / "shifted.cuh.j2"
    path.write_text(SHIFTED)

    def sample(rng, kv_lens, q_lens, page_size, device):
        starts = [rng.randrange(0, max(1, n - q + 1)) for n, q in zip(kv_lens, q_lens)]
        return {"starts": torch.tensor(starts or [0], dtype=torch.int32, device=device)}

    def span(kv_lens, q_lens, params):
        starts = params["starts"].cpu().numpy()[:len(kv_lens)]
        return np.zeros_like(kv_lens), kv_lens - starts

    def reference(q_pos, kv_pos, request, params):
        return (kv_pos >= int(params["starts"][request])) & (kv_pos <= q_pos)

    register_mask("shifted", template=path, params={"starts": "int_tensor"}, kv_span=span, reference=reference,
                  sample_params=sample)
    result = cm.check_on_host("shifted")
    assert result.requests > 20 and result.passed, "\n".join(result.failures)
    source = render(DecodeSpec(128, "bf16", mask="shifted", group_size=4, arch="sm_90"))
    assert "int shift;" in source and "params.shift = __ldg(params.starts + request);" in source
    assert compile_source(source, "sm_90", "shifted").cubin[:4] == b"\x7fELF"


def test_an_unknown_mask_in_a_spec_names_the_plugins_that_failed(installed_plugin):
    with pytest.raises(SpecError) as info:
        DecodeSpec(64, mask="not_anywhere", arch="sm_90")
    assert "broken" in str(info.value) and "plugin exploded" in str(info.value)


def test_a_plugin_that_calls_sys_exit_does_not_end_the_process(plugin_masks, monkeypatch):
    def leave():
        sys.exit(3)

    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [_FakeEntryPoint("quitter", leave)])
    masks.load_plugins()
    assert "SystemExit" in masks.plugin_errors["quitter"]
    with pytest.raises(SpecError, match="quitter"):
        masks.get("not_anywhere")
