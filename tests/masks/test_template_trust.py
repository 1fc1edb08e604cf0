"""Template trust: what a mask template may load, folders that cannot shadow a built-in, and bad
template folders that are reported every time while the built-ins keep working."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from flashjit import DecodeSpec, Engine, SpecError, TemplateError, register_mask
from flashjit.jit.render import render
from flashjit.masks.registry import TemplateFolderError, masks

from child_processes import run_children

SECRET = "flashjit-test-secret-7c1e"
BASE = '{% extends "masks/base.cuh.j2" %}\n'

# Each way a template can pull in another file, aimed at PATH.
LOADS = {
    "header": BASE + '{% block visible %}{{ header("PATH") }}  return true;{% endblock %}\n',
    "include": BASE + '{% block visible %}{% include "PATH" %}  return true;{% endblock %}\n',
    "import": '{% import "PATH" as leaked %}' + BASE,
    "from_import": '{% from "PATH" import leaked %}' + BASE,
    "extends": '{% extends "PATH" %}\n',
}


def aimed(how: str, path) -> str:
    return LOADS[how].replace("PATH", str(path))


@pytest.fixture
def secret(tmp_path):
    """A readable file outside every template root."""
    path = tmp_path / "private" / "secret.txt"
    path.parent.mkdir()
    path.write_text(f"{SECRET}\n")
    return path


def load_mask(route: str, folder, name: str, text: str, monkeypatch) -> DecodeSpec:
    """A mask of template `text`, registered from Python or found in a FLASHJIT_TEMPLATE_PATH folder."""
    path = folder / f"{name}.cuh.j2"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if route == "register_mask":
        register_mask(name, template=path)
    else:
        monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", str(folder))
    return DecodeSpec(64, mask=name, arch="sm_90")


# ---- what a template may load ---------------------------------------------------------------------

@pytest.mark.parametrize("route", ["register_mask", "folder"])
@pytest.mark.parametrize("how", LOADS)
def test_a_template_cannot_load_a_file_outside_the_template_roots(isolated_masks, tmp_path, monkeypatch, secret,
                                                                   route, how):
    spec = load_mask(route, tmp_path / "masks_here", "leaky", aimed(how, secret), monkeypatch)
    with pytest.raises(TemplateError) as info:
        render(spec)
    message = str(info.value)
    assert str(secret) in message and "outside the template roots" in message and spec.name in message


def test_a_refused_file_reaches_neither_the_cache_nor_a_compile(isolated_masks, tmp_path, monkeypatch, secret,
                                                                cache_dir, fake_nvrtc):
    spec = load_mask("folder", tmp_path / "masks_here", "leaky", aimed("header", secret), monkeypatch)
    with pytest.raises(TemplateError):
        Engine(cache_dir=cache_dir).get_kernel(spec)
    assert fake_nvrtc == []
    stored = [p for p in cache_dir.rglob("*") if p.is_file()] if cache_dir.exists() else []
    assert not any(SECRET.encode() in p.read_bytes() for p in stored)


def test_relative_names_stay_inside_the_package_templates(isolated_masks, tmp_path, monkeypatch):
    spec = load_mask("register_mask", tmp_path, "climber", aimed("header", "../../../../etc/hostname"),
                     monkeypatch)
    with pytest.raises(TemplateError) as info:
        render(spec)
    assert "not found" in str(info.value)


def test_a_template_may_load_a_registered_mask_template(isolated_masks, tmp_path, monkeypatch, mask_file):
    shared = mask_file(tmp_path / "shared", "shared_part", "return kv_pos != 5;")
    register_mask("shared_part", template=shared)
    spec = load_mask("register_mask", tmp_path / "user", "reuses", f'{{% extends "{shared}" %}}\n', monkeypatch)
    assert "return kv_pos != 5;" in render(spec)


def test_a_folder_file_linking_out_of_the_folder_is_refused(isolated_masks, tmp_path, secret):
    folder = tmp_path / "linked"
    folder.mkdir()
    (folder / "leak.cuh.j2").symlink_to(secret)
    with pytest.raises(TemplateFolderError) as info:
        masks.add_template_dir(folder)
    assert str(folder / "leak.cuh.j2") in str(info.value) and "outside the folder" in str(info.value)
    assert "leak" not in masks


def test_a_link_inside_the_folder_is_fine(isolated_masks, tmp_path, mask_file):
    target = mask_file(tmp_path / "linked" / "impl", "impl_file", "return kv_pos < 3;")
    (tmp_path / "linked" / "alias.cuh.j2").symlink_to(target)
    assert [m.name for m in masks.add_template_dir(tmp_path / "linked")] == ["alias"]
    assert "return kv_pos < 3;" in render(DecodeSpec(64, mask="alias", arch="sm_90"))


# ---- built-ins cannot be shadowed by a folder -------------------------------------------------------

def test_a_template_dirs_file_cannot_replace_a_built_in(isolated_masks, tmp_path, mask_file):
    folder = tmp_path / "shadow"
    shadow = mask_file(folder, "causal", "return true;")
    mask_file(folder, "sibling", "return true;")
    with pytest.raises(TemplateFolderError) as info:
        Engine(cache_dir=tmp_path / "cache", template_dirs=[folder])
    message = str(info.value)
    assert info.value.field == "template_dirs"
    assert str(shadow) in message and "built-in mask 'causal'" in message and "replace=True" in message
    assert masks.get("causal").template == "masks/causal.cuh.j2"
    assert "sibling" not in masks  # a folder that cannot be used registers none of its masks


def test_a_template_path_file_cannot_replace_a_built_in(isolated_masks, tmp_path, mask_file, monkeypatch):
    shadow = mask_file(tmp_path / "shadow" / "masks", "causal", "return kv_pos == 12345;")
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", str(tmp_path / "shadow"))
    spec = DecodeSpec(64, mask="causal", arch="sm_90")
    assert masks.get("causal").template == "masks/causal.cuh.j2"
    source = render(spec)
    assert "return kv_pos <= q_pos;" in source and "12345" not in source
    for _ in range(2):
        with pytest.raises(TemplateFolderError) as info:
            masks.names()
        assert str(shadow) in str(info.value) and "built-in mask 'causal'" in str(info.value)


def test_a_built_in_is_still_replaced_on_purpose(isolated_masks, tmp_path, mask_file):
    register_mask("causal", template=mask_file(tmp_path, "causal", "return kv_pos == 7;"), replace=True)
    assert "return kv_pos == 7;" in render(DecodeSpec(64, mask="causal", arch="sm_90"))


def test_a_folder_mask_still_replaces_an_earlier_folder_mask(isolated_masks, tmp_path, mask_file):
    mask_file(tmp_path / "a", "twice", "return kv_pos == 1;")
    mask_file(tmp_path / "b", "twice", "return kv_pos == 2;")
    masks.add_template_dir(tmp_path / "a")
    masks.add_template_dir(tmp_path / "b")
    assert "return kv_pos == 2;" in render(DecodeSpec(64, mask="twice", arch="sm_90"))


# ---- bad folders: reported every time, built-ins unaffected ------------------------------------------

def bad_folder(tmp_path, kind: str):
    """(folder, the path the error must name) for each way a FLASHJIT_TEMPLATE_PATH entry can be bad."""
    folder = tmp_path / f"bad_{kind}"
    if kind == "missing":
        return folder, folder
    if kind == "not_a_folder":
        folder.write_text("a file\n")
        return folder, folder
    folder.mkdir()
    path = folder / "in_bad_folder.cuh.j2"
    if kind == "bad_kind":
        path.write_text("{# params: w:double #}\n" + BASE)
    elif kind == "bad_name":
        path.write_text("{# params: 9lives:int #}\n" + BASE)
    elif kind == "repeated_name":
        path.write_text("{# params: w:int w:float #}\n" + BASE)
    elif kind == "undecodable":
        path.write_bytes(b"{# params: w:int #}\n\xff\xfe" + BASE.encode())
    elif kind == "directory":
        path.mkdir()
    return folder, path


BAD_KINDS = ["missing", "not_a_folder", "bad_kind", "bad_name", "repeated_name", "undecodable", "directory"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_template_path_folder_keeps_built_ins_and_other_folders(isolated_masks, tmp_path, mask_file,
                                                                      monkeypatch, kind):
    folder, named = bad_folder(tmp_path, kind)
    mask_file(tmp_path / "good", "from_good_folder", "return true;")
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", os.pathsep.join([str(folder), str(tmp_path / "good")]))
    for _ in range(3):  # every time, not once
        for name in ("none", "causal", "from_good_folder"):  # the folder after the bad one still loads
            assert DecodeSpec(64, mask=name, arch="sm_90").mask == name
        with pytest.raises(SpecError) as info:
            DecodeSpec(64, mask="in_bad_folder", arch="sm_90")
        assert str(named) in str(info.value) and "is not supported; accepted: none" not in str(info.value)
        with pytest.raises(SpecError) as info:
            masks.get("in_bad_folder")
        assert info.value.field == "mask" and str(named) in str(info.value)
        with pytest.raises(TemplateFolderError) as info:
            masks.names()
        assert info.value.field == "FLASHJIT_TEMPLATE_PATH" and str(named) in str(info.value)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_template_dirs_folder_raises_naming_it(isolated_masks, tmp_path, mask_file, kind):
    folder, named = bad_folder(tmp_path, kind)
    if folder.is_dir():
        mask_file(folder, "good_sibling", "return true;")
    for _ in range(2):
        with pytest.raises(TemplateFolderError) as info:
            Engine(cache_dir=tmp_path / "cache", template_dirs=[folder])
        assert info.value.field == "template_dirs" and str(named) in str(info.value)
    assert "good_sibling" not in masks and "in_bad_folder" not in masks


def test_a_fixed_template_path_stops_reporting(isolated_masks, tmp_path, mask_file, monkeypatch):
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", str(tmp_path / "missing"))
    with pytest.raises(TemplateFolderError):
        masks.names()
    mask_file(tmp_path / "good", "fixed", "return true;")
    monkeypatch.setenv("FLASHJIT_TEMPLATE_PATH", str(tmp_path / "good"))
    assert "fixed" in masks.names()


def test_a_fifo_in_a_template_folder_does_not_block(isolated_masks, tmp_path):
    folder = tmp_path / "fifo"
    folder.mkdir()
    os.mkfifo(folder / "pipe.cuh.j2")
    outcome = []

    def scan():
        try:
            masks.add_template_dir(folder)
        except TemplateFolderError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=scan, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # unblock the reader so the test process can exit
        with open(folder / "pipe.cuh.j2", "w"):
            pass
        pytest.fail("scanning a template folder blocked on a FIFO")
    assert outcome and str(folder / "pipe.cuh.j2") in str(outcome[0]) and "regular file" in str(outcome[0])


def _add_folder_as_nobody(folder, results):
    try:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        masks.add_template_dir(folder)
        results.put("no error")
    except TemplateFolderError as exc:
        results.put(f"TemplateFolderError: {exc}")
    except BaseException as exc:  # noqa: BLE001 (reported to the test)
        results.put(f"{type(exc).__name__}: {exc}")


def test_a_template_folder_that_cannot_be_listed_is_named(shared_tmp, isolated_masks):
    """A folder the user may enter but not list would look empty: its masks would silently be missing."""
    folder = shared_tmp / "masks-folder"
    folder.mkdir()
    (folder / "hidden_mask.cuh.j2").write_text('{% extends "masks/base.cuh.j2" %}\n')
    folder.chmod(0o711)
    fork = multiprocessing.get_context("fork")
    results = fork.Queue()
    child = fork.Process(target=_add_folder_as_nobody, args=(folder, results))
    [outcome] = run_children([child], results, timeout=60)
    assert outcome.startswith("TemplateFolderError") and str(folder) in outcome and "list" in outcome, outcome
