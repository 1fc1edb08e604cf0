"""Rendering: strict, sandboxed templates; errors that name the user's file and line; stable output."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from flashjit import DecodeSpec, TemplateError, register_mask
from flashjit.kernels.decode.family import ENTRY_TEMPLATE
from flashjit.jit.render import render, template_root
from flashjit.kernels.decode.tiling import decode_tiling

from built_ins import BUILT_IN_MASKS


def user_mask(tmp_path, name: str, text: str):
    path = tmp_path / f"{name}.cuh.j2"
    path.write_text(text)
    register_mask(name, path)
    return path, DecodeSpec(64, mask=name, arch="sm_90")


def test_template_root_has_entry_template():
    assert (template_root() / ENTRY_TEMPLATE).is_file()
    assert (template_root() / "masks" / "base.cuh.j2").is_file()


def test_undefined_variable_names_user_file_and_line(isolated_masks, tmp_path):
    path, spec = user_mask(tmp_path, "typo_mask", '{% extends "masks/base.cuh.j2" %}\n'
                                                  "{% block visible %}\n"
                                                  "  return kv_pos < {{ window_lft }};{% endblock %}\n")
    with pytest.raises(TemplateError) as info:
        render(spec)
    message = str(info.value)
    assert f"{path}:3" in message
    assert "window_lft" in message and spec.name in message


def test_undefined_attribute_is_an_error_too(isolated_masks, tmp_path):
    path, spec = user_mask(tmp_path, "attr_mask", '{% extends "masks/base.cuh.j2" %}\n'
                                                  "{% block visible %}  return {{ spec.window }};{% endblock %}\n")
    with pytest.raises(TemplateError) as info:
        render(spec)
    assert f"{path}:2" in str(info.value) and "window" in str(info.value)


def test_syntax_error_names_user_file_and_line(isolated_masks, tmp_path):
    path, spec = user_mask(tmp_path, "syntax_mask", '{% extends "masks/base.cuh.j2" %}\n'
                                                    "\n"
                                                    "{% block visible %}\n"
                                                    "  return {{ 1 + }};{% endblock %}\n")
    with pytest.raises(TemplateError) as info:
        render(spec)
    assert f"{path}:4" in str(info.value) and spec.name in str(info.value)


def test_sandbox_blocks_python_internals(isolated_masks, tmp_path):
    _, spec = user_mask(tmp_path, "escape_mask", '{% extends "masks/base.cuh.j2" %}\n'
                                                 "{% block visible %}{{ spec.__class__.__init__.__globals__ }}"
                                                 "{% endblock %}\n")
    with pytest.raises(TemplateError) as info:
        render(spec)
    assert "unsafe" in str(info.value)


def test_missing_parent_template(isolated_masks, tmp_path):
    _, spec = user_mask(tmp_path, "orphan_mask", '{% extends "masks/no_such_base.cuh.j2" %}\n')
    with pytest.raises(TemplateError) as info:
        render(spec)
    assert "no_such_base" in str(info.value)


def test_deleted_user_template(isolated_masks, tmp_path):
    path, spec = user_mask(tmp_path, "gone_mask", '{% extends "masks/base.cuh.j2" %}\n')
    path.unlink()
    with pytest.raises(TemplateError) as info:
        render(spec)
    assert "not found" in str(info.value) and "gone_mask" in str(info.value)


def test_edited_user_template_is_rerendered(isolated_masks, tmp_path):
    path, spec = user_mask(tmp_path, "edited_mask", '{% extends "masks/base.cuh.j2" %}\n'
                                                    "{% block visible %}  return kv_pos < 1;{% endblock %}\n")
    assert "return kv_pos < 1;" in render(spec)
    path.write_text('{% extends "masks/base.cuh.j2" %}\n{% block visible %}  return kv_pos < 22;{% endblock %}\n')
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse-grained filesystems
    assert "return kv_pos < 22;" in render(spec)


# A line of each built-in mask's hooks, as its template writes it.
HOOK_BODIES = {
    "none": "return true;",
    "causal": "return kv_pos <= q_pos;",
    "sliding_window": "return kv_pos <= q_pos && kv_pos >= q_pos - params.window_left;",
    "block_sparse": "params.block_indices",
    "tree": "__ldg(params.tree_mask + __ldg(params.tree_qo_indptr + request) + q_idx)",
    "sink_window": "(kv_pos < params.num_sink || q_pos - kv_pos <= params.window_left)",
    "key_range": "kv_pos >= __ldg(params.range_begin + t) && kv_pos < __ldg(params.range_end + t)",
}


def test_every_built_in_mask_has_its_hooks_checked():
    assert sorted(HOOK_BODIES) == sorted(BUILT_IN_MASKS)


@pytest.mark.parametrize("mask, hook_body", HOOK_BODIES.items())
def test_source_contains_spec_name_and_mask_hooks(mask, hook_body):
    spec = DecodeSpec(128, mask=mask, group_size=4, arch="sm_90")
    source = render(spec)
    assert spec.name in source.splitlines()[0]
    assert f"// mask: {mask}" in source
    assert "FJ_INLINE bool mask_visible(" in source and "FJ_INLINE int mask_kv_position(" in source
    assert hook_body in source
    assert "constexpr int HEAD_DIM = 128;" in source and "constexpr int GROUP_SIZE = 4;" in source


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_source_is_self_contained(tensor_cores):
    source = render(DecodeSpec(128, mask="causal", arch="sm_90", tensor_cores=tensor_cores))
    assert "#include" not in source  # headers are inlined: the text alone determines the cubin
    # no Jinja left: "{{ x }}", "{% tag", "{# note"; C++ nested initializers ("{{0.f, ...") and
    # inline PTX operands ("{%0, %1}") are not Jinja
    assert not re.search(r"\{\{ |\{%[-\s]|\{#", source)


@pytest.mark.parametrize("dtype, kv_dtype, q_type, kv_type", [
    ("bf16", "bf16", "bfloat16_t", "bfloat16_t"),
    ("fp16", "fp16", "half_t", "half_t"),
    ("fp16", "bf16", "half_t", "bfloat16_t"),
])
def test_storage_types(dtype, kv_dtype, q_type, kv_type):
    source = render(DecodeSpec(64, dtype=dtype, kv_dtype=kv_dtype, arch="sm_90"))
    assert f"typedef fj::{q_type} q_t;" in source and f"typedef fj::{kv_type} kv_t;" in source


def test_specs_render_differently():
    base = DecodeSpec(128, arch="sm_90")
    sources = {render(base.replace(**change)) for change in
               ({}, {"page_size": 32}, {"group_size": 8}, {"head_dim": 64}, {"mask": "causal"}, {"dtype": "fp16"})}
    assert len(sources) == 6


def test_rendering_is_deterministic():
    spec = DecodeSpec(128, mask="sliding_window", group_size=8, max_q_len=2, arch="sm_90")
    first = render(spec)
    assert render(spec) == first
    code = ("import sys; from flashjit import DecodeSpec; from flashjit.jit.render import render; "
            "sys.stdout.write(render(DecodeSpec(128, mask='sliding_window', group_size=8, max_q_len=2, arch='sm_90')))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="777", PYTHONPATH=os.pathsep.join(sys.path)))
    assert other.stdout == first


def entry_bodies(source: str) -> dict[str, str]:
    """Each `extern "C" __global__` entry point's body, by name."""
    bodies = {}
    for match in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(', source):
        start = source.index("{", match.end())
        depth, end = 0, start
        for end in range(start, len(source)):
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            if depth == 0:
                break
        bodies[match.group(1)] = source[start + 1:end]
    return bodies


@pytest.mark.parametrize("family", ["decode", "shared prefix", "cuda cores", "mla", "merge states"])
def test_every_entry_point_waits_for_the_previous_kernel_before_anything_else(family):
    """The launches allow programmatic dependent launch from sm_90 (kernel.PreparedLaunch): a kernel's
    CTAs may start before the previous kernel's writes land, so each entry point's first statement
    (after the timeline's stamp) is the wait. flashjit_merge reads the plan's arrays first, which the
    decode kernel it waits for does not write: merge::locate reads those and nothing else."""
    from flashjit.kernels.merge_states.spec import MergeSpec
    from flashjit.kernels.mla.spec import MLASpec

    if family == "mla":
        source = render(MLASpec(16, arch="sm_90"))
    elif family == "merge states":
        source = render(MergeSpec("bf16", "sm_90"))
    else:
        source = render(DecodeSpec(128, group_size=4, arch="sm_90", shared_prefix=family == "shared prefix",
                                   tensor_cores=family != "cuda cores"))
    bodies = entry_bodies(source)
    expected = {"mla": {"flashjit_plan"}, "merge states": {"flashjit_merge_states"},
                "shared prefix": {"flashjit_decode", "flashjit_merge", "flashjit_plan"}}
    assert expected.get(family, {"flashjit_decode", "flashjit_plan"}) <= set(bodies) and len(bodies) >= 1 + (
        family == "mla")
    for name, body in bodies.items():
        body = re.sub(r"//[^\n]*", "", body)  # comments
        statements = [s.strip() for s in body.split(";") if s.strip() and not s.strip().startswith("FJ_STAMP")]
        if name == "flashjit_merge":
            assert statements[0].startswith("const merge::Target target = merge::locate(args)"), statements[:2]
            statements = statements[1:]
            start = source.index("FJ_INLINE Target locate(const Args& a) {")
            locate = source[start:source.index("\n}\n", start)]
            assert set(re.findall(r"a\.(\w+)", locate)) == {"num_tokens", "token_request", "req_qo_indptr",
                                                          "req_work_indptr", "num_qo_heads"}, locate
        assert statements[0] == "wait_for_previous_kernel()", (name, statements[:2])


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_shared_prefix_kernels_prefetch_the_plan_after_the_wait(shared_prefix):
    """A shared-prefix kernel's CTAs pull the records and page ids into L2 for the CTAs after the
    first wave (decode::prefetch_plan): after the wait, as every global access is; other kernels do
    not, and their source has no such call."""
    source = render(DecodeSpec(128, group_size=4, arch="sm_90", shared_prefix=shared_prefix, tensor_cores=True))
    body = re.sub(r"//[^\n]*", "", entry_bodies(source)["flashjit_decode"])
    statements = [s.strip() for s in body.split(";") if s.strip() and not s.strip().startswith("FJ_STAMP")]
    assert statements[0] == "wait_for_previous_kernel()"
    assert ("decode::prefetch_plan<1>(args)" in statements) == shared_prefix
    if shared_prefix:
        assert statements.index("decode::prefetch_plan<1>(args)") < statements.index("decode::attend(args, params, vparams)")
        assert "prefetch.global.L2::evict_last" in source and "a.num_page_ids" in source


@pytest.mark.parametrize("head_dim, shared_prefix, packed", [(128, True, True), (64, True, True), (96, True, False),
                                                            (128, False, False)])
def test_kernels_that_pack_heads_have_a_packed_entry_point_alike_but_for_its_attend(head_dim, shared_prefix, packed):
    """A shared-prefix kernel whose tiling packs own items' heads has a second decode entry point,
    flashjit_decode_packed, the same as flashjit_decode but calling attend_packed and prefetching
    the records of its grid (a plan with packed items launches it); other kernels have none."""
    spec = DecodeSpec(head_dim, group_size=4, arch="sm_90", shared_prefix=shared_prefix, tensor_cores=True)
    bodies = entry_bodies(render(spec))
    assert (decode_tiling(spec).packed_entry == "flashjit_decode_packed") == packed
    assert ("flashjit_decode_packed" in bodies) == packed
    if packed:
        plain = bodies["flashjit_decode"]
        assert bodies["flashjit_decode_packed"] == plain.replace("decode::attend(", "decode::attend_packed(").replace(
            "prefetch_plan<1>", "prefetch_plan<cfg::OWN_HEAD_PACK>")
        assert "decode::attend_packed(" in bodies["flashjit_decode_packed"]


HEADERS = sorted(path for path in template_root().rglob("*.cuh"))


@pytest.mark.parametrize("path", HEADERS, ids=lambda p: str(p.relative_to(template_root())))
def test_every_header_states_the_headers_it_needs(path):
    """Each header's first line names what must be pasted before it: headers that exist, none that
    needs it in turn (the order the entry templates paste them is one the needs allow)."""
    from flashjit.jit.render import NEEDS, header_needs

    root = template_root()
    first = path.read_text().partition("\n")[0]
    assert first.startswith(NEEDS), f"{path.name}: the first line is not '{NEEDS} ...'"
    needs, _ = header_needs(path.read_text())
    name = str(path.relative_to(root))
    for need in needs:
        assert (root / need).is_file(), f"{name} needs {need}, which is not a template"
        assert name not in header_needs((root / need).read_text())[0], f"{name} and {need} need each other"


def test_the_needs_line_stays_out_of_the_source():
    for spec in (DecodeSpec(128, group_size=4, arch="sm_90"), DecodeSpec(128, arch="sm_80", tensor_cores=False)):
        source = render(spec)
        assert "//! needs:" not in source and "// flashjit prelude: self-contained" in source


def test_a_header_pasted_before_what_it_needs_is_an_error(tmp_path, monkeypatch):
    """A template that pastes the decode kernel before the work-list core it builds on fails to
    render, naming both."""
    from flashjit.jit import render as render_module

    entry = template_root() / "decode" / "entry.cu.j2"
    text = entry.read_text()
    core = '{{ header("worklist/kernel_core.cuh") }}\n'
    assert core in text
    wrong = text.replace(core, "").replace('{{ header("worklist/device_plan.cuh") }}',
                                           '{{ header("worklist/device_plan.cuh") }}\n' + core.strip())
    monkeypatch.setattr(render_module.environment().loader, "get_source",
                        _serving(render_module.environment().loader.get_source, "decode/entry.cu.j2", wrong))
    render_module.environment().cache.clear()
    try:
        with pytest.raises(TemplateError, match="needs .*worklist/kernel_core.cuh pasted before it"):
            render(DecodeSpec(128, arch="sm_80", tensor_cores=False))
    finally:
        monkeypatch.undo()
        render_module.environment().cache.clear()


def _serving(get_source, name, text):
    """get_source, with one template's text replaced."""
    def patched(environment, asked):
        if asked == name:
            return text, name, lambda: False
        return get_source(environment, asked)
    return patched


@pytest.mark.parametrize("body", [
    '{% include "SELF" %}',  # a template that includes itself
    "{% macro again(n) %}{{ again(n + 1) }}{% endmacro %}{{ again(0) }}",  # a macro without a base case
], ids=["include", "macro"])
def test_endless_recursion_is_one_error_naming_the_template(isolated_masks, tmp_path, body):
    path = tmp_path / "endless.cuh.j2"
    text = '{% extends "masks/base.cuh.j2" %}\n{% block visible %}' + body + "{% endblock %}\n"
    path.write_text(text.replace("SELF", str(path)))
    register_mask("endless", path)
    with pytest.raises(TemplateError) as info:
        render(DecodeSpec(64, mask="endless", arch="sm_90"))
    message = str(info.value)
    assert str(path) in message and "recurs" in message and "\n" not in message and len(message) < 600, message
    assert not isinstance(info.value.__cause__, RecursionError) or info.value.__suppress_context__
