"""On-disk kernel cache: content-addressed cubins that any host with the same NVRTC can reuse.

Key invariants (see cache_key):
  * the key is SHA-256 over the schema number, the flashjit version, the NVRTC version, the arch,
    the compile options and the rendered source (which inlines every template and header);
  * no absolute paths, mtimes or host names go in, so a cache built on one host serves another.

Layout under the root:  v{SCHEMA}/entries/<key>/{kernel.cubin, source.cu, meta.json}
                        v{SCHEMA}/index/<spec key>         (spec + template contents -> entry key)
                        v{SCHEMA}/locks/<key>.lock        (outside the entries)
The index lets a fresh process find a kernel without rendering it or loading NVRTC (~100 ms);
its key hashes the spec, every template file's contents and the flashjit version, so editing a
template or upgrading flashjit misses it and falls back to the full key.
meta.json is written last and holds the cubin's SHA-256: an entry without it, or whose cubin does
not match it, is a miss and is rebuilt. Every file is written to a temp file, fsynced and
os.replace()d. Locks only stop two processes compiling the same key; correctness never depends on
them, and flock-based locks die with their process. An unusable root degrades to memory only,
with one warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import filelock

from .errors import CacheError

SCHEMA = 1
LOCK_TIMEOUT_S = float(os.environ.get("FLASHJIT_LOCK_TIMEOUT", "120"))
log = logging.getLogger("flashjit")


def default_cache_dir() -> Path:
    env = os.environ.get("FLASHJIT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashjit", appauthor=False))


def cache_key(source: str, arch: str, options, nvrtc_version, flashjit_version: str) -> str:
    h = hashlib.sha256()
    for part in (f"schema={SCHEMA}", f"flashjit={flashjit_version}", f"nvrtc={tuple(nvrtc_version)}",
                 f"arch={arch}", "options=" + " ".join(options)):
        h.update(part.encode() + b"\0")
    h.update(source.encode())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class KernelCache:
    """Disk cache of compiled kernels; falls back to memory only when the root is unusable."""

    def __init__(self, root=None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.base = self.root / f"v{SCHEMA}"
        self._warned = False
        self._warn_lock = threading.Lock()
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
            self._degrade(f"kernel cache at {self.root} is not usable ({exc})")
            return False

    def _degrade(self, why: str):
        with self._warn_lock:
            if not self._warned:
                self._warned = True
                log.warning("%s; kernels are compiled and kept in memory only for this process. "
                            "Set FLASHJIT_CACHE_DIR or Engine(cache_dir=...) to a writable folder.", why)

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
            return False
        folder = self.entry_dir(key)
        meta = dict(meta, key=key, schema=SCHEMA, cubin_sha256=hashlib.sha256(cubin).hexdigest(), cubin_bytes=len(cubin))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(folder / "kernel.cubin", cubin)
            _atomic_write(folder / "source.cu", source.encode())
            _atomic_write(folder / "meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())
            return True
        except OSError as exc:
            self._degrade(f"could not write kernel cache entry {folder} ({exc})")
            return False

    def lookup_index(self, spec_key: str) -> str | None:
        try:
            key = (self.base / "index" / spec_key).read_text().strip()
        except OSError:
            return None
        return key if len(key) == 64 else None

    def store_index(self, spec_key: str, key: str):
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
        lock = filelock.FileLock(str(self.base / "locks" / f"{key}.lock"), timeout=LOCK_TIMEOUT_S)
        try:
            lock.acquire()
        except filelock.Timeout:
            log.warning("kernel cache lock %s held for over %.0f s; compiling without it", lock.lock_file, LOCK_TIMEOUT_S)
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
                loaded = self.load(entry.name) if entry.is_dir() else None
                if loaded:
                    found.append(dict(loaded[1], path=str(entry)))
        return found

    def clear(self) -> int:
        """Remove every entry and lock; returns the number of entries removed."""
        count = len(list((self.base / "entries").glob("*"))) if (self.base / "entries").is_dir() else 0
        if self.base.exists():
            shutil.rmtree(self.base)
        self.writable = self._prepare()
        return count
