"""Every file flashjit writes, written under one rule: the write half of the trust model.

The read rule (trusted_files.py) decides what flashjit uses; this one decides where and how it
writes, so that no write can be turned against a file flashjit did not mean to touch:

  * A folder is written into only after it passed the read rule, checked from its root down
    (make_folders): owned by this user or root, writable by no one else (or sticky, as /tmp), no
    link followed below the root. So no other user can have put anything under the name written.
  * A file is written under a fresh temp name beside its own (O_CREAT | O_EXCL | O_NOFOLLOW: never
    through a link, never into an existing file), fsynced, then renamed over its name (atomic_file).
    The rename replaces a regular file, or a link itself, never what the link names. Anything else
    under the name (a folder, a FIFO, a device, a socket) is never replaced: Refused names it. The
    cache, whose folders only this user or root can write, moves such a thing away (move_away) and
    writes again.
  * An output the user names (`flashjit cache export OUT`) is written by output_file: an existing
    FIFO or character device is written as a stream (a FIFO only while a reader has it open, so
    nothing hangs), a link, folder, block device or socket is refused by name.
  * Locks (file_lock) are opened O_NOFOLLOW, never truncated, and must be regular files.
  * Nothing is created in a version folder that is not a flashjit cache: cache.py checks the
    cache's marker file (cache_format.MARKER) before its first write.
  * Scratch files (a compiler's output) live in private folders (tempfile.mkdtemp: mode 0700, a
    fresh name) that are removed after use; failed sources without a usable cache go to a
    per-user folder that passes the rule above (private_folder).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

from .trusted_files import KINDS, Refused, check_folders, check_one_folder

FILE_MODE = 0o644
FOLDER_MODE = 0o755
LOCK_POLL_S = 0.05


def make_folders(root: Path, parts=(), follow: int = 0, mode: int = FOLDER_MODE) -> Path:
    """root/parts[0]/parts[1]/... made where missing (mode 0755 under the umask, unless given) and
    checked by the read rule from the root down (links followed for the root and the first
    `follow` parts only)."""
    root = Path(root)
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, mode)
    path = check_folders(root)
    for depth, part in enumerate(parts):
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode)
        check_one_folder(path, follow=depth < follow)
    return path


def _replaceable(path: Path):
    """Refused unless the name is free, a regular file or a link (which a rename replaces itself)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise Refused(path, KINDS.get(stat.S_IFMT(mode), "not a file") + ": flashjit does not replace it")


@contextlib.contextmanager
def atomic_file(path: Path):
    """A binary file object whose contents appear at `path` whole or not at all: written to a temp
    file beside it ('.NAME.<random>.tmp', mode 0644 under the umask, never through a link),
    fsynced, then renamed over `path`; removed on any error. Raises Refused, before writing, when
    `path` is a folder, FIFO, device or socket."""
    path = Path(path)
    _replaceable(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _replaceable(path)  # appeared while writing
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_file(path: Path, data: bytes):
    """atomic_file with these bytes."""
    with atomic_file(path) as f:
        f.write(data)


def probe(folder: Path):
    """Make and remove an empty file in folder (never through a link): OSError when this process
    cannot write there. The name ('.probe-...') is this thread's own; a pruner may remove it first."""
    path = Path(folder) / f".probe-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(2)}"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def move_away(path: Path) -> bool:
    """Rename whatever is at `path` (a link is moved, never followed) to a hidden '.trash-' name
    beside it, then delete that: readers see it whole or not at all. False if nothing was moved."""
    path = Path(path)
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(2)}")
    try:
        os.replace(path, trash)
    except OSError:
        return False
    remove_tree(trash)
    return True


def remove_tree(path: Path):
    """Delete a folder tree (a link or file: the name only), following no link; never fails."""
    try:
        folder = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return
    if folder:
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def output_file(path: Path):
    """A binary file object for an output the user named (see the module doc): an atomic_file for a
    new or regular file, a stream into an existing FIFO (that a reader holds open) or character
    device. Raises Refused, before writing anything, for a link, folder, block device or socket."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    if stat.S_ISLNK(mode):
        raise Refused(path, f"a symbolic link (to {os.readlink(path)}): flashjit does not write through links; "
                            "give the file it names")
    if stat.S_ISREG(mode):
        with atomic_file(path) as f:
            yield f
        return
    if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        raise Refused(path, KINDS.get(stat.S_IFMT(mode), "not a file") + ": give a file name")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO no process reads: writing would wait forever
            raise Refused(path, "a FIFO that no process is reading") from None
        if exc.errno == errno.ELOOP:
            raise Refused(path, "a symbolic link: flashjit does not write through links") from None
        raise
    try:
        if stat.S_IFMT(os.fstat(fd).st_mode) != stat.S_IFMT(mode):
            raise Refused(path, "replaced while it was opened")
        os.set_blocking(fd, True)  # a reader that reads slowly is waited for, as any pipe's writer
        with os.fdopen(fd, "wb", closefd=False) as f:
            yield f
    finally:
        os.close(fd)


def private_folder(name: str) -> Path:
    """A folder of this user's in the temp folder ($TMPDIR/NAME-<uid>, mode 0700), made and checked
    by the rule above; one that another user made first is not used: a fresh mkdtemp folder is,
    instead. Raises Refused (or OSError) when the temp folder itself fails the rule."""
    root = check_folders(Path(tempfile.gettempdir()))
    try:
        return make_folders(root, (f"{name}-{os.geteuid()}",), mode=0o700)
    except (OSError, Refused):
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))


class LockTimeout(Exception):
    """file_lock waited its timeout for a lock another process holds."""


@contextlib.contextmanager
def file_lock(path: Path, timeout: float):
    """An exclusive flock on `path` (created 0644 where missing; opened without following a link,
    never truncated), held for the block. Raises LockTimeout after `timeout` seconds, Refused when
    `path` is not a regular file, OSError when it cannot be opened. The lock dies with its process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(path, "not a regular file")
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(path) from None
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock
