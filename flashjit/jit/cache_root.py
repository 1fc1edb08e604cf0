"""Whether a kernel cache's root can be used, and how its state is told: KernelCache's first half.

A mixin of KernelCache (cache.py). _prepare decides, at construction and again at most every
RETRY_S while the cache is unusable or read-only (a folder that `clear`, a remount or an operator
had away is used once it is back):
  * usable: the root and v{SCHEMA} pass the trust rule, v{SCHEMA} is a flashjit cache (its marker,
    written before anything else, or its layout: cache_layout.py), and a probe file can be written;
  * read-only: the entries can be read but not written: served, and one warning at the first write;
  * unusable: not trusted, not a cache, or not a folder: nothing read or written, one warning.
With create=False (commands that only read or remove) nothing is made and no probe is written.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from .. import env
from ..errors import CacheError
from . import trusted_files, trusted_writes
from .cache_format import SCHEMA
from .cache_layout import MARKER, is_marked, marker_text, version_problem
from .trusted_files import Refused

RETRY_S = 1.0  # how often an unusable or read-only cache is looked at again
UNTRUSTED_HINT = ("only files that this user or root wrote, in folders that no one else can write, are used "
                  "(the trust model in docs/deployment.md); for a cache of your own, `chmod -R go-w {root}` "
                  "fixes its modes")
log = logging.getLogger("flashjit")


def default_cache_dir() -> Path:
    """FLASHJIT_CACHE_DIR, else the user cache folder (~/.cache/flashjit on Linux)."""
    folder = env.cache_dir()
    if folder is not None:
        return folder
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashjit", appauthor=False))


class CacheRoot:
    def __init__(self, root=None, create: bool = True):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self.base = self.root / f"v{SCHEMA}"
        self.create = create  # False: a command that only reads or removes, which makes no folder
        self._warned = False
        self._warn_lock = threading.Lock()
        self._read_only: str | None = None  # why a readable cache cannot be written (warned at the first write)
        self._unusable: str | None = None  # why nothing is read from this root (warned once)
        self.foreign: str | None = None  # why v{SCHEMA} is not a flashjit cache (cache_layout), if it is not
        self._refusals: dict[str, str] = {}  # entry or portable key -> why its files were not used
        self._reported: set = set()  # refused paths (and "unreadable") already warned about
        self.writable = self._prepare()

    @property
    def missing(self) -> bool:
        """Whether the root folder does not exist (a cache opened with create=False)."""
        return not self.root.exists()

    def _prepare(self) -> bool:
        self._read_only = self._unusable = self.foreign = None
        self._checked_at = time.monotonic()
        try:
            try:
                if self.root.exists() and not self.root.is_dir():
                    raise CacheError(f"{self.root} exists and is not a folder")
                if not self.create:
                    return self._open_existing()
                trusted_writes.make_folders(self.root, (f"v{SCHEMA}",), follow=1)
                self._claim()
                for sub in ("entries", "locks", "index"):
                    self._folder(sub, make=True)
                trusted_writes.probe(self.base / "entries")
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
            if self.create or not self.foreign:  # a command that only reads or removes reports a foreign folder itself
                self._degrade(f"kernel cache at {self.root} is not usable ({exc})")
        return False

    def _claim(self):
        """Mark v{SCHEMA} as flashjit's before anything is written into it (cache_layout.py); CacheError
        when it is someone else's folder."""
        self.foreign = version_problem(self.root, f"v{SCHEMA}")
        if self.foreign:
            raise CacheError(self.foreign)
        if not is_marked(self.root, f"v{SCHEMA}"):
            trusted_writes.write_file(self.base / MARKER, marker_text(SCHEMA))

    def _open_existing(self) -> bool:
        """_prepare without making anything: whether this user can write the cache as it is."""
        if not self.root.exists():
            return False
        self.foreign = version_problem(self.root, f"v{SCHEMA}")
        if self.foreign:
            raise CacheError(self.foreign)
        return self._readable() and all(os.access(p, os.W_OK | os.X_OK) for p in (self.base, self.base / "entries"))

    def _recheck(self):
        """Look at an unusable or read-only cache again, at most every RETRY_S: a folder that `clear`,
        a remount or an operator had away is used again once it is back."""
        if time.monotonic() - self._checked_at >= RETRY_S:
            self.writable = self._prepare()

    def _readable(self) -> bool:
        """Whether the entries folder can be read; raises Refused if it fails the trust rule."""
        try:
            self._folder("entries")
        except OSError:
            return False
        return os.access(self.base / "entries", os.R_OK | os.X_OK)

    def _degrade(self, why: str):
        with self._warn_lock:
            if self._warned:
                return
            self._warned = True
        if self.create:
            log.warning("%s; new kernels are compiled and kept in memory only for this process. "
                        "Set FLASHJIT_CACHE_DIR or Engine(cache_dir=...) to a writable folder.", why)
        else:  # a command that only reads or removes: nothing is compiled
            log.warning("%s", why)

    def _warn_once(self, topic: str, message: str):
        with self._warn_lock:
            if topic in self._reported:
                return
            self._reported.add(topic)
        log.warning("%s", message)

    def _not_writable(self) -> bool:
        if self._read_only:
            self._degrade(self._read_only)
        return False

    def _folder(self, *parts: str, make: bool = False) -> Path:
        """base/parts..., checked by the trust rule from the root down (made first, with make);
        v{SCHEMA} itself may be a link, to move the kernels to another disk."""
        check = trusted_writes.make_folders if make else trusted_files.check_folders
        return check(self.root, (f"v{SCHEMA}", *parts), follow=1)
