"""On-disk kernel cache: content-addressed cubins that any host with the same NVRTC can reuse.

Entries are named by the keys of keys.py: SHA-256 over what the cubin is built from (the
rendered source, arch, options, NVRTC and flashjit versions), with no absolute paths, mtimes or
host names, so a cache built on one host serves another.

Layout under the root:  v{SCHEMA}/entries/<key>/{kernel.cubin, source.cu, meta.json}
                        v{SCHEMA}/index/<spec key>         (spec + template contents -> entry key)
                        v{SCHEMA}/portable/<portable key>  (source without the NVRTC version -> entry key)
                        v{SCHEMA}/locks/<key>.lock         (outside the entries)
                        v{SCHEMA}/host/<name>-<key>.so     (C host helpers: host_library.py)
                        v{SCHEMA}/CACHEDIR.TAG             (the marker: this folder is a flashjit cache)
The index lets a fresh process find a kernel without rendering it or loading NVRTC (~100 ms);
its key (keys.index_key) hashes the spec, its tiling, every template file's contents, the flashjit
version and the installed compiler's, so editing a template or a tuning table, or upgrading, misses
it and falls back to the full key.
meta.json is written last and holds the cubin's SHA-256: an entry without it, or whose cubin does
not match it, is a miss and is rebuilt. Locks only stop two processes compiling the same key;
correctness never depends on them, and flock-based locks die with their process. An unusable root degrades to memory only,
with one warning; a read-only root still serves what it holds (warning at the first write); both
are looked at again while the process runs (cache_root.py).
Last use: the engine bumps an entry folder's mtime when it loads the entry from disk (one utime
call; memory hits never touch the disk), so `prune` evicts least recently used entries first.
Other v{N} folders under the root hold entries of other schema versions; this version never reads
them, `usage` reports them and `prune(old_versions=True)` removes the older ones in its layout.

Trust model. The cache holds code that flashjit runs: cubins on the GPU and host helper libraries
(dlopen()ed into the process). Whoever can write the cache folder can run code as every user of
it, so only the user who runs flashjit, and root, may write it. The SHA-256 in meta.json detects
damage, not forgery. Two rules follow, one for reads and one for writes (docs/deployment.md).
  Reads (trusted_files.py): before any file is read, loaded or executed it must be a regular file
  reached without following a link below v{SCHEMA} (a FIFO or device is never opened), within its
  cap (MAX_BYTES), owned by this user or root and writable by no one else; the root, v{SCHEMA}
  (which may link to another disk) and every folder on the way likewise (a sticky folder, as /tmp,
  is accepted). A file that fails is a miss with a warning naming it and why (strict mode's
  KernelNotPrewarmed gives the reason); it is never loaded. A root that fails is not used at all.
  Keys from outside (a bundle's meta.json, index names) must match KEY_PATTERN before they name a
  file; meta.json fields of the wrong type are damage; a file this user cannot read is reported.
  Writes (trusted_writes.py): only into folders that pass the read rule, only in a v{SCHEMA} that
  is a flashjit cache (its marker, cache_layout.py), each file under a fresh temp name (never
  through a link) renamed over its own. A rename never replaces a folder, FIFO or device: the cache
  moves such a thing away first. Locks are opened without following links; failed sources go to
  the cache's failed/ or this user's temp folder, never a shared one. Files are written 0644 and
  folders 0755 (under the umask), so a cache written by root at image build time serves a non-root
  server. A cache shared by several users therefore needs one writer, and a folder writable by a
  group is refused, whatever the group.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

from .. import env
from ..errors import CacheError
from . import trusted_files, trusted_writes
from .cache_format import ENTRY_FILES, KEY_PATTERN, MAX_BYTES, SCHEMA, is_key, meta_problem, require_key
from .cache_root import UNTRUSTED_HINT, CacheRoot, default_cache_dir
from .cache_upkeep import CacheUpkeep
from .trusted_files import Refused
from .trusted_writes import atomic_file

__all__ = ["ENTRY_FILES", "KEY_PATTERN", "MAX_BYTES", "SCHEMA", "KernelCache", "LockBusy",
           "atomic_file", "default_cache_dir", "is_key", "lock_timeout"]

LOCK_TIMEOUT_S: float | None = None  # a number overrides FLASHJIT_LOCK_TIMEOUT (tests); None reads it at lock time
UNREADABLE_HINT = "make the cache readable for this user (chmod -R a+rX {root}) or run as the user who wrote it"
log = logging.getLogger("flashjit")


def lock_timeout() -> float:
    """Seconds to wait for another process's compile of the same key: read at every lock, not at import."""
    return float(LOCK_TIMEOUT_S) if LOCK_TIMEOUT_S is not None else env.lock_timeout()


class LockBusy(RuntimeError):
    """Another process holds a compile lock longer than the caller chose to wait."""


class KernelCache(CacheRoot, CacheUpkeep):
    """Disk cache of compiled kernels; falls back to memory only when the root is unusable.

    A read-only root (a container image, a read-only mount) still serves the entries it holds and
    warns once, at the first kernel it cannot save. A root that fails the trust rule (see the
    module doc) is not read at all.
    """

    def entry_dir(self, key: str) -> Path:
        return self.base / "entries" / key

    # ---- reading: every file through trusted_files, every failure a miss -----------------------

    def _read(self, parts: tuple, limit: int, subject: str) -> bytes | None:
        """The bytes of base/parts..., or None: missing, refused or unreadable (the last two are
        reported, and remembered under `subject` for why_refused)."""
        if self._unusable:
            self._recheck()
            if self._unusable:
                return None
        try:
            return trusted_files.read_file(self.root, (f"v{SCHEMA}", *parts), limit, follow=1)
        except Refused as exc:
            self._refuse(subject, f"{exc}; {UNTRUSTED_HINT.format(root=self.root)}", exc.path)
        except PermissionError as exc:
            path = self.base.joinpath(*parts)
            self._refuse(subject, f"cannot read {path} ({exc.strerror}): {UNREADABLE_HINT.format(root=self.root)}",
                         "unreadable")
        except OSError:  # missing (a miss), or a failing disk: also a miss
            pass
        return None

    def _refuse(self, subject: str, why: str, report_as):
        self._refusals[subject] = why
        with self._warn_lock:
            if report_as in self._reported:
                return
            self._reported.add(report_as)
        log.warning("kernel cache file not used: %s", why)

    def why_refused(self, *subjects: str) -> str | None:
        """Why the files of the first of these entry (or portable) keys that has a reason were not
        used, or why the whole cache is not; None when nothing was refused."""
        return next((self._refusals[s] for s in subjects if s in self._refusals), None) or self._unusable

    def _read_key(self, parts: tuple, limit: int, subject: str) -> str | None:
        data = self._read(parts, limit, subject)
        try:
            key = data.decode("ascii").strip() if data is not None else None
        except UnicodeDecodeError:
            return None
        return key if is_key(key) else None

    def load(self, key: str) -> tuple[bytes, dict] | None:
        """The cubin and metadata of a verified entry, or None (missing, partial, corrupt or refused)."""
        if not is_key(key):
            return None
        self._refusals.pop(key, None)  # a reason is kept for the latest load only
        raw = self._read(("entries", key, "meta.json"), MAX_BYTES["meta.json"], key)
        cubin = self._read(("entries", key, "kernel.cubin"), MAX_BYTES["kernel.cubin"], key) if raw else None
        meta = self._verified_meta(key, raw, cubin) if cubin is not None else None
        return (cubin, meta) if meta is not None else None

    def entry_files(self, key: str) -> dict[str, bytes] | None:
        """Every file of a verified entry (ENTRY_FILES -> bytes), each read under the trust rule,
        or None: what an export copies, so that no link or FIFO in the cache reaches a bundle."""
        if not is_key(key):
            return None
        files = {name: self._read(("entries", key, name), MAX_BYTES[name], key) for name in ENTRY_FILES}
        if None in files.values() or self._verified_meta(key, files["meta.json"], files["kernel.cubin"]) is None:
            return None
        return files

    def _verified_meta(self, key: str, raw: bytes, cubin: bytes) -> dict | None:
        """meta.json decoded, if it describes this entry and this cubin; else None, with a warning."""
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
            problem = f"meta.json does not decode ({type(exc).__name__})"
        else:
            problem = meta_problem(meta)
        if problem is None and (meta["key"] != key or meta["schema"] != SCHEMA
                                or meta["cubin_sha256"] != hashlib.sha256(cubin).hexdigest()
                                or meta.get("cubin_bytes", len(cubin)) != len(cubin)):
            problem = "meta.json does not match the entry or its cubin"
        if problem is None:
            return meta
        self._refusals[key] = f"the entry {self.entry_dir(key)} is damaged ({problem})"
        log.warning("kernel cache entry %s is corrupt (%s); it is a miss", self.entry_dir(key), problem)
        return None

    def load_portable(self, portable: str) -> tuple[str, bytes, dict] | None:
        """(key, cubin, meta) of a verified entry built from the same source by any NVRTC, or None."""
        if not is_key(portable):
            return None
        self._refusals.pop(portable, None)
        key = self._read_key(("portable", portable), MAX_BYTES["portable"], portable)
        hit = self.load(key) if key else None
        if hit is None or hit[1].get("portable_key") != portable:
            if key in self._refusals:
                self._refusals.setdefault(portable, self._refusals[key])
            return None
        return (key,) + hit

    def lookup_index(self, spec_key: str) -> str | None:
        return self._read_key(("index", spec_key), MAX_BYTES["index"], spec_key) if is_key(spec_key) else None

    def touch(self, key: str):
        """Record a use of an entry (its folder's mtime), for least-recently-used pruning. Never fails."""
        with contextlib.suppress(OSError):
            os.utime(self.entry_dir(key), follow_symlinks=False)

    # ---- writing: keys checked before they name a file, folders checked before they are used ---

    def _folder_for_writing(self, *parts: str) -> Path:
        """base/parts..., made where missing and checked; an entry folder that fails the check is
        moved away and made anew (its parent passed, so only this user or root put it there)."""
        try:
            return self._folder(*parts, make=True)
        except Refused:
            if parts[0] != "entries" or len(parts) != 2:
                raise
            self._remove_entry(parts[1])
            return self._folder(*parts, make=True)

    def _write(self, folder_parts: tuple, files: dict[str, bytes], mend=None):
        """Write files into base/folder_parts (made and checked). Something no write may replace
        (a folder, FIFO or device: trusted_writes) where a file goes is moved away, by mend() or
        by name, and the write done again: its folder passed, so only this user or root put it there."""
        folder = self._folder_for_writing(*folder_parts)
        try:
            for name, data in files.items():
                trusted_writes.write_file(folder / name, data)
        except Refused as exc:
            mend() if mend else trusted_writes.move_away(exc.path)
            folder = self._folder_for_writing(*folder_parts)
            for name, data in files.items():
                trusted_writes.write_file(folder / name, data)

    def store(self, key: str, cubin: bytes, source: str, meta: dict) -> bool:
        """Write an entry (cubin and source first, metadata last). False if it could not be written.

        Raises CacheError, writing nothing, when the key or meta's portable_key is not a key, a
        meta field has the wrong type, or a file would exceed its MAX_BYTES cap.
        """
        require_key("entry key", key)
        if meta.get("portable_key") is not None:
            require_key("portable_key", meta["portable_key"])
        meta = dict(meta, key=key, schema=SCHEMA, cubin_sha256=hashlib.sha256(cubin).hexdigest(), cubin_bytes=len(cubin))
        text, problem = json.dumps(meta, indent=1, sort_keys=True).encode(), meta_problem(meta)
        if problem:
            raise CacheError(f"cannot store entry {key}: {problem}; nothing was written")
        files = {"kernel.cubin": cubin, "source.cu": source.encode(), "meta.json": text}
        for name, data in files.items():
            if len(data) > MAX_BYTES[name]:
                raise CacheError(f"cannot store entry {key}: its {name} ({len(data)} bytes) is larger than the "
                                 f"cache reads ({MAX_BYTES[name]}); nothing was written")
        if not self.writable:
            self._recheck()
            if not self.writable:
                return self._not_writable()
        try:
            self._write(("entries", key), files, mend=lambda: self._remove_entry(key))
            if meta.get("portable_key"):
                self._write(("portable",), {meta["portable_key"]: key.encode()})
            return True
        except (OSError, Refused) as exc:
            self._degrade(f"could not write kernel cache entry {self.entry_dir(key)} ({exc})")
            return False

    def store_index(self, spec_key: str, key: str):
        """Remember spec key -> entry key. Only a shortcut: a read-only cache silently goes without.
        Raises CacheError when either is not a key."""
        require_key("index key", spec_key)
        require_key("entry key", key)
        if self.writable:
            try:
                self._write(("index",), {spec_key: key.encode()})
            except (OSError, Refused) as exc:
                self._degrade(f"could not write kernel cache index ({exc})")

    @contextlib.contextmanager
    def compile_lock(self, key: str, give_up_after: float | None = None):
        """Held while compiling one key, so concurrent processes compile it once.

        A lock held longer than FLASHJIT_LOCK_TIMEOUT (a hung process) is waited out, then the
        caller compiles anyway: a duplicate compile is harmless, a hang is not. With give_up_after,
        a lock still held after that many seconds (or the timeout, if shorter) raises LockBusy: for
        callers that have something else to fall back on. A lock that cannot be taken at all is
        compiled without, with one warning.
        """
        if not self.writable:
            yield
            return
        timeout = lock_timeout() if give_up_after is None else min(give_up_after, lock_timeout())
        path = self.base / "locks" / f"{key}.lock"
        with contextlib.ExitStack() as held:
            try:
                self._folder("locks")
                held.enter_context(trusted_writes.file_lock(path, timeout))
            except trusted_writes.LockTimeout:
                if give_up_after is not None:
                    raise LockBusy(f"{path} is held by another process for over {timeout:g} s") from None
                log.warning("kernel cache lock %s held for over %g s (FLASHJIT_LOCK_TIMEOUT); compiling without it",
                            path, timeout)
            except (OSError, Refused) as exc:
                self._warn_once("lock", f"could not take the compile lock {path} ({exc}); compiling without it "
                                        "(another process may compile the same kernel meanwhile; the kernel is saved)")
            yield

    def failed_source_folder(self) -> Path | None:
        """v{SCHEMA}/failed, made and checked, for the sources NVRTC rejects; None when the cache
        cannot take them (not trusted, not a cache, read-only)."""
        if not self.writable:
            return None
        try:
            return self._folder("failed", make=True)
        except (OSError, Refused):
            return None
