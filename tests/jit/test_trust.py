"""The cache's trust rule under attack: nothing another user could have written is loaded or run.

Planted files (another owner, group- or world-writable, symbolic links, FIFOs, devices, folders
writable by others) are misses that say why; store() never uses a key from outside as a path;
cache files are readable by other users; garbled metadata is a miss everywhere. Tests that need
another owner chown to uid 65534, so they run as root (as CI does); tests that read as another
user are in test_other_user.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import resource
import shutil
import stat
import subprocess

import pytest

from flashjit import Engine, KernelNotPrewarmed
from flashjit.deploy import cli
from flashjit.deploy.bundle import export_bundle
from flashjit.errors import CacheError
from flashjit.jit import cache as cache_module
from flashjit.jit import host_library
from flashjit.serving.host_plan import load_host_plan
from flashjit.worklist.record import HOST_PLAN_DEFINES, HOST_PLAN_SOURCE
from flashjit.jit.cache import KernelCache

from flashjit.jit.render import render

from fake_cubins import fake_cubin

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (CI runs as root)")
FORK = multiprocessing.get_context("fork")
PLANTED = b"\x7fELF planted by someone else"


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashjit" and r.levelno == logging.WARNING]


def umasked(mode: int) -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def plant_cubin(entry, cubin=PLANTED):
    """Replace an entry's cubin by other bytes, with a meta.json that matches them."""
    meta = json.loads((entry / "meta.json").read_text())
    meta.update(cubin_sha256=hashlib.sha256(cubin).hexdigest(), cubin_bytes=len(cubin))
    (entry / "kernel.cubin").unlink()
    (entry / "kernel.cubin").write_bytes(cubin)
    (entry / "meta.json").unlink()
    (entry / "meta.json").write_text(json.dumps(meta))


def owned_by_nobody(entry, tmp_path):
    plant_cubin(entry)
    for name in ("kernel.cubin", "meta.json"):
        os.chown(entry / name, NOBODY, NOBODY)
    return "owned by uid 65534"


def group_writable(entry, tmp_path):
    plant_cubin(entry)
    (entry / "kernel.cubin").chmod(0o664)
    return "writable by group or others"


def world_writable_meta(entry, tmp_path):
    plant_cubin(entry)
    (entry / "meta.json").chmod(0o646)
    return "writable by group or others"


def cubin_is_a_link(entry, tmp_path):
    plant_cubin(entry)
    elsewhere = tmp_path / "elsewhere.cubin"
    (entry / "kernel.cubin").rename(elsewhere)
    (entry / "kernel.cubin").symlink_to(elsewhere)
    return "symbolic link"


def entry_folder_is_a_link(entry, tmp_path):
    plant_cubin(entry)
    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    return "symbolic link"


def entry_folder_owned_by_nobody(entry, tmp_path):
    plant_cubin(entry)
    os.chown(entry, NOBODY, NOBODY)
    return "owned by uid 65534"


def entries_folder_writable_by_all(entry, tmp_path):
    plant_cubin(entry)
    entry.parent.chmod(0o777)
    return "writable by group or others"


PLANTS = [owned_by_nobody, group_writable, world_writable_meta, cubin_is_a_link, entry_folder_is_a_link,
          entry_folder_owned_by_nobody, entries_folder_writable_by_all]


@as_root
@pytest.mark.parametrize("plant", PLANTS, ids=lambda f: f.__name__)
def test_a_planted_cubin_is_refused_in_strict_mode_saying_why(warm, cache_dir, tmp_path, plant, caplog):
    entry = warm.copy_entry_to(cache_dir)
    why = plant(entry, tmp_path)
    with pytest.raises(KernelNotPrewarmed) as info:
        Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(warm.spec)
    assert why in str(info.value)
    assert any(why in w for w in warnings_of(caplog))
    assert KernelCache(cache_dir).entries() == []  # `flashjit list` does not show it either


@as_root
@pytest.mark.parametrize("plant", PLANTS, ids=lambda f: f.__name__)
def test_a_planted_cubin_is_rebuilt_never_served(warm, cache_dir, tmp_path, plant, fake_nvrtc):
    entry = warm.copy_entry_to(cache_dir)
    plant(entry, tmp_path)
    planted = [tmp_path / "elsewhere.cubin", *(tmp_path / "elsewhere").glob("*")]
    outside = {path: path.read_bytes() for path in planted if path.is_file()}
    kernel = Engine(cache_dir=cache_dir).get_kernel(warm.spec)
    assert kernel.cubin == fake_cubin(render(warm.spec), warm.spec.arch) and fake_nvrtc == [warm.spec.name]
    assert {path: path.read_bytes() for path in outside} == outside  # nothing was written through a link


# ---- FIFOs and devices: refused without blocking or reading ----------------------------------------

def bounded(function, seconds: float = 20):
    """function() in a forked child with its memory capped (1 GiB more than now) and a deadline:
    (outcome, value), outcome 'returned', 'raised' (value: the message) or 'hung'."""
    reader, writer = os.pipe()
    child = FORK.Process(target=_bounded_child, args=(function, writer), daemon=True)
    child.start()
    os.close(writer)
    child.join(seconds)
    if child.is_alive():
        child.kill()
        child.join(5)
        os.close(reader)
        return "hung", None
    with os.fdopen(reader, "rb") as pipe:
        data = pipe.read()
    return pickle.loads(data) if data else ("died", child.exitcode)


def _bounded_child(function, writer):
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * os.sysconf("SC_PAGE_SIZE") + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        outcome = ("returned", function())
    except BaseException as exc:  # reported to the parent: which error, and what it said
        outcome = ("raised", f"{type(exc).__name__}: {exc}")
    os.write(writer, pickle.dumps(outcome))


def strict_get_kernel(cache_dir, spec):
    return lambda: hashlib.sha256(Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(spec).cubin).hexdigest()


def test_a_fifo_named_meta_json_neither_hangs_get_kernel_nor_list(warm, cache_dir):
    entry = warm.copy_entry_to(cache_dir)
    (entry / "meta.json").unlink()
    os.mkfifo(entry / "meta.json")
    outcome, message = bounded(strict_get_kernel(cache_dir, warm.spec))
    assert outcome == "raised" and "KernelNotPrewarmed" in message and "not a regular file" in message
    assert bounded(lambda: len(KernelCache(cache_dir).entries())) == ("returned", 0)
    assert bounded(lambda: cli.main(["list", "--cache-dir", str(cache_dir)])) == ("returned", 0)


def test_a_cubin_linked_to_dev_zero_is_not_read(warm, cache_dir):
    entry = warm.copy_entry_to(cache_dir)
    (entry / "kernel.cubin").unlink()
    (entry / "kernel.cubin").symlink_to("/dev/zero")
    outcome, message = bounded(strict_get_kernel(cache_dir, warm.spec))
    assert outcome == "raised" and "KernelNotPrewarmed" in message and "symbolic link" in message
    assert bounded(lambda: len(KernelCache(cache_dir).entries())) == ("returned", 0)


def test_a_cubin_over_the_size_cap_is_not_read(warm, cache_dir, monkeypatch, caplog):
    entry = warm.copy_entry_to(cache_dir)
    monkeypatch.setitem(cache_module.MAX_BYTES, "kernel.cubin", 1000)
    assert KernelCache(cache_dir).load(warm.kernel.key) is None
    assert any("larger than" in w and str(entry / "kernel.cubin") in w for w in warnings_of(caplog))


# ---- the host library --------------------------------------------------------------------------

needs_cc = pytest.mark.skipif(host_library.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory):
    """A shared library that, when loaded, creates the file MARKER names (what planted code could do)."""
    folder = tmp_path_factory.mktemp("planted")
    marker = folder / "it-ran"
    source = folder / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n')
    library = folder / "planted.so"
    subprocess.run([*host_library.compiler(), "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library, marker


def host_library_path(cache: KernelCache):
    source = HOST_PLAN_SOURCE.read_bytes()
    return cache.base / "host" / f"host_plan-{host_library.library_key(source, host_library.compiler(), HOST_PLAN_DEFINES)}.so"


def so_owned_by_nobody(target, library):
    shutil.copy(library, target)
    os.chown(target, NOBODY, NOBODY)


def so_writable_by_others(target, library):
    shutil.copy(library, target)
    target.chmod(0o666)


def so_is_a_link(target, library):
    target.symlink_to(library)


def host_folder_writable_by_all(target, library):
    shutil.copy(library, target)
    target.parent.chmod(0o777)


@as_root
@needs_cc
@pytest.mark.parametrize("plant", [so_owned_by_nobody, so_writable_by_others, so_is_a_link,
                                   host_folder_writable_by_all], ids=lambda f: f.__name__)
def test_a_planted_host_library_is_never_loaded(tmp_path, monkeypatch, caplog, planted_library, plant):
    library, marker = planted_library
    monkeypatch.setattr(host_library, "_loaded", {})
    monkeypatch.delenv("FLASHJIT_HOST_NATIVE", raising=False)
    cache = KernelCache(tmp_path / "cache")
    target = host_library_path(cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    plant(target, library)
    loaded = load_host_plan(cache)
    assert not marker.exists(), "the planted library ran"
    assert loaded is not None and loaded.fj_plan is not None  # flashjit's own build, loaded instead
    assert any("host helper" in w and ("not loaded" in w or "not used" in w) for w in warnings_of(caplog))


# ---- keys from outside are never paths ---------------------------------------------------------

@pytest.mark.parametrize("portable", ["../../escaped", "ABSOLUTE", "a" * 63, "A" * 64, 7])
def test_store_refuses_a_portable_key_that_is_not_a_key(cache_dir, tmp_path, portable):
    cache = KernelCache(cache_dir)
    if portable == "ABSOLUTE":
        portable = str(tmp_path / "escaped-absolute")
    with pytest.raises(CacheError, match="portable_key"):
        cache.store("a" * 64, b"\x7fELF", "src", {"name": "x", "portable_key": portable})
    assert not (cache_dir / "escaped").exists() and not (tmp_path / "escaped-absolute").exists()
    assert cache.load("a" * 64) is None  # nothing of the entry was written


@pytest.mark.parametrize("key", ["../escaped", "a" * 63, "g" * 64, ""])
def test_store_and_store_index_refuse_keys_that_are_not_keys(cache_dir, key):
    cache = KernelCache(cache_dir)
    with pytest.raises(CacheError):
        cache.store(key, b"\x7fELF", "src", {})
    with pytest.raises(CacheError):
        cache.store_index(key, "a" * 64)
    with pytest.raises(CacheError):
        cache.store_index("a" * 64, key)
    assert not (cache.base / "escaped").exists() and sorted(p.name for p in (cache.base / "index").iterdir()) == []


# ---- readable by others ------------------------------------------------------------------------

def test_cache_files_and_folders_are_readable_by_other_users(cache_dir):
    cache = KernelCache(cache_dir)
    cache.store("a" * 64, b"\x7fELF", "src", {"name": "x", "portable_key": "b" * 64})
    cache.store_index("c" * 64, "a" * 64)
    files = [cache.entry_dir("a" * 64) / name for name in ("kernel.cubin", "source.cu", "meta.json")]
    files += [cache.base / "portable" / ("b" * 64), cache.base / "index" / ("c" * 64)]
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == umasked(0o644), path
    for folder in (cache_dir, cache.base, cache.base / "entries", cache.entry_dir("a" * 64), cache.base / "index",
                   cache.base / "portable"):
        assert stat.S_IMODE(folder.stat().st_mode) == umasked(0o755), folder


@needs_cc
def test_the_host_library_is_readable_by_other_users(tmp_path, monkeypatch):
    monkeypatch.setattr(host_library, "_loaded", {})
    monkeypatch.delenv("FLASHJIT_HOST_NATIVE", raising=False)
    cache = KernelCache(tmp_path / "cache")
    assert load_host_plan(cache) is not None
    assert stat.S_IMODE(host_library_path(cache).stat().st_mode) == umasked(0o644)
    assert stat.S_IMODE(host_library_path(cache).parent.stat().st_mode) == umasked(0o755)


# ---- decode errors in metadata are misses ------------------------------------------------------

def high_bit(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0x80
    path.write_bytes(bytes(data))


def test_a_high_bit_in_an_index_file_is_a_miss_everywhere(warm, cache_dir, tmp_path, fake_nvrtc):
    warm.copy_entry_to(cache_dir)
    cache = KernelCache(cache_dir)
    (index,) = (cache.base / "index").iterdir()
    high_bit(index)
    assert cache.lookup_index(index.name) is None and cache.index() == {}
    assert cache.usage()["index_files"] == 0
    assert cache.prune(dry_run=True)["removed"] == []
    assert export_bundle(tmp_path / "out.tar.gz", cache_dir).index_files == 0
    assert Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(warm.spec).cubin == warm.kernel.cubin
    assert fake_nvrtc == [] and cache.lookup_index(index.name) == warm.kernel.key  # found by its key, re-indexed


def test_a_high_bit_in_a_portable_file_is_a_miss(cache_dir):
    cache = KernelCache(cache_dir)
    cache.store("a" * 64, b"\x7fELF", "src", {"name": "x", "portable_key": "b" * 64})
    assert cache.load_portable("b" * 64)[0] == "a" * 64
    high_bit(cache.base / "portable" / ("b" * 64))
    assert cache.load_portable("b" * 64) is None


@pytest.mark.parametrize("field, value", [("name", 5), ("arch", ["sm_90"]), ("created", "yesterday"),
                                          ("cubin_bytes", "12"), ("compile_seconds", None), ("spec", "x"),
                                          ("nvrtc", 12), ("schema", "1"), ("portable_key", "../x")])
def test_meta_fields_of_the_wrong_type_are_a_miss(cache_dir, capsys, field, value):
    cache = KernelCache(cache_dir)
    cache.store("a" * 64, b"\x7fELF", "src", {"name": "ok", "arch": "sm_90", "created": 1.0})
    cache.store("b" * 64, b"\x7fELF", "src", {"name": "bad", "arch": "sm_90", "created": 2.0})
    meta_path = cache.entry_dir("b" * 64) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, **{field: value})))
    assert cache.load("b" * 64) is None
    assert [e["name"] for e in cache.entries()] == ["ok"]
    assert cli.main(["list", "--cache-dir", str(cache_dir)]) == 0
    assert "1 entries" in capsys.readouterr().out


def test_a_permission_error_is_reported_not_a_silent_miss(warm, cache_dir, monkeypatch, caplog):
    """Simulated here (root reads anything); test_other_user.py reads a 0600 file as another user."""
    import flashjit.jit.trusted_files as trusted_files

    entry = warm.copy_entry_to(cache_dir)
    real_open = os.open

    def denied(path, flags, *args, **kwargs):
        if os.fspath(path).endswith("kernel.cubin"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(trusted_files.os, "open", denied)
    with pytest.raises(KernelNotPrewarmed) as info:
        Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(warm.spec)
    assert "Permission denied" in str(info.value) and "chmod" in str(info.value)
    warnings = warnings_of(caplog)
    assert any(str(entry / "kernel.cubin") in w and "chmod" in w for w in warnings), warnings


# ---- the cache root ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_root_others_can_write_is_not_used_with_one_warning(warm, tmp_path, caplog, fake_nvrtc, mode):
    root = tmp_path / "shared"
    warm.copy_entry_to(root)
    root.chmod(mode)
    engine = Engine(cache_dir=root, allow_compile=False)
    assert engine.cache.writable is False and engine.cache.entries() == [] and engine.cache.index() == {}
    with pytest.raises(KernelNotPrewarmed, match="not trusted.*writable by group or others"):
        engine.get_kernel(warm.spec)
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and str(root) in warnings[0] and f"chmod -R go-w {root}" in warnings[0], warnings
    with pytest.raises(CacheError, match="nothing was pruned"):
        engine.cache.prune(max_bytes=0)
    assert Engine(cache_dir=root).get_kernel(warm.spec).cubin == fake_cubin(render(warm.spec), warm.spec.arch)
    root.chmod(0o755)  # as the warning says: then it serves again
    assert Engine(cache_dir=root, allow_compile=False).get_kernel(warm.spec).cubin == warm.kernel.cubin


def test_a_sticky_root_is_used(warm, tmp_path, caplog):
    """As /tmp: others may add names to a sticky folder but not replace ours."""
    root = tmp_path / "sticky"
    warm.copy_entry_to(root)
    root.chmod(0o1777)
    assert Engine(cache_dir=root, allow_compile=False).get_kernel(warm.spec).cubin == warm.kernel.cubin
    assert warnings_of(caplog) == []


@as_root
def test_a_root_owned_by_another_user_is_not_used(warm, tmp_path, caplog):
    root = tmp_path / "theirs"
    warm.copy_entry_to(root)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(KernelNotPrewarmed, match="owned by uid 65534"):
        Engine(cache_dir=root, allow_compile=False).get_kernel(warm.spec)


def test_entry_files_are_read_under_the_trust_rule(warm, cache_dir):
    """What an export copies: every file of a verified entry, and nothing through a link."""
    entry = warm.copy_entry_to(cache_dir)
    cache = KernelCache(cache_dir)
    files = cache.entry_files(warm.kernel.key)
    assert files == {name: (entry / name).read_bytes() for name in ("kernel.cubin", "source.cu", "meta.json")}
    (entry / "source.cu").unlink()
    (entry / "source.cu").symlink_to("/dev/zero")
    assert cache.entry_files(warm.kernel.key) is None and cache.entry_files("../x") is None


def test_a_linked_v1_is_followed_and_what_it_leads_to_is_checked(warm, tmp_path, caplog):
    """v1/ moved to another disk and linked back is served; the folder it leads to must pass too."""
    root, disk = tmp_path / "cache", tmp_path / "big-disk"
    base = warm.copy_entry_to(root).parent.parent  # root/v1
    shutil.move(base, disk)
    base.symlink_to(disk)
    assert Engine(cache_dir=root, allow_compile=False).get_kernel(warm.spec).cubin == warm.kernel.cubin
    disk.chmod(0o777)
    with pytest.raises(KernelNotPrewarmed, match="not trusted"):
        Engine(cache_dir=root, allow_compile=False).get_kernel(warm.spec)
