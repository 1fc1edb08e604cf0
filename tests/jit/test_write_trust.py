"""The trust rule for writes: flashjit never writes through a link it did not create, never
replaces a FIFO or device, and creates nothing in a folder that is not a flashjit cache.

Failed compiles' sources, `cache export OUT`, and `clear`/`list`/`cache info` on folders that are
not caches. Tests that plant files as another user chown to uid 65534, so they run as root (as CI does).
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import tempfile
import threading
import time

import pytest

from flashjit import CompileError, DecodeSpec, Engine, register_mask
from flashjit.deploy.bundle import BundleError, export_bundle
from flashjit.jit.cache import SCHEMA, KernelCache
MARKER = "CACHEDIR.TAG"  # the cache marker (cache_format.MARKER)
from flashjit.jit.trusted_files import Refused

from cli_runner import run

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (CI runs as root)")
VICTIM_TEXT = "a file flashjit must never write\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


# ---- a failed compile's source --------------------------------------------------------------------

@pytest.fixture
def wrong_mask(isolated_masks, tmp_path) -> DecodeSpec:
    path = tmp_path / "masks" / "wrong.cuh.j2"
    path.parent.mkdir()
    path.write_text('{% extends "masks/base.cuh.j2" %}\n{% block visible %}  return no_such_symbol;{% endblock %}\n')
    register_mask("wrong_mask", path)
    return DecodeSpec(64, mask="wrong_mask", arch="sm_90")


def failed_name(engine: Engine, spec: DecodeSpec) -> str:
    return f"{spec.name}-{hashlib.sha256(engine.source(spec).encode()).hexdigest()[:12]}.cu"


def test_a_link_in_the_failed_folder_is_replaced_not_written_through(wrong_mask, cache_dir, victim):
    engine = Engine(cache_dir=cache_dir)
    failed = engine.cache.base / "failed"
    failed.mkdir()
    (failed / failed_name(engine, wrong_mask)).symlink_to(victim)
    with pytest.raises(CompileError) as info:
        engine.get_kernel(wrong_mask)
    assert victim.read_text() == VICTIM_TEXT
    saved = info.value.source_path
    assert stat.S_ISREG(os.lstat(saved).st_mode) and saved.read_text() == engine.source(wrong_mask)


def test_a_cache_that_is_not_trusted_gets_no_failed_source(wrong_mask, tmp_path, monkeypatch):
    root = tmp_path / "shared-cache"
    root.mkdir()
    root.chmod(0o777)  # anyone may write it: flashjit reads nothing from it, and writes nothing into it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(CompileError) as info:
        Engine(cache_dir=root).get_kernel(wrong_mask)
    assert os.listdir(root) == []
    saved = info.value.source_path
    assert saved.is_file() and not saved.is_relative_to(root)
    assert saved.parent.stat().st_uid == os.geteuid() and not saved.parent.stat().st_mode & 0o022


@as_root
def test_a_shared_temp_folder_planted_by_another_user_is_not_written_into(wrong_mask, tmp_path, monkeypatch, victim):
    """The fallback for a cache that cannot take the source: another user got to $TMPDIR first and
    planted links under every name flashjit might use there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    root = tmp_path / "a-file"
    root.write_text("not a folder: the cache cannot take the source")
    engine = Engine(cache_dir=root)
    for folder in (tmp / "flashjit-failed", tmp / f"flashjit-failed-{os.geteuid()}"):
        folder.mkdir()
        (folder / failed_name(engine, wrong_mask)).symlink_to(victim)
        os.lchown(folder / failed_name(engine, wrong_mask), NOBODY, NOBODY)
        os.chown(folder, NOBODY, NOBODY)
        folder.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(CompileError) as info:
        engine.get_kernel(wrong_mask)
    assert victim.read_text() == VICTIM_TEXT
    saved = info.value.source_path
    assert saved.read_text() == engine.source(wrong_mask)
    assert saved.parent.stat().st_uid == os.geteuid() and not saved.parent.stat().st_mode & 0o022


# ---- cache export OUT ----------------------------------------------------------------------------

def test_export_to_a_link_is_refused_and_writes_nothing(built, tmp_path, victim):  # noqa: F811
    out = tmp_path / "bundle.tar.gz"
    out.symlink_to(victim)
    code, _, err = run("cache", "export", out, "--cache-dir", built[0])
    assert code == 1 and str(out) in err and "link" in err, err
    assert out.is_symlink() and victim.read_text() == VICTIM_TEXT


def read_fifo(fifo, ready: threading.Event, received: list):
    """Open the FIFO for reading (without waiting for a writer), then read all a writer sends."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    ready.set()
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:  # a writer, with nothing sent yet
            chunk = None
        if chunk:
            chunks.append(chunk)
        elif chunk == b"" and chunks:  # the writer closed it
            break
        else:
            time.sleep(0.01)
    os.close(fd)
    received.append(b"".join(chunks))


def test_export_into_a_fifo_streams_the_bundle(built, tmp_path):  # noqa: F811
    fifo = tmp_path / "bundle.fifo"
    os.mkfifo(fifo)
    ready, received = threading.Event(), []
    reader = threading.Thread(target=read_fifo, args=(fifo, ready, received), daemon=True)
    reader.start()
    assert ready.wait(10)
    report = export_bundle(fifo, built[0])
    reader.join(10)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with tarfile.open(fileobj=io.BytesIO(received[0]), mode="r:gz") as tar:
        names = tar.getnames()
    assert "flashjit-bundle.json" in names and len(report.entries) == len(built[1])
    assert report.bytes == len(received[0])


def test_export_into_a_fifo_nobody_reads_is_refused_without_hanging(built, tmp_path):  # noqa: F811
    fifo = tmp_path / "bundle.fifo"
    os.mkfifo(fifo)
    with pytest.raises(BundleError, match="no process is reading"):
        export_bundle(fifo, built[0])
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@as_root
def test_export_into_a_character_device_writes_it_as_a_stream(built, tmp_path):  # noqa: F811
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the /dev/null device, in a test folder
    report = export_bundle(null, built[0])
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == os.makedev(1, 3)
    assert report.bytes > 0 and list(tmp_path.glob(".*.tmp")) == []
    full = tmp_path / "full"
    os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # /dev/full: every write fails
    with pytest.raises(BundleError, match="space"):
        export_bundle(full, built[0])
    assert stat.S_ISCHR(os.lstat(full).st_mode)


def test_atomic_file_never_replaces_a_folder_or_fifo(tmp_path):
    from flashjit.jit import trusted_writes

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for name in ("fifo", "folder"):
        with pytest.raises(Refused, match="does not replace"):
            trusted_writes.write_file(tmp_path / name, b"x")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and (tmp_path / "folder").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["fifo", "folder"]


def test_a_lock_file_that_is_a_link_is_not_followed(tmp_path, victim):
    from flashjit.jit import trusted_writes

    (tmp_path / "k.lock").symlink_to(victim)
    with pytest.raises(OSError):
        with trusted_writes.file_lock(tmp_path / "k.lock", 0):
            pass
    assert victim.read_text() == VICTIM_TEXT


# ---- clear, list and cache info on folders that are not caches --------------------------------------

def plant_data(folder):
    """A folder that looks a little like a cache (v1/entries, v1/index) but holds someone's files."""
    for name in ("entries/thesis.tex", "index/notes.txt", "results.csv"):
        path = folder / f"v{SCHEMA}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("precious")
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_clear_refuses_a_folder_that_is_not_a_cache(tmp_path):
    data = tmp_path / "data"
    before = plant_data(data)
    code, out, err = run("clear", "--cache-dir", data)
    assert code == 2 and str(data) in err and "not a flashjit" in err and "removed" not in out, (out, err)
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == before


def test_prune_refuses_a_folder_that_is_not_a_cache(tmp_path):
    data = tmp_path / "data"
    before = plant_data(data)
    code, _, err = run("cache", "prune", "--max-size", "0", "--cache-dir", data)
    assert code == 2 and str(data) in err and "not a flashjit" in err, err
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == before


def test_an_engine_writes_nothing_into_a_folder_that_is_not_a_cache(tmp_path, fake_nvrtc, caplog):
    data = tmp_path / "data"
    before = plant_data(data)
    engine = Engine(cache_dir=data)
    engine.get_kernel(DecodeSpec(64, arch="sm_90"))
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == before
    assert "not a flashjit" in caplog.text and str(data) in caplog.text


@pytest.mark.parametrize("command", [("list",), ("cache", "info")])
def test_read_only_commands_create_nothing(tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run(*command, "--cache-dir", empty)
    assert code == 0, err
    assert os.listdir(empty) == []
    missing = tmp_path / "mistyped"
    code, out, err = run(*command, "--cache-dir", missing)
    assert code == 2 and str(missing) in err and "no such folder" in err, (out, err)
    assert not missing.exists()


def test_export_of_a_missing_cache_creates_nothing(tmp_path):
    missing = tmp_path / "mistyped"
    code, _, err = run("cache", "export", tmp_path / "b.tar.gz", "--cache-dir", missing)
    assert code != 0 and str(missing) in err
    assert not missing.exists() and not (tmp_path / "b.tar.gz").exists()


def test_a_cache_carries_its_marker_and_an_unmarked_one_in_the_layout_is_still_a_cache(warm, cache_dir, fake_nvrtc):
    warm.copy_entry_to(cache_dir)
    marker = cache_dir / f"v{SCHEMA}" / MARKER
    assert marker.is_file() and marker.read_bytes().startswith(b"Signature: 8a477f597d28d172789f06886806bc55")
    marker.unlink()  # a cache written before the marker existed
    code, out, err = run("clear", "--cache-dir", cache_dir)
    assert code == 0 and "removed 1 entries" in out, err
    assert KernelCache(cache_dir).entries() == [] and marker.is_file()  # a writer marks it again


def test_a_temp_folder_anyone_may_change_gets_no_failed_source(wrong_mask, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o777)  # not sticky: anyone could swap what flashjit makes there
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    root = tmp_path / "a-file"
    root.write_text("not a folder: the cache cannot take the source")
    with pytest.raises(CompileError) as info:
        Engine(cache_dir=root).get_kernel(wrong_mask)
    assert str(info.value.source_path) == "<unsaved>" and os.listdir(tmp) == []
