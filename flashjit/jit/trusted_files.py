"""Cache files read and written so that nothing another user could have written is ever used.

A file under a root (the kernel cache folder, or a private temp folder) is read, loaded or run
only if:
  * it is a regular file, reached without following a symbolic link: lstat says so before it is
    opened (a FIFO, device or socket is never opened), O_NOFOLLOW opens it and fstat on the open
    descriptor says so again, for the same inode;
  * it is no larger than its cap, and no more than the cap is ever read;
  * it, and every folder from the root down to it, belongs to this process's user or to root;
  * none of them is writable by group or others; a folder with the sticky bit (as /tmp) is the
    exception: others may add names there but cannot rename or remove ours, and whatever they add
    fails the owner check.
The root's own path may pass through links (the operator chose it), and so may the first
`follow` folders below it (the cache's v{N} folder, which an operator may move to another disk and
link back); the folders they lead to are checked as any other. Below those, no link is followed. Only this user and root can change a folder that passes, so what passed a check stays
as it was until it is used: no other user can swap a file between the check and the load.

What fails raises Refused (its message names the file and the reason); a file this user may not
read raises PermissionError, for the caller to report; a missing one, FileNotFoundError.
Writing has its own rule, built on this one: trusted_writes.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link"}


class Refused(Exception):
    """A file or folder that is there but fails the trust rule; not used."""

    def __init__(self, path, why: str):
        super().__init__(f"{path} is {why}")
        self.path, self.why = Path(path), why


def _check_owner_and_mode(path: Path, st: os.stat_result, folder: bool):
    if st.st_uid not in (os.geteuid(), 0):
        raise Refused(path, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (folder and st.st_mode & stat.S_ISVTX):
        raise Refused(path, f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _check_folder(path: Path, st: os.stat_result):
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(path, KINDS.get(stat.S_IFMT(st.st_mode), "a file") + ", not a folder")
    _check_owner_and_mode(path, st, folder=True)


def check_one_folder(path: Path, follow: bool = False):
    """Refused unless path is a folder that passes the rule (a link followed only with follow)."""
    _check_folder(path, os.stat(path) if follow else os.lstat(path))


def check_folders(root: Path, parts=(), follow: int = 0) -> Path:
    """root/parts[0]/parts[1]/..., after checking the root and each folder below it in turn (links
    followed for the root and the first `follow` parts only)."""
    path = Path(root)
    check_one_folder(path, follow=True)
    for depth, part in enumerate(parts):
        path = path / part
        check_one_folder(path, follow=depth < follow)
    return path


@contextlib.contextmanager
def open_file(root: Path, parts, limit: int, follow: int = 0):
    """The open descriptor of the regular file root/parts... (see the module doc), closed after."""
    path = check_folders(root, parts[:-1], follow) / parts[-1]
    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise Refused(path, KINDS.get(stat.S_IFMT(before.st_mode), "not a file") + ", not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the lstat
            raise Refused(path, "a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise Refused(path, "replaced while it was opened")
        _check_owner_and_mode(path, st, folder=False)
        if st.st_size > limit:
            raise Refused(path, f"larger than {limit} bytes ({st.st_size})")
        yield fd
    finally:
        os.close(fd)


def read_file(root: Path, parts, limit: int, follow: int = 0) -> bytes:
    """The bytes of root/parts..., checked as open_file does; never more than `limit` are read."""
    with open_file(root, parts, limit, follow) as fd:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    if size > limit:
        raise Refused(Path(root).joinpath(*parts), f"larger than {limit} bytes")
    return b"".join(chunks)


def check_file(root: Path, parts, limit: int, follow: int = 0) -> Path:
    """root/parts... after open_file's checks, for loaders that take a path (ctypes.CDLL)."""
    with open_file(root, parts, limit, follow):
        return Path(root).joinpath(*parts)
