"""The container recipe with a non-root server: a cache imported as root serves uid 65534 strictly.

Each test prepares a cache as root, then runs a fresh interpreter that imports flashjit (from a
copy of the package that any user can read), reads NVRTC's version and the compiler fingerprint,
drops to uid/gid 65534 (as a server that starts as root and then drops privileges would) and only
then reads the cache. Needs root, as CI runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flashjit.deploy.bundle import export_bundle, import_bundle
from flashjit.jit import host_library
from flashjit.serving.host_plan import load_host_plan
from flashjit.worklist.record import HOST_PLAN_DEFINES, HOST_PLAN_SOURCE, HOST_PLAN_SYMBOLS
from flashjit.jit.cache import KernelCache

from repo_paths import ROOT as REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root (CI runs as root)")

NOBODY = 65534

CHILD = r"""
import hashlib, json, logging, os, sys

import flashjit
from flashjit import DecodeSpec, Engine, KernelNotPrewarmed
from flashjit.jit import compile as compile_module, host_library
from flashjit.jit.cache import KernelCache
from flashjit.jit.render import render
from flashjit.serving.host_plan import load_host_plan

cache_dir, spec = sys.argv[1], DecodeSpec.from_name(sys.argv[2])
compile_module.compiler_fingerprint()
compile_module.nvrtc_version()
render(spec)  # imports what rendering imports lazily (jinja2's codecs): the interpreter's files are root's
messages = []


class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())


logging.getLogger("flashjit").addHandler(Collect())
os.setgroups([])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[3]))

report = {"uid": os.getuid(), "package": flashjit.__file__}
try:
    report["cubin_sha256"] = hashlib.sha256(Engine(cache_dir=cache_dir, allow_compile=False).get_kernel(spec).cubin).hexdigest()
except KernelNotPrewarmed as exc:
    report["error"] = str(exc)
report["listed"] = [e["name"] for e in KernelCache(cache_dir).entries()]


def not_built(*args):
    raise RuntimeError("built again")


host_library._build = not_built
library = load_host_plan(KernelCache(cache_dir))
report["host_library"] = None if library is None else library._name
report["warnings"] = messages
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def readable_package():
    """A copy of flashjit and its templates in a folder every user can read."""
    folder = Path(tempfile.mkdtemp(prefix="flashjit-package-"))
    folder.chmod(0o755)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "flashjit", folder / "flashjit", ignore=ignore)
    shutil.copytree(REPO / "templates", folder / "templates", ignore=ignore)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def serve_as(uid: int, cache_dir: Path, spec_name: str, package: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), spec_name, str(uid)], cwd=package,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["uid"] == uid and report["package"].startswith(str(package)), report
    return report


def imported_as_root(warm, tmp_path, cache_dir: Path) -> Path:
    """The image-build step: export a bundle, import it (as root), build the host helper into the cache."""
    bundle = export_bundle(tmp_path / "kernels.tar.gz", warm.cache_dir).path
    import_bundle(bundle, cache_dir)
    if host_library.compiler() is not None:
        host_library._loaded.pop((str(HOST_PLAN_SOURCE), HOST_PLAN_DEFINES, HOST_PLAN_SYMBOLS, str(KernelCache(cache_dir).base),
                                  True), None)
        assert load_host_plan(KernelCache(cache_dir)) is not None
    return cache_dir


def test_a_cache_imported_as_root_serves_another_user_in_strict_mode(warm, tmp_path, shared_tmp, readable_package):
    cache_dir = imported_as_root(warm, tmp_path, shared_tmp / "cache")
    report = serve_as(NOBODY, cache_dir, warm.spec.name, readable_package)
    assert report.get("error") is None, report
    assert report["cubin_sha256"] == hashlib.sha256(warm.kernel.cubin).hexdigest()
    assert report["listed"] == [warm.spec.name]  # `flashjit list` shows it
    if host_library.compiler() is not None:  # the root-built helper is loaded from the cache, not rebuilt
        assert report["host_library"] is not None and report["host_library"].startswith(str(cache_dir)), report
    assert not [w for w in report["warnings"] if "not trusted" in w or "Permission" in w], report["warnings"]


def test_a_file_another_user_cannot_read_is_reported(warm, tmp_path, shared_tmp, readable_package):
    cache_dir = imported_as_root(warm, tmp_path, shared_tmp / "cache")
    meta = KernelCache(cache_dir).entry_dir(warm.kernel.key) / "meta.json"
    meta.chmod(0o600)  # as an older flashjit wrote every file
    report = serve_as(NOBODY, cache_dir, warm.spec.name, readable_package)
    assert "error" in report and str(meta) in report["error"] and "Permission denied" in report["error"], report
    assert "chmod" in report["error"]
    assert any(str(meta) in w and "chmod" in w for w in report["warnings"]), report["warnings"]


def test_a_file_owned_by_a_third_user_is_not_served_to_the_other_user(warm, tmp_path, shared_tmp, readable_package):
    cache_dir = imported_as_root(warm, tmp_path, shared_tmp / "cache")
    cubin = KernelCache(cache_dir).entry_dir(warm.kernel.key) / "kernel.cubin"
    os.chown(cubin, 1234, 1234)
    report = serve_as(NOBODY, cache_dir, warm.spec.name, readable_package)
    assert "owned by uid 1234" in report.get("error", ""), report
