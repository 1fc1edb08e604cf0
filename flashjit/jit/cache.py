"""On-disk kernel cache: content-addressed cubins that any host with the same NVRTC can reuse.

Entries are named by the keys of keys.py: SHA-256 over what the cubin is built from (the
rendered source, arch, options, NVRTC and flashjit versions), with no absolute paths, mtimes or
host names, so a cache built on one host serves another.

Layout under the root:  v{SCHEMA}/entries/<key>/{kernel.cubin, source.cu, meta.json}
                        v{SCHEMA}/index/<spec key>         (spec + template contents -> entry key)
                        v{SCHEMA}/portable/<portable key>  (source without the NVRTC version -> entry key)
                        v{SCHEMA}/locks/<key>.lock         (outside the entries)
                        v{SCHEMA}/host/<name>-<key>.so     (C host helpers: host_library.py)
The index lets a fresh process find a kernel without rendering it or loading NVRTC (~100 ms);
its key (keys.index_key) hashes the spec, every template file's contents, the flashjit version
and the installed compiler's, so editing a template or upgrading misses it and falls back to the
full key.
meta.json is written last and holds the cubin's SHA-256: an entry without it, or whose cubin does
not match it, is a miss and is rebuilt. Every file is written to a temp file, fsynced and
os.replace()d. Locks only stop two processes compiling the same key; correctness never depends on
them, and flock-based locks die with their process. An unusable root degrades to memory only,
with one warning; a read-only root still serves what it holds (warning at the first write).
Last use: the engine bumps an entry folder's mtime when it loads the entry from disk (one utime
call; memory hits never touch the disk), so `prune` evicts least recently used entries first.
Other v{N} folders under the root hold entries of other schema versions; this version never reads
them, `usage` reports them and `prune(old_versions=True)` removes the older ones in its layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import filelock

from .. import env
from ..errors import CacheError

SCHEMA = 1
LOCK_TIMEOUT_S: float | None = None  # a number overrides FLASHJIT_LOCK_TIMEOUT (tests); None reads it at lock time
INCOMPLETE_GRACE_S = 3600.0  # prune removes entries that never got their meta.json after this long
ENTRY_FILES = ("kernel.cubin", "source.cu", "meta.json")
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
_VERSION_FOLDER = re.compile(r"v(\d+)")
LAYOUT = ("entries", "index", "portable", "locks", "failed", "host")  # what a v{N} folder holds
_OWN_HIDDEN = re.compile(r"\.(probe|trash)-.*|\..*\.tmp")  # probes, entries being removed, temp files
log = logging.getLogger("flashjit")


def lock_timeout() -> float:
    """Seconds to wait for another process's compile of the same key: read at every lock, not at import."""
    return float(LOCK_TIMEOUT_S) if LOCK_TIMEOUT_S is not None else env.lock_timeout()


def default_cache_dir() -> Path:
    """FLASHJIT_CACHE_DIR, else the user cache folder (~/.cache/flashjit on Linux)."""
    folder = env.cache_dir()
    if folder is not None:
        return folder
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashjit", appauthor=False))


@contextlib.contextmanager
def atomic_file(path: Path):
    """A binary file object whose contents appear at `path` whole or not at all:
    written to a temp file beside it, fsynced, then os.replace()d; removed on any error."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _atomic_write(path: Path, data: bytes):
    with atomic_file(path) as f:
        f.write(data)


class KernelCache:
    """Disk cache of compiled kernels; falls back to memory only when the root is unusable.

    A read-only root (a container image, a read-only mount) still serves the entries it holds and
    warns once, at the first kernel it cannot save.
    """

    def __init__(self, root=None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.base = self.root / f"v{SCHEMA}"
        self._warned = False
        self._warn_lock = threading.Lock()
        self._read_only: str | None = None  # why a readable cache cannot be written (warned at the first write)
        self.writable = self._prepare()

    def _prepare(self) -> bool:
        try:
            if self.root.exists() and not self.root.is_dir():
                raise CacheError(f"{self.root} exists and is not a folder")
            for sub in ("entries", "locks", "index"):
                (self.base / sub).mkdir(parents=True, exist_ok=True)
            probe = self.base / "entries" / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except (OSError, CacheError) as exc:
            if isinstance(exc, OSError) and os.access(self.base / "entries", os.R_OK | os.X_OK):
                # A read-only cache (a container image, a read-only mount) still serves what it holds;
                # warn only if a kernel it lacks has to be kept in memory.
                self._read_only = f"kernel cache at {self.root} is read-only ({exc}): kernels in it are served"
            else:
                self._degrade(f"kernel cache at {self.root} is not usable ({exc})")
            return False

    def _degrade(self, why: str):
        with self._warn_lock:
            if not self._warned:
                self._warned = True
                log.warning("%s; new kernels are compiled and kept in memory only for this process. "
                            "Set FLASHJIT_CACHE_DIR or Engine(cache_dir=...) to a writable folder.", why)

    def _not_writable(self) -> bool:
        if self._read_only:
            self._degrade(self._read_only)
        return False

    def entry_dir(self, key: str) -> Path:
        return self.base / "entries" / key

    def load(self, key: str) -> tuple[bytes, dict] | None:
        """The cubin and metadata of a verified entry, or None (missing, partial or corrupt)."""
        folder = self.entry_dir(key)
        try:
            meta = json.loads((folder / "meta.json").read_text())
            cubin = (folder / "kernel.cubin").read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("key") != key or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
            log.warning("kernel cache entry %s is corrupt; rebuilding it", folder)
            return None
        return cubin, meta

    def store(self, key: str, cubin: bytes, source: str, meta: dict) -> bool:
        """Write an entry (cubin and source first, metadata last). False if it could not be written."""
        if not self.writable:
            return self._not_writable()
        folder = self.entry_dir(key)
        meta = dict(meta, key=key, schema=SCHEMA, cubin_sha256=hashlib.sha256(cubin).hexdigest(), cubin_bytes=len(cubin))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(folder / "kernel.cubin", cubin)
            _atomic_write(folder / "source.cu", source.encode())
            _atomic_write(folder / "meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())
            if meta.get("portable_key"):
                (self.base / "portable").mkdir(exist_ok=True)
                _atomic_write(self.base / "portable" / meta["portable_key"], key.encode())
            return True
        except OSError as exc:
            self._degrade(f"could not write kernel cache entry {folder} ({exc})")
            return False

    def load_portable(self, portable: str) -> tuple[str, bytes, dict] | None:
        """(key, cubin, meta) of a verified entry built from the same source by any NVRTC, or None."""
        try:
            key = (self.base / "portable" / portable).read_text().strip()
        except OSError:
            return None
        hit = self.load(key) if len(key) == 64 else None
        if hit is None or hit[1].get("portable_key") != portable:
            return None
        return (key,) + hit

    def lookup_index(self, spec_key: str) -> str | None:
        try:
            key = (self.base / "index" / spec_key).read_text().strip()
        except OSError:
            return None
        return key if len(key) == 64 else None

    def touch(self, key: str):
        """Record a use of an entry (its folder's mtime), for least-recently-used pruning. Never fails."""
        with contextlib.suppress(OSError):
            os.utime(self.entry_dir(key))

    def store_index(self, spec_key: str, key: str):
        """Remember spec key -> entry key. Only a shortcut: a read-only cache silently goes without."""
        if self.writable:
            try:
                _atomic_write(self.base / "index" / spec_key, key.encode())
            except OSError as exc:
                self._degrade(f"could not write kernel cache index ({exc})")

    @contextlib.contextmanager
    def compile_lock(self, key: str):
        """Held while compiling one key, so concurrent processes compile it once.

        A lock held longer than FLASHJIT_LOCK_TIMEOUT (a hung process) is waited out, then the
        caller compiles anyway: a duplicate compile is harmless, a hang is not.
        """
        if not self.writable:
            yield
            return
        timeout = lock_timeout()
        lock = filelock.FileLock(str(self.base / "locks" / f"{key}.lock"), timeout=timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            log.warning("kernel cache lock %s held for over %g s (FLASHJIT_LOCK_TIMEOUT); compiling without it",
                        lock.lock_file, timeout)
            yield
            return
        except OSError as exc:
            self._degrade(f"could not lock {lock.lock_file} ({exc})")
            yield
            return
        try:
            yield
        finally:
            lock.release()

    def entries(self) -> list[dict]:
        """Metadata of every verified entry."""
        folder = self.base / "entries"
        found = []
        if folder.is_dir():
            for entry in sorted(folder.iterdir()):
                loaded = self.load(entry.name) if entry.is_dir() and not entry.name.startswith(".") else None
                if loaded:
                    found.append(dict(loaded[1], path=str(entry)))
        return found

    def index(self) -> dict[str, str]:
        """Every readable index file: spec key -> entry key (the entry may be gone)."""
        folder, found = self.base / "index", {}
        if folder.is_dir():
            for path in folder.iterdir():
                if KEY_PATTERN.fullmatch(path.name):
                    key = self.lookup_index(path.name)
                    if key:
                        found[path.name] = key
        return found

    def usage(self) -> dict:
        """What is on disk: sizes, verified and incomplete entries, per-arch counts, other schema versions."""
        entries = self.entries()
        verified = {e["key"] for e in entries}
        by_arch: dict[str, dict] = {}
        for e in entries:
            slot = by_arch.setdefault(e.get("arch", "?"), {"entries": 0, "bytes": 0})
            slot["entries"] += 1
            slot["bytes"] += _tree_bytes(Path(e["path"]))
        folders = [p for p in (self.base / "entries").iterdir() if p.is_dir()] if (self.base / "entries").is_dir() else []
        index = self.index()
        versions = []
        if self.root.is_dir():
            for path in sorted(self.root.iterdir()):
                match = _VERSION_FOLDER.fullmatch(path.name)
                if match and path.is_dir() and int(match.group(1)) != SCHEMA:
                    version = int(match.group(1))
                    state = ("newer (kept)" if version > SCHEMA else "older" if _is_cache_version(path)
                             else "not a flashjit cache (kept)")
                    versions.append({"version": version, "path": str(path), "bytes": _tree_bytes(path),
                                     "entries": _count_dirs(path / "entries"), "state": state})
        return {
            "root": str(self.root), "schema": SCHEMA, "writable": self.writable,
            "bytes": _tree_bytes(self.base), "entries": len(entries),
            "entry_bytes": sum(slot["bytes"] for slot in by_arch.values()),
            "incomplete": sum(p.name not in verified and not p.name.startswith(".") for p in folders),
            "index_files": len(index), "index_stale": sum(key not in verified for key in index.values()),
            "by_arch": dict(sorted(by_arch.items())),
            "other_versions": versions, "total_bytes": _tree_bytes(self.root),
        }

    def prune(self, max_bytes: int | None = None, old_versions: bool = False, dry_run: bool = False) -> dict:
        """Free space: least recently used entries first until entries fit in max_bytes; with
        old_versions, the v{N} folders of older schemas in flashjit's layout. Entries left incomplete
        by a killed writer (no valid meta.json for INCOMPLETE_GRACE_S) always go, and so do index
        files naming removed entries. Safe while other processes use the cache: an entry is renamed
        away before it is deleted, so readers see it whole or not at all (and a miss only means a
        recompile).
        """
        report = {"removed": [], "incomplete": 0, "freed_bytes": 0, "index_removed": 0, "versions_removed": [],
                  "kept": 0, "kept_bytes": 0, "dry_run": dry_run}
        folder = self.base / "entries"
        candidates = []  # (last use, key, bytes, meta or None)
        if folder.is_dir():
            now = time.time()
            for path in folder.iterdir():
                if not path.is_dir() or path.name.startswith("."):
                    continue
                with contextlib.suppress(OSError):
                    loaded = self.load(path.name)
                    used, size = path.stat().st_mtime, _tree_bytes(path)
                    if loaded is None:
                        if now - used > INCOMPLETE_GRACE_S:
                            report["incomplete"] += 1
                            report["freed_bytes"] += size
                            if not dry_run:
                                self._remove_entry(path.name)
                        continue
                    candidates.append((used, path.name, size, loaded[1]))
                    freed = _remove_stale_temp_files(path, now, dry_run)
                    if freed and not dry_run:
                        os.utime(path, (used, used))  # an unlink bumps the folder's mtime: keep its last use
                    report["freed_bytes"] += freed
            report["freed_bytes"] += _remove_stale_temp_files(self.base / "index", now, dry_run)
        candidates.sort()
        total = sum(c[2] for c in candidates)
        removed = set()
        for used, key, size, meta in candidates:
            if max_bytes is None or total <= max_bytes:
                report["kept"] += 1
                report["kept_bytes"] += size
                continue
            total -= size
            removed.add(key)
            report["removed"].append({"key": key, "name": meta.get("name", "?"), "arch": meta.get("arch", "?"),
                                      "bytes": size, "last_used": used})
            report["freed_bytes"] += size
            if not dry_run:
                self._remove_entry(key)
        for spec_key, key in self.index().items():
            if key in removed or not self.entry_dir(key).is_dir():
                report["index_removed"] += 1
                if not dry_run:
                    with contextlib.suppress(OSError):
                        (self.base / "index" / spec_key).unlink()
        if old_versions:
            for version in self.usage()["other_versions"]:
                if version["state"] == "older":
                    report["versions_removed"].append(version)
                    report["freed_bytes"] += version["bytes"]
                    if not dry_run:
                        _remove_tree(Path(version["path"]))
        return report

    def _remove_entry(self, key: str):
        folder = self.entry_dir(key)
        trash = folder.with_name(f".trash-{key}-{os.getpid()}-{threading.get_ident()}")
        try:
            os.replace(folder, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def clear(self) -> int:
        """Remove the LAYOUT folders inside v{SCHEMA} (not v{SCHEMA} itself: a link to another disk
        stays, and so do files not the cache's); returns the entries removed. OSError if read-only."""
        count = len([p for p in self.base.glob("entries/*") if KEY_PATTERN.fullmatch(p.name)])
        for name in LAYOUT:
            path = self.base / name
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
        self.writable = self._prepare()
        return count


def _tree_bytes(path: Path) -> int:
    """Bytes of every file under path (0 if it is gone): what `du` would count, roughly."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _remove_stale_temp_files(folder: Path, now: float, dry_run: bool) -> int:
    """Temp files of writers killed mid-write (_atomic_write's '.NAME.*.tmp'); returns bytes freed."""
    freed = 0
    for path in folder.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            if now - stat.st_mtime > INCOMPLETE_GRACE_S:
                if not dry_run:
                    path.unlink()
                freed += stat.st_size
    return freed


def _is_cache_version(path: Path) -> bool:
    """A v{N} folder flashjit wrote (LAYOUT folders and its own hidden files only, key-named entries):
    prune removes no other, so a cache root pointed at a data folder loses nothing."""
    try:
        if path.is_symlink() or not (path / "entries").is_dir():
            return False
        names, keys = [p.name for p in path.iterdir()], [p.name for p in (path / "entries").iterdir()]
    except OSError:
        return False
    return (all(name in LAYOUT or _OWN_HIDDEN.fullmatch(name) for name in names)
            and all(KEY_PATTERN.fullmatch(key) or _OWN_HIDDEN.fullmatch(key) for key in keys))


def _count_dirs(path: Path) -> int:
    try:
        return sum(1 for p in path.iterdir() if p.is_dir())
    except OSError:
        return 0


def _remove_tree(path: Path):
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    try:
        os.replace(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)
