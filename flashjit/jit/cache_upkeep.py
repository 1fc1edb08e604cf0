"""What a kernel cache holds on disk, and freeing it: usage, prune, clear (KernelCache's upkeep).

A mixin of KernelCache (cache.py): it uses the cache's root, base, writable, _unusable, entries(),
index(), load(), entry_dir() and _prepare(), and reads nothing itself but folder listings and
sizes, so the trust rule of cache.py applies to every entry it reports or keeps.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from pathlib import Path

from ..errors import CacheError
from .cache_format import KEY_PATTERN, SCHEMA

INCOMPLETE_GRACE_S = 3600.0  # prune removes entries that never got their meta.json after this long
_VERSION_FOLDER = re.compile(r"v(\d+)")
LAYOUT = ("entries", "index", "portable", "locks", "failed", "host")  # what a v{N} folder holds
_OWN_HIDDEN = re.compile(r"\.(probe|trash)-.*|\..*\.tmp")  # probes, entries being removed, temp files


class CacheUpkeep:
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
        Raises CacheError for a cache that is not read at all (not trusted): every entry of it
        would look incomplete.
        """
        if self._unusable and (self.base / "entries").is_dir():
            raise CacheError(f"{self._unusable}; nothing was pruned")
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
        if trash.is_symlink():  # a link in place of an entry: remove the link, never what it names
            with contextlib.suppress(OSError):
                trash.unlink()
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
