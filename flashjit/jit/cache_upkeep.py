"""What a kernel cache holds on disk, and freeing it: entries, index, usage, prune, clear (KernelCache's upkeep).

A mixin of KernelCache (cache.py): it uses the cache's root, base, writable, foreign, _unusable,
load(), lookup_index(), entry_dir() and _prepare(), and reads nothing itself but folder listings
and sizes, so the trust rule of cache.py applies to every entry it reports or keeps. It removes
only from folders that are flashjit caches (cache_layout.py), renaming before deleting and
following no link (trusted_writes.move_away).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from ..errors import CacheError
from .cache_format import KEY_PATTERN, SCHEMA
from .cache_layout import LAYOUT, VERSION_FOLDER, is_cache_version
from .trusted_writes import move_away, remove_tree

INCOMPLETE_GRACE_S = 3600.0  # prune removes what killed writers and pruners left after this long
# Leftovers of killed processes, per folder: temp files of writes, entries or versions being
# removed ('.trash-'), write probes ('.probe-').
_LEFTOVERS = re.compile(r"\..*\.tmp|\.trash-.*|\.probe-.*")


class CacheUpkeep:
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
                match = VERSION_FOLDER.fullmatch(path.name)
                if match and path.is_dir() and int(match.group(1)) != SCHEMA:
                    version = int(match.group(1))
                    state = ("newer (kept)" if version > SCHEMA else "older" if is_cache_version(self.root, path.name)
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
        old_versions, the v{N} folders of older schemas in flashjit's layout. What killed
        processes left (entries without a valid meta.json, temp files, '.trash-' and '.probe-'
        leftovers) goes once INCOMPLETE_GRACE_S old, and so do index files naming removed
        entries. Safe while other processes use the cache: an entry is renamed away before it is
        deleted, so readers see it whole or not at all (and a miss only means a recompile).
        Raises CacheError for a v{SCHEMA} folder that is not a flashjit cache, or a cache that is
        not read at all (not trusted): every entry of it would look incomplete.
        """
        if self.foreign:
            raise CacheError(f"{self.foreign}; nothing was pruned")
        if self._unusable and (self.base / "entries").is_dir():
            raise CacheError(f"{self._unusable}; nothing was pruned")
        report = {"removed": [], "incomplete": 0, "freed_bytes": 0, "index_removed": 0, "versions_removed": [],
                  "kept": 0, "kept_bytes": 0, "dry_run": dry_run}
        folder = self.base / "entries"
        candidates = []  # (last use, key, bytes, meta or None)
        now = time.time()
        if folder.is_dir():
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
                    freed = _remove_leftovers(path, now, dry_run)
                    if freed and not dry_run:
                        os.utime(path, (used, used))  # an unlink bumps the folder's mtime: keep its last use
                    report["freed_bytes"] += freed
        for leftovers in (folder, self.base / "index", self.base / "portable", self.base):
            report["freed_bytes"] += _remove_leftovers(leftovers, now, dry_run)
        report["freed_bytes"] += _remove_leftovers(self.root, now, dry_run, re.compile(r"\.trash-v\d+-.*"))
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
                    move_away(self.base / "index" / spec_key)
        if old_versions:
            for version in self.usage()["other_versions"]:
                if version["state"] == "older":
                    report["versions_removed"].append(version)
                    report["freed_bytes"] += version["bytes"]
                    if not dry_run:
                        move_away(Path(version["path"]))
        return report

    def _remove_entry(self, key: str):
        move_away(self.entry_dir(key))

    def clear(self) -> int:
        """Remove the LAYOUT folders inside v{SCHEMA} (not v{SCHEMA} itself: a link to another disk
        stays, and so do its marker and files not the cache's); returns the entries removed.
        CacheError when v{SCHEMA} is not a flashjit cache (nothing is removed); OSError if read-only."""
        if self.foreign:
            raise CacheError(f"{self.foreign}; nothing was removed")
        count = len([p for p in self.base.glob("entries/*") if KEY_PATTERN.fullmatch(p.name)])
        for name in LAYOUT:  # each renamed away whole, then deleted: a writer meanwhile starts a new one
            path = self.base / name
            if os.path.lexists(path) and not move_away(path):
                raise OSError(f"could not remove {path}")
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


def _remove_leftovers(folder: Path, now: float, dry_run: bool, pattern: re.Pattern = _LEFTOVERS) -> int:
    """What killed processes left in folder (names matching pattern, INCOMPLETE_GRACE_S old or
    more): removed, following no link; returns the bytes freed."""
    freed = 0
    try:
        names = [name for name in os.listdir(folder) if pattern.fullmatch(name)]
    except OSError:
        return 0
    for name in names:
        path = folder / name
        with contextlib.suppress(OSError):
            if now - os.lstat(path).st_mtime > INCOMPLETE_GRACE_S:
                freed += _tree_bytes(path) if path.is_dir() and not path.is_symlink() else os.lstat(path).st_size
                if not dry_run:
                    remove_tree(path)
    return freed


def _count_dirs(path: Path) -> int:
    try:
        return sum(1 for p in path.iterdir() if p.is_dir())
    except OSError:
        return 0
