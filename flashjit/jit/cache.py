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

Trust model. The cache holds code that flashjit runs: cubins on the GPU and host helper libraries
(dlopen()ed into the process). Whoever can write the cache folder can run code as every user of
it, so only the user who runs flashjit, and root, may write it. The SHA-256 in meta.json detects
damage, not forgery: anyone able to write a cubin can write a matching meta.json. So before any
file is read, loaded or executed, trusted_files.py checks it: a regular file reached without
following a link below v{SCHEMA} (a FIFO or device is never opened), within a size cap
(MAX_BYTES), owned by this user or root and writable by no one else; the root, v{SCHEMA} (which
may link to another disk) and every folder on the way likewise (a sticky folder, as /tmp, is
accepted: others may add names but not touch ours). A file that fails is a miss with a warning naming it and why: a cubin is rebuilt (strict
mode raises KernelNotPrewarmed with the reason), a host library is rebuilt or left for numpy; it
is never loaded. A root that fails is not used at all (memory only, one warning). Keys that come
from outside (a bundle's meta.json, index names) are checked against KEY_PATTERN before they name
a file; meta.json fields of the wrong type are damage. A file this user cannot read is reported
(warning, and the strict-mode error), not taken for a plain miss. Files are written 0644 and
folders 0755 (under the umask), so a cache written by root at image build time serves a non-root
server. A cache volume shared by several users therefore needs one writer: fill it as one user
(or root, at image build time) and mount it read-only, or read-only to everyone else; a folder
writable by a group is refused, whatever the group.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import filelock

from .. import env
from ..errors import CacheError
from . import trusted_files
from .cache_format import ENTRY_FILES, KEY_PATTERN, MAX_BYTES, SCHEMA, is_key, meta_problem, require_key
from .cache_upkeep import CacheUpkeep
from .trusted_files import Refused, atomic_file

__all__ = ["ENTRY_FILES", "KEY_PATTERN", "MAX_BYTES", "SCHEMA", "KernelCache", "LockBusy",
           "atomic_file", "default_cache_dir", "is_key", "lock_timeout"]

LOCK_TIMEOUT_S: float | None = None  # a number overrides FLASHJIT_LOCK_TIMEOUT (tests); None reads it at lock time
UNREADABLE_HINT = "make the cache readable for this user (chmod -R a+rX {root}) or run as the user who wrote it"
UNTRUSTED_HINT = ("only files that this user or root wrote, in folders that no one else can write, are used "
                  "(the trust model in docs/deployment.md); for a cache of your own, `chmod -R go-w {root}` "
                  "fixes its modes")
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


def _atomic_write(path: Path, data: bytes):
    with atomic_file(path) as f:
        f.write(data)


class LockBusy(RuntimeError):
    """Another process holds a compile lock longer than the caller chose to wait."""


class KernelCache(CacheUpkeep):
    """Disk cache of compiled kernels; falls back to memory only when the root is unusable.

    A read-only root (a container image, a read-only mount) still serves the entries it holds and
    warns once, at the first kernel it cannot save. A root that fails the trust rule (see the
    module doc) is not read at all.
    """

    def __init__(self, root=None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.base = self.root / f"v{SCHEMA}"
        self._warned = False
        self._warn_lock = threading.Lock()
        self._read_only: str | None = None  # why a readable cache cannot be written (warned at the first write)
        self._unusable: str | None = None  # why nothing is read from this root (warned once)
        self._refusals: dict[str, str] = {}  # entry or portable key -> why its files were not used
        self._reported: set = set()  # refused paths (and "unreadable") already warned about
        self.writable = self._prepare()

    def _prepare(self) -> bool:
        self._read_only = self._unusable = None
        try:
            try:
                if self.root.exists() and not self.root.is_dir():
                    raise CacheError(f"{self.root} exists and is not a folder")
                for sub in ("entries", "locks", "index"):
                    self._folder(sub, make=True)
                probe = self.base / "entries" / f".probe-{os.getpid()}-{threading.get_ident()}"
                probe.write_bytes(b"")
                probe.unlink()
                return True
            except OSError as exc:
                if self._readable():
                    # A read-only cache (a container image, a read-only mount) still serves what it
                    # holds; warn only if a kernel it lacks has to be kept in memory.
                    self._read_only = f"kernel cache at {self.root} is read-only ({exc}): kernels in it are served"
                    return False
                raise
        except Refused as exc:
            self._unusable = f"the kernel cache at {self.root} is not trusted: {exc}"
            self._degrade(f"{self._unusable}; {UNTRUSTED_HINT.format(root=self.root)}")
        except (OSError, CacheError) as exc:
            self._unusable = f"the kernel cache at {self.root} is not usable ({exc})"
            self._degrade(f"kernel cache at {self.root} is not usable ({exc})")
        return False

    def _readable(self) -> bool:
        """Whether the entries folder can be read; raises Refused if it fails the trust rule."""
        try:
            self._folder("entries")
        except OSError:
            return False
        return os.access(self.base / "entries", os.R_OK | os.X_OK)

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

    def _folder(self, *parts: str, make: bool = False) -> Path:
        """base/parts..., checked by the trust rule from the root down (made first, with make);
        v{SCHEMA} itself may be a link, to move the kernels to another disk."""
        check = trusted_files.make_folders if make else trusted_files.check_folders
        return check(self.root, (f"v{SCHEMA}", *parts), follow=1)

    # ---- reading: every file through trusted_files, every failure a miss -----------------------

    def _read(self, parts: tuple, limit: int, subject: str) -> bytes | None:
        """The bytes of base/parts..., or None: missing, refused or unreadable (the last two are
        reported, and remembered under `subject` for why_refused)."""
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
        for name, data in (("kernel.cubin", cubin), ("source.cu", source), ("meta.json", text)):
            if len(data) > MAX_BYTES[name]:
                raise CacheError(f"cannot store entry {key}: its {name} ({len(data)} bytes) is larger than the "
                                 f"cache reads ({MAX_BYTES[name]}); nothing was written")
        if not self.writable:
            return self._not_writable()
        folder = self.entry_dir(key)
        try:
            folder = self._folder_for_writing("entries", key)
            _atomic_write(folder / "kernel.cubin", cubin)
            _atomic_write(folder / "source.cu", source.encode())
            _atomic_write(folder / "meta.json", text)
            if meta.get("portable_key"):
                _atomic_write(self._folder_for_writing("portable") / meta["portable_key"], key.encode())
            return True
        except (OSError, Refused) as exc:
            self._degrade(f"could not write kernel cache entry {folder} ({exc})")
            return False

    def store_index(self, spec_key: str, key: str):
        """Remember spec key -> entry key. Only a shortcut: a read-only cache silently goes without.
        Raises CacheError when either is not a key."""
        require_key("index key", spec_key)
        require_key("entry key", key)
        if self.writable:
            try:
                _atomic_write(self._folder_for_writing("index") / spec_key, key.encode())
            except (OSError, Refused) as exc:
                self._degrade(f"could not write kernel cache index ({exc})")

    @contextlib.contextmanager
    def compile_lock(self, key: str, give_up_after: float | None = None):
        """Held while compiling one key, so concurrent processes compile it once.

        A lock held longer than FLASHJIT_LOCK_TIMEOUT (a hung process) is waited out, then the
        caller compiles anyway: a duplicate compile is harmless, a hang is not. With give_up_after,
        a lock still held after that many seconds (or the timeout, if shorter) raises LockBusy: for
        callers that have something else to fall back on.
        """
        if not self.writable:
            yield
            return
        timeout = lock_timeout() if give_up_after is None else min(give_up_after, lock_timeout())
        lock = filelock.FileLock(str(self.base / "locks" / f"{key}.lock"), timeout=timeout)
        try:
            self._folder("locks")
            lock.acquire()
        except filelock.Timeout:
            if give_up_after is not None:
                raise LockBusy(f"{lock.lock_file} is held by another process for over {timeout:g} s") from None
            log.warning("kernel cache lock %s held for over %g s (FLASHJIT_LOCK_TIMEOUT); compiling without it",
                        lock.lock_file, timeout)
            yield
            return
        except (OSError, Refused) as exc:
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
