"""Bundles made by an attacker: values inside members used as paths, size and member-count bombs,
index files that would replace a verified local kernel, and metadata of the wrong shape. Every
one is refused (nothing written) or rejected entry by entry; none reaches the disk outside the
cache or replaces what the cache already serves."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import threading

import pytest

from flashjit import Engine
from flashjit.deploy import bundle as bundle_module
from flashjit.deploy import cli
from flashjit.deploy.bundle import HEADER, BundleError, Limits, import_bundle
from flashjit.jit.cache import ENTRY_FILES, SCHEMA, KernelCache

from build_box import OTHER_SPECS
from cli_runner import run
from test_bundle import assert_nothing_written, good_files, member, write_tar  # noqa: F401  (good_files: a fixture)


def entry_files(cache_dir, spec_name) -> dict[str, bytes]:
    """The three member files of one verified entry of a cache, by spec name."""
    cache = KernelCache(cache_dir)
    key = next(e["key"] for e in cache.entries() if e["name"] == spec_name)
    return {f"v{SCHEMA}/entries/{key}/{name}": (cache.entry_dir(key) / name).read_bytes() for name in ENTRY_FILES}


def edit_meta(files: dict[str, bytes], change) -> dict[str, bytes]:
    """files with each meta.json replaced by change(meta) (a dict, or any JSON value)."""
    out = {}
    for name, data in files.items():
        out[name] = json.dumps(change(json.loads(data))).encode() if name.endswith("meta.json") else data
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_entry(key: str, cubin: bytes, **meta) -> dict[str, bytes]:
    """An entry whose meta.json is well formed and whose checksum matches (its key is not the hash of its source)."""
    fields = {"key": key, "schema": SCHEMA, "cubin_sha256": sha(cubin), "name": "decode_fake", "arch": "sm_90",
              "nvrtc": [12, 9], "flashjit": "0.1.0", "options": ["-arch=sm_90"]}
    folder = f"v{SCHEMA}/entries/{key}"
    return {f"{folder}/kernel.cubin": cubin, f"{folder}/source.cu": b"// fake",
            f"{folder}/meta.json": json.dumps(dict(fields, **meta)).encode()}


# ---- a value inside a member is never a path --------------------------------------------------

@pytest.mark.parametrize("target", ["absolute", "dot-dot", "index file", "too long"])
def test_portable_key_that_is_a_path_refuses_the_bundle(built, good_files, tmp_path, target):
    cache_dir = tmp_path / "cache"
    spec_key = next(n for n in good_files if "/index/" in n).rsplit("/", 1)[1]
    portable = {"absolute": str(tmp_path / "pwned"), "dot-dot": "../../../pwned",
                "index file": f"../index/{spec_key}", "too long": "a" * 65}[target]
    files = edit_meta(good_files, lambda meta: dict(meta, portable_key=portable))
    with pytest.raises(BundleError, match="portable_key") as info:
        import_bundle(write_tar(tmp_path / "b.tar.gz", files), cache_dir)
    assert "refusing the bundle" in str(info.value) and "meta.json" in str(info.value)
    assert_nothing_written(tmp_path, cache_dir)
    assert not (KernelCache(cache_dir).base / "portable").exists()


def test_portable_key_that_is_a_path_exits_non_zero(good_files, tmp_path):
    files = edit_meta(good_files, lambda meta: dict(meta, portable_key=str(tmp_path / "pwned")))
    code, _, err = run("cache", "import", write_tar(tmp_path / "b.tar.gz", files), "--cache-dir", tmp_path / "cache")
    assert code == 1 and "portable_key" in err and not (tmp_path / "pwned").exists()


def test_keys_that_are_not_the_hash_of_the_source_are_rejected(built, good_files, tmp_path):
    """A well-formed portable key or entry key that the entry's own source does not hash to."""
    wrong_portable = edit_meta(good_files, lambda meta: dict(meta, portable_key="b" * 64))
    report = import_bundle(write_tar(tmp_path / "a.tar.gz", wrong_portable), tmp_path / "cache")
    assert report.imported == [] and "portable_key" in report.rejected[0][1]
    moved = {name.replace(name.split("/")[2], "c" * 64) if "/entries/" in name else name: data
             for name, data in good_files.items()}
    moved = edit_meta(moved, lambda meta: dict(meta, key="c" * 64))
    report = import_bundle(write_tar(tmp_path / "b.tar.gz", moved), tmp_path / "cache")
    assert report.imported == [] and "hash" in report.rejected[0][1]
    assert KernelCache(tmp_path / "cache").entries() == []
    assert not (KernelCache(tmp_path / "cache").base / "portable" / ("b" * 64)).exists()


# ---- caps on members, member sizes and total bytes, while streaming ---------------------------

def test_default_limits_are_sane():
    limits = Limits()
    assert 10_000 <= limits.members <= 100_000 and (1 << 30) <= limits.total_bytes <= (8 << 30)
    assert bundle_module.MAX_BYTES["kernel.cubin"] <= 64 << 20 and bundle_module.MAX_BYTES["meta.json"] <= 1 << 20


def test_limits_from_the_command_line(good_files, tmp_path):
    bundle = write_tar(tmp_path / "b.tar.gz", good_files)
    code, _, err = run("cache", "import", bundle, "--max-members", "2", "--cache-dir", tmp_path / "cache")
    assert code == 1 and "more than 2 members" in err
    code, _, err = run("cache", "import", bundle, "--max-size", "10KiB", "--cache-dir", tmp_path / "cache")
    assert code == 1 and "more than 10240 bytes" in err
    assert KernelCache(tmp_path / "cache").entries() == []
    code, _, err = run("cache", "import", bundle, "--max-size", "1GiB", "--max-members", "10", "--cache-dir",
                       tmp_path / "cache")
    assert code == 0, err


def test_import_help_states_the_default_limits(capsys):
    with pytest.raises(SystemExit):
        cli.main(["cache", "import", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {Limits.members})" in text and f"default {Limits.total_bytes >> 30}GiB)" in text


def test_member_count_is_capped_while_streaming(good_files, tmp_path, monkeypatch):
    headers = []
    real_frombuf = tarfile.TarInfo.frombuf.__func__

    def counting_frombuf(cls, buf, encoding, errors):
        headers.append(1)
        return real_frombuf(cls, buf, encoding, errors)

    monkeypatch.setattr(tarfile.TarInfo, "frombuf", classmethod(counting_frombuf))
    folders = [member(f"v{SCHEMA}/index", tarfile.DIRTYPE) for _ in range(200)]
    bundle = write_tar(tmp_path / "b.tar.gz", good_files, folders)
    with pytest.raises(BundleError, match="more than 10 members") as info:
        import_bundle(bundle, tmp_path / "cache", limits=Limits(members=10))
    assert "--max-members" in str(info.value)
    assert len(headers) <= 12  # refused at the 11th header, not after reading all 205
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_total_bytes_are_capped_before_anything_is_written(tmp_path):
    """Zero 'cubins' with matching checksums: megabytes on disk from a bundle of kilobytes."""
    cubin = b"\x7fELF" + bytes(3 << 20)
    files = {HEADER: json.dumps({"format": 1, "schema": SCHEMA}).encode()}
    for key in ("1" * 64, "2" * 64, "3" * 64):
        files.update(fake_entry(key, cubin))
    bundle = write_tar(tmp_path / "bomb.tar.gz", files)
    assert os.path.getsize(bundle) < 100_000
    with pytest.raises(BundleError, match="--max-size") as info:
        import_bundle(bundle, tmp_path / "cache", limits=Limits(total_bytes=8 << 20))
    assert "refusing the bundle" in str(info.value)
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_declared_member_size_over_the_default_cap_is_refused_before_reading(tmp_path):
    """Three headers claiming 200 MiB cubins, with no data behind them: refused on the first header."""
    raw = io.BytesIO()
    for key in ("1" * 64, "2" * 64, "3" * 64):
        info = tarfile.TarInfo(f"v{SCHEMA}/entries/{key}/kernel.cubin")
        info.size = 200 << 20
        raw.write(info.tobuf())
    (tmp_path / "b.tar.gz").write_bytes(gzip.compress(raw.getvalue()))
    with pytest.raises(BundleError, match="refusing the bundle.*more than the"):
        import_bundle(tmp_path / "b.tar.gz", tmp_path / "cache")
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_large_extended_header_is_refused(good_files, tmp_path):
    with tarfile.open(tmp_path / "b.tar.gz", "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in good_files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if name == HEADER:
                info.pax_headers = {"comment": "x" * (1 << 20)}
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="extended header"):
        import_bundle(tmp_path / "b.tar.gz", tmp_path / "cache")
    assert_nothing_written(tmp_path, tmp_path / "cache")


def test_a_cubin_that_is_not_elf_is_rejected(good_files, tmp_path):
    zeros = bytes(4096)
    files = {n: (zeros if n.endswith("kernel.cubin") else d) for n, d in good_files.items()}
    files = edit_meta(files, lambda meta: dict(meta, cubin_sha256=sha(zeros)))
    report = import_bundle(write_tar(tmp_path / "b.tar.gz", files), tmp_path / "cache")
    assert report.imported == [] and "ELF" in report.rejected[0][1]
    assert KernelCache(tmp_path / "cache").entries() == []


def test_import_that_cannot_fit_writes_nothing(good_files, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    KernelCache(cache_dir)
    real = shutil.disk_usage
    monkeypatch.setattr(bundle_module.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    code, _, err = run("cache", "import", write_tar(tmp_path / "b.tar.gz", good_files), "--cache-dir", cache_dir)
    assert code == 1 and "1000 free" in err and "nothing was imported" in err
    assert_nothing_written(tmp_path, cache_dir)


# ---- a bundle's index never replaces a verified local kernel unless asked ---------------------

@pytest.fixture
def hijack(built, tmp_path):
    """A cache serving WARM_SPEC (locally built), and a bundle whose index points WARM_SPEC's spec
    key at another sound entry renamed to WARM_SPEC's name."""
    cache_dir, specs = built
    local = tmp_path / "local"
    files = entry_files(cache_dir, specs[0].name)
    KernelCache(local)
    for name, data in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    index = KernelCache(cache_dir).index()
    warm_key = next(iter(files)).split("/")[2]
    spec_key = next(k for k, v in index.items() if v == warm_key)
    (KernelCache(local).base / "index" / spec_key).write_text(warm_key)
    other = edit_meta(entry_files(cache_dir, OTHER_SPECS[0].name), lambda meta: dict(meta, name=specs[0].name))
    other_key = next(iter(other)).split("/")[2]
    bundle_files = {HEADER: json.dumps({"format": 1, "schema": SCHEMA}).encode(), **other,
                    f"v{SCHEMA}/index/{spec_key}": other_key.encode()}
    local_cubin = files[f"v{SCHEMA}/entries/{warm_key}/kernel.cubin"]
    return local, write_tar(tmp_path / "hijack.tar.gz", bundle_files), specs[0], local_cubin, other_key


def test_bundle_index_does_not_replace_a_verified_local_entry(hijack):
    local, bundle, spec, local_cubin, _ = hijack
    report = import_bundle(bundle, local)
    assert report.index_files == 0 and report.index_kept == 1
    assert Engine(cache_dir=local, allow_compile=False).get_kernel(spec).cubin == local_cubin


def test_replace_takes_the_bundle_index(hijack):
    local, bundle, spec, local_cubin, other_key = hijack
    report = import_bundle(bundle, local, replace=True)
    assert report.index_files == 1 and report.index_kept == 0
    assert Engine(cache_dir=local, allow_compile=False).get_kernel(spec).key == other_key


def test_cli_reports_kept_index_files_and_replace(hijack):
    local, bundle, spec, local_cubin, other_key = hijack
    code, out, err = run("cache", "import", bundle, "--cache-dir", local)
    assert code == 1 and "kept 1 local index file" in err and "--replace" in err
    code, out, err = run("cache", "import", bundle, "--replace", "--cache-dir", local)
    assert code == 0, err
    assert Engine(cache_dir=local, allow_compile=False).get_kernel(spec).key == other_key


# ---- metadata of the wrong shape refuses the whole bundle, naming member and field ------------

ODD_META = {
    "a list": lambda meta: [meta],
    "name a number": lambda meta: dict(meta, name=123),
    "arch null": lambda meta: dict(meta, arch=None),
    "nvrtc a string": lambda meta: dict(meta, nvrtc="12.9"),
    "options a string": lambda meta: dict(meta, options="-arch=sm_90"),
    "compile_seconds a string": lambda meta: dict(meta, compile_seconds="fast"),
    "created a string": lambda meta: dict(meta, created="yesterday"),
    "spec a string": lambda meta: dict(meta, spec="decode"),
    "nvrtc_log a number": lambda meta: dict(meta, nvrtc_log=7),
    "portable_key a number": lambda meta: dict(meta, portable_key=5),
    "cubin_sha256 a list": lambda meta: dict(meta, cubin_sha256=[1]),
    "no arch": lambda meta: {k: v for k, v in meta.items() if k != "arch"},
    "no options": lambda meta: {k: v for k, v in meta.items() if k != "options"},
    "no name": lambda meta: {k: v for k, v in meta.items() if k != "name"},
}
ODD_FIELD = {"a list": "JSON object", "no arch": "'arch'", "no options": "'options'", "no name": "'name'"}


@pytest.mark.parametrize("case", list(ODD_META))
def test_odd_metadata_refuses_the_bundle_and_writes_nothing(built, good_files, tmp_path, case):
    """The odd entry comes after a sound one, so writing as it reads would import half the bundle."""
    odd = edit_meta(entry_files(built[0], OTHER_SPECS[0].name), ODD_META[case])
    bundle = write_tar(tmp_path / "b.tar.gz", {**good_files, **odd})
    with pytest.raises(BundleError) as info:
        import_bundle(bundle, tmp_path / "cache")
    message = str(info.value)
    meta_member = next(n for n in odd if n.endswith("meta.json"))
    field = ODD_FIELD.get(case, "'" + case.split(" ")[0] + "'")
    assert "refusing the bundle" in message and meta_member in message and field in message, message
    assert_nothing_written(tmp_path, tmp_path / "cache")
    code, _, err = run("cache", "import", bundle, "--cache-dir", tmp_path / "cache")
    assert code == 1 and meta_member in err


# ---- a folder, a FIFO or an unwritable place is an error, not a traceback ---------------------

def test_import_of_a_folder(tmp_path):
    code, _, err = run("cache", "import", tmp_path, "--cache-dir", tmp_path / "cache")
    assert code == 1 and "is a folder" in err


def test_import_of_a_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "bundle.tar.gz"
    os.mkfifo(fifo)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(run("cache", "import", fifo, "--cache-dir",
                                                                 tmp_path / "cache")), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # release the blocked open() so the thread ends
        with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        worker.join(10)
        pytest.fail("import of a FIFO blocked")
    code, _, err = outcome[0]
    assert code == 1 and "not a regular file" in err


@pytest.mark.parametrize("where", ["root", "folder", "under a file"])
def test_export_to_a_place_that_is_not_a_file_name(built, tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = {"root": "/", "folder": str(tmp_path), "under a file": str(tmp_path / "file" / "b.tar.gz")}[where]
    code, _, err = run("cache", "export", out, "--cache-dir", built[0])
    assert code == 1 and out in err, err
    assert ("is a folder" if where != "under a file" else "could not write") in err
    assert (tmp_path / "file").read_text() == "x" and list(tmp_path.glob(".*.tmp")) == []


# ---- what is quoted from a bundle is bounded --------------------------------------------------

@pytest.mark.parametrize("header", [
    {"format": 2, "schema": SCHEMA, "flashjit": "9" * (8 << 20)},
    {"format": "f" * (8 << 20), "schema": SCHEMA},
    {"format": 1, "schema": "s" * (8 << 20), "flashjit": "0.1.0"},
], ids=["version", "format", "schema"])
def test_huge_header_values_are_quoted_in_part(tmp_path, header):
    path = write_tar(tmp_path / "b.tar.gz", {HEADER: json.dumps(header).encode()})
    code, _, err = run("cache", "import", path, "--cache-dir", tmp_path / "cache")
    assert code == 1 and "nothing was imported" in err, err[:500]
    assert len(err) < 1000, len(err)


def test_a_huge_member_name_is_quoted_in_part(tmp_path):
    path = write_tar(tmp_path / "b.tar.gz", {"a" * 60000: b"x"})
    code, _, err = run("cache", "import", path, "--cache-dir", tmp_path / "cache")
    assert code == 1 and "aaaa" in err and len(err) < 1000, len(err)
