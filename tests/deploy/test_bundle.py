"""Cache bundles: export/import round trips, strict serving after import, verification, and
crafted bundles that try to write outside the cache dir (every one refused, nothing written)."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

import flashjit.jit.engine as engine_module
from flashjit import DecodeSpec, Engine, KernelNotPrewarmed
from flashjit.deploy import bundle as bundle_module
from flashjit.deploy.bundle import HEADER, BundleError, export_bundle, import_bundle
from flashjit.jit.cache import SCHEMA, KernelCache
from flashjit.errors import CacheError

from build_box import OTHER_SPECS

KEY = "a" * 64


def cubins(cache_dir) -> dict[str, bytes]:
    cache = KernelCache(cache_dir)
    return {e["name"]: cache.load(e["key"])[0] for e in cache.entries()}


def forbid_render_and_nvrtc(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("an imported bundle's index must spare rendering and NVRTC")

    monkeypatch.setattr(engine_module, "source_of", forbidden)  # every family renders through it
    monkeypatch.setattr(engine_module, "nvrtc_version", forbidden)


# ---- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("strict", ["argument", "FLASHJIT_NO_COMPILE"])
def test_imported_bundle_serves_every_spec_in_strict_mode(built, tmp_path, monkeypatch, compile_log, strict):
    source_dir, specs = built
    report = export_bundle(tmp_path / "kernels.tar.gz", source_dir)
    assert sorted(e["name"] for e in report.entries) == sorted(s.name for s in specs)
    assert report.index_files == len(specs) and report.bytes == (tmp_path / "kernels.tar.gz").stat().st_size

    imported = import_bundle(tmp_path / "kernels.tar.gz", tmp_path / "gpu-host")
    assert sorted(imported.imported) == sorted(s.name for s in specs)
    assert imported.rejected == [] and imported.index_files == len(specs)

    forbid_render_and_nvrtc(monkeypatch)
    if strict == "argument":
        engine = Engine(cache_dir=tmp_path / "gpu-host", allow_compile=False)
    else:
        monkeypatch.setenv("FLASHJIT_NO_COMPILE", "1")
        engine = Engine(cache_dir=tmp_path / "gpu-host")
    results = engine.prewarm(specs, jobs=2)
    assert [r.source for r in results] == ["disk"] * len(specs)
    assert compile_log() == []  # the INFO 'compiling' line never appeared
    assert {s.name: engine.get_kernel(s).cubin for s in specs} == cubins(source_dir)


def test_bundle_layout_is_relative_and_versioned(built, tmp_path):
    export_bundle(tmp_path / "b.tar.gz", built[0])
    with tarfile.open(tmp_path / "b.tar.gz") as tar:
        members = tar.getmembers()
        header = json.loads(tar.extractfile(HEADER).read())
    assert members[0].name == HEADER and all(m.isfile() for m in members)
    assert all(m.name == HEADER or m.name.startswith(f"v{SCHEMA}/entries/") or m.name.startswith(f"v{SCHEMA}/index/")
               for m in members)
    assert header["format"] == bundle_module.BUNDLE_FORMAT and header["schema"] == SCHEMA
    assert len(header["entries"]) == len(built[1]) and str(built[0]) not in json.dumps(header)


def test_export_only_the_given_specs(built, tmp_path):
    source_dir, specs = built
    chosen = specs[1:3]
    report = export_bundle(tmp_path / "b.tar.gz", source_dir, specs=chosen)
    assert [e["name"] for e in report.entries] == sorted(s.name for s in chosen)
    import_bundle(tmp_path / "b.tar.gz", tmp_path / "host")
    engine = Engine(cache_dir=tmp_path / "host", allow_compile=False)
    assert all(engine.get_kernel(s) for s in chosen)
    with pytest.raises(KernelNotPrewarmed):
        engine.get_kernel(specs[0])


def test_export_specs_found_without_index_files(built, tmp_path):
    """A cache whose index was lost still exports a manifest: the engine renders to find each key."""
    source_dir = tmp_path / "no-index"
    shutil.copytree(built[0], source_dir)
    shutil.rmtree(source_dir / f"v{SCHEMA}" / "index")
    report = export_bundle(tmp_path / "b.tar.gz", source_dir, specs=built[1])
    assert len(report.entries) == report.index_files == len(built[1])  # index files rebuilt into the bundle


def test_export_by_arch(built, tmp_path):
    report = export_bundle(tmp_path / "b.tar.gz", built[0], archs=["sm_80"])
    assert sorted(e["arch"] for e in report.entries) == ["sm_80", "sm_80"] and report.index_files == 2


def test_export_of_missing_specs_names_them_and_the_prewarm_command(built, tmp_path):
    missing = DecodeSpec(96, mask="causal", arch="sm_90")
    with pytest.raises(BundleError) as info:
        export_bundle(tmp_path / "b.tar.gz", built[0], specs=[built[1][0], missing])
    message = str(info.value)
    assert "1 of 2 specs" in message and missing.name in message
    assert f"flashjit prewarm --spec {missing.name} --cache-dir {built[0]}" in message
    assert not (tmp_path / "b.tar.gz").exists()


def test_export_of_an_empty_cache_is_an_error(cache_dir, tmp_path):
    with pytest.raises(BundleError, match="nothing to export"):
        export_bundle(tmp_path / "b.tar.gz", cache_dir)
    assert list(tmp_path.glob("*.tar.gz")) == [] and list(tmp_path.glob(".*.tmp")) == []


def test_import_twice_finds_entries_present(built, tmp_path):
    export_bundle(tmp_path / "b.tar.gz", built[0])
    import_bundle(tmp_path / "b.tar.gz", tmp_path / "host")
    again = import_bundle(tmp_path / "b.tar.gz", tmp_path / "host")
    assert again.imported == [] and len(again.present) == len(built[1])


def test_import_into_an_unusable_cache_dir(built, tmp_path, caplog):
    export_bundle(tmp_path / "b.tar.gz", built[0])
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheError, match="not writable"):
        import_bundle(tmp_path / "b.tar.gz", tmp_path / "file" / "cache")


# ---- crafted bundles --------------------------------------------------------------------------

@pytest.fixture
def good_files(built) -> dict[str, bytes]:
    """The members of a one-entry bundle (WARM_SPEC's entry and its index file)."""
    cache = KernelCache(built[0])
    entry = next(e for e in cache.entries() if e["name"] == built[1][0].name)
    files = {HEADER: json.dumps({"format": 1, "schema": SCHEMA, "flashjit": "0.1.0", "entries": []}).encode()}
    for name in ("kernel.cubin", "source.cu", "meta.json"):
        files[f"v{SCHEMA}/entries/{entry['key']}/{name}"] = (cache.entry_dir(entry["key"]) / name).read_bytes()
    spec_key = next(k for k, v in cache.index().items() if v == entry["key"])
    files[f"v{SCHEMA}/index/{spec_key}"] = entry["key"].encode()
    return files


def write_tar(path, files: dict, extra=()) -> str:
    """A .tar.gz of `files` (name -> bytes) plus `extra` (TarInfo, bytes or None) members."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return str(path)


def member(name, kind=tarfile.REGTYPE, data=b"pwned", **fields):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    for key, value in fields.items():
        setattr(info, key, value)
    return info, (data if kind == tarfile.REGTYPE else None)


def assert_nothing_written(tmp_path, cache_dir):
    assert not (tmp_path / "evil").exists() and not (tmp_path / "pwned").exists()
    cache = KernelCache(cache_dir)
    assert cache.entries() == [] and cache.index() == {}
    assert list((cache.base / "entries").iterdir()) == []


def escape_cases(tmp_path):
    key_folder = f"v{SCHEMA}/entries/{KEY}"
    return {
        "absolute path": member(str(tmp_path / "evil")),
        "dot-dot": member("../evil"),
        "dot-dot inside the layout": member(f"{key_folder}/../../../../evil"),
        "index dot-dot": member(f"v{SCHEMA}/index/../../../pwned"),
        "dot component": member(f"./{HEADER}x"),
        "symlink": member(f"{key_folder}/kernel.cubin", tarfile.SYMTYPE, linkname="/etc/passwd"),
        "symlink out": member(f"v{SCHEMA}/index/{KEY}", tarfile.SYMTYPE, linkname="../../../evil"),
        "hard link": member(f"{key_folder}/source.cu", tarfile.LNKTYPE, linkname="/etc/passwd"),
        "char device": member(f"{key_folder}/meta.json", tarfile.CHRTYPE, devmajor=1, devminor=3),
        "block device": member("evil", tarfile.BLKTYPE, devmajor=8, devminor=0),
        "fifo": member(f"{key_folder}/kernel.cubin", tarfile.FIFOTYPE),
        "folder outside the layout": member("etc", tarfile.DIRTYPE),
        "unknown file in an entry": member(f"{key_folder}/run.sh"),
        "unknown top-level file": member("evil"),
        "short key": member(f"v{SCHEMA}/entries/abc/kernel.cubin"),
        "backslash": member("..\\evil"),
    }


@pytest.mark.parametrize("case", list(escape_cases(Path("/tmp"))))
def test_crafted_member_refuses_the_whole_bundle(good_files, tmp_path, case):
    bundle = write_tar(tmp_path / "evil.tar.gz", good_files, [escape_cases(tmp_path)[case]])
    with pytest.raises(BundleError, match="refusing the bundle") as info:
        import_bundle(bundle, tmp_path / "cache")
    assert "nothing was imported" in str(info.value)
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_duplicate_member_is_refused(good_files, tmp_path):
    name = next(n for n in good_files if n.endswith("kernel.cubin"))
    bundle = write_tar(tmp_path / "dup.tar.gz", good_files, [member(name, data=b"other bytes")])
    with pytest.raises(BundleError, match="appears twice"):
        import_bundle(bundle, tmp_path / "cache")
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_oversized_member_is_refused(good_files, tmp_path, monkeypatch):
    monkeypatch.setitem(bundle_module.MAX_BYTES, "kernel.cubin", 1000)
    with pytest.raises(BundleError, match="more than the 1000"):
        import_bundle(write_tar(tmp_path / "big.tar.gz", good_files), tmp_path / "cache")
    assert_nothing_written(tmp_path, tmp_path / "cache")


@pytest.mark.parametrize("header, message", [
    ({"format": 2, "schema": SCHEMA, "flashjit": "9.0"}, "bundle format 2 (made by flashjit 9.0)"),
    ({"format": 1, "schema": SCHEMA + 1, "flashjit": "9.0"}, f"cache schema v{SCHEMA + 1}"),
    ([1, 2], "not a JSON object"),
], ids=["format", "schema", "not-an-object"])
def test_bundle_of_another_version_is_refused(good_files, tmp_path, header, message):
    files = dict(good_files, **{HEADER: json.dumps(header).encode()})
    with pytest.raises(BundleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_bundle(write_tar(tmp_path / "b.tar.gz", files), tmp_path / "cache")
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_entries_of_another_schema_are_refused(good_files, tmp_path):
    files = {name.replace(f"v{SCHEMA}/", f"v{SCHEMA + 1}/", 1): data for name, data in good_files.items()}
    with pytest.raises(BundleError) as info:
        import_bundle(write_tar(tmp_path / "b.tar.gz", files), tmp_path / "cache")
    assert f"schema v{SCHEMA + 1}" in str(info.value) and f"reads v{SCHEMA}" in str(info.value)
    assert_nothing_written(tmp_path, tmp_path / "cache")


@pytest.mark.parametrize("make", ["no header", "not gzip", "truncated", "empty"])
def test_unreadable_bundles(good_files, tmp_path, make):
    path = tmp_path / "b.tar.gz"
    if make == "no header":
        write_tar(path, {k: v for k, v in good_files.items() if k != HEADER})
    elif make == "not gzip":
        path.write_text("this is not a tarball\n")
    elif make == "truncated":
        data = Path(write_tar(tmp_path / "whole.tar.gz", good_files)).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(gzip.compress(b""))
    with pytest.raises(BundleError):
        import_bundle(path, tmp_path / "cache")
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_folder_members_of_a_hand_made_tar_are_fine(good_files, tmp_path):
    key = next(n for n in good_files if n.endswith("meta.json")).split("/")[2]
    folders = [member(f"v{SCHEMA}", tarfile.DIRTYPE), member(f"v{SCHEMA}/entries/", tarfile.DIRTYPE),
               member(f"v{SCHEMA}/entries/{key}", tarfile.DIRTYPE), member(f"v{SCHEMA}/index", tarfile.DIRTYPE)]
    report = import_bundle(write_tar(tmp_path / "b.tar.gz", good_files, folders), tmp_path / "cache")
    assert len(report.imported) == 1 and report.index_files == 1


# ---- damaged entries inside a sound bundle ----------------------------------------------------

def damage(files, suffix, change):
    name = next(n for n in files if n.endswith(suffix))
    return dict(files, **{name: change(files[name])})


@pytest.mark.parametrize("how, why", [
    ("flip", "does not match meta.json's cubin_sha256"),
    ("meta", "unreadable meta.json"),
    ("key", "names another key"),
    ("schema", "schema"),
    ("missing", "incomplete: no source.cu"),
])
def test_damaged_entry_is_rejected_and_others_imported(built, good_files, tmp_path, how, why):
    if how == "flip":
        files = damage(good_files, "kernel.cubin", lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:])
    elif how == "meta":
        files = damage(good_files, "meta.json", lambda b: b[: len(b) // 2])
    elif how in ("key", "schema"):
        field, value = ("key", "f" * 64) if how == "key" else ("schema", SCHEMA + 1)
        files = damage(good_files, "meta.json", lambda b: json.dumps(dict(json.loads(b), **{field: value})).encode())
    else:
        files = {n: d for n, d in good_files.items() if not n.endswith("source.cu")}
    # a second, sound entry (another spec) travels in the same bundle
    cache = KernelCache(built[0])
    other = next(e for e in cache.entries() if e["name"] == OTHER_SPECS[0].name)
    for name in ("kernel.cubin", "source.cu", "meta.json"):
        files[f"v{SCHEMA}/entries/{other['key']}/{name}"] = (cache.entry_dir(other["key"]) / name).read_bytes()

    report = import_bundle(write_tar(tmp_path / "b.tar.gz", files), tmp_path / "cache")
    assert report.imported == [OTHER_SPECS[0].name]
    assert len(report.rejected) == 1 and why in report.rejected[0][1]
    assert report.index_files == 0 and report.index_skipped == 1  # its index file named the rejected entry
    assert [e["name"] for e in KernelCache(tmp_path / "cache").entries()] == [OTHER_SPECS[0].name]


def test_index_file_naming_an_unknown_entry_is_skipped(good_files, tmp_path):
    files = dict(good_files, **{f"v{SCHEMA}/index/{'b' * 64}": b"c" * 64, f"v{SCHEMA}/index/{'d' * 64}": b"junk"})
    report = import_bundle(write_tar(tmp_path / "b.tar.gz", files), tmp_path / "cache")
    assert report.index_files == 1 and report.index_skipped == 2
    assert list(KernelCache(tmp_path / "cache").index().values()) == [next(
        n for n in good_files if n.endswith("meta.json")).split("/")[2]]
