"""Reading a bundle's tar stream: members in order, checked against the layout and the limits while
they stream, one entry's files at a time.

Every read refuses the bundle (raising Refusal) at the first member outside the layout (a link, a
device, an absolute or '..' path, an unknown name, another schema, a duplicate), the first member
larger than MAX_BYTES allows, an extended header over MAX_EXTENDED_HEADER, or once the member count
or the uncompressed bytes pass Limits; tarfile never holds more than that in memory.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import re
import stat
import tarfile
import zlib
from pathlib import Path

from .._version import __version__
from ..jit.cache import ENTRY_FILES, SCHEMA
from ..errors import FlashJITError

HEADER = "flashjit-bundle.json"
# Upper bounds on member sizes, about 1000 times real ones (a cubin ~60 KiB, its source ~50 KiB, meta.json ~3 KiB).
MAX_BYTES = {"kernel.cubin": 64 << 20, "source.cu": 16 << 20, "meta.json": 1 << 20, "index": 1024,
             HEADER: 64 << 20}
MAX_EXTENDED_HEADER = 64 << 10  # a pax or GNU long-name header; real ones hold a few hundred bytes
_ENTRY_FILE = re.compile(r"v(?P<version>\d+)/entries/(?P<key>[0-9a-f]{64})/(?P<file>kernel\.cubin|source\.cu|meta\.json)")
_INDEX_FILE = re.compile(r"v(?P<version>\d+)/index/(?P<key>[0-9a-f]{64})")
_FOLDER = re.compile(r"v\d+(/entries(/[0-9a-f]{64})?|/index)?/?")
_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
             tarfile.GNUTYPE_LONGLINK)


QUOTED_CHARS = 200  # how much of a value read from a bundle an error message quotes (a member name is <100)


def quoted(value, limit: int = QUOTED_CHARS) -> str:
    """repr(value), cut to `limit` characters (saying how long it was): a bundle's values are
    anyone's, and a message must not echo megabytes of them."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(value, limit: int = QUOTED_CHARS) -> str:
    """A short printable string as it is, anything else as quoted() shows it."""
    return value if isinstance(value, str) and value.isprintable() and len(value) <= limit else quoted(value, limit)


class BundleError(FlashJITError):
    """A bundle that cannot be made or must not be imported; says which file and member, and why."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """How much of a bundle import reads before refusing it, counted while reading. The defaults
    fit about 12,000 kernels; `flashjit cache import --max-members N --max-size SIZE` raises them."""

    members: int = 50_000         # tar headers, folders included; each costs about 0.5 KiB of memory
    total_bytes: int = 2 << 30    # the uncompressed tar stream


class Refusal(Exception):
    """Why a bundle is refused as a whole; import_bundle turns it into a BundleError naming the file."""


# What a damaged or foreign .tar.gz raises while it is read.
UNREADABLE = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, ValueError, RecursionError)


def open_bundle(path: Path):
    """The bundle file, opened without blocking on a FIFO; only a regular file is accepted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise BundleError(f"{path}: no such file") from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # O_NONBLOCK changes nothing for a regular file
        os.close(fd)
        what = "is a folder" if stat.S_ISDIR(mode) else "is not a regular file (a FIFO, device or socket)"
        raise BundleError(f"{path} {what}: give the .tar.gz file `flashjit cache export` wrote")
    return os.fdopen(fd, "rb")


@dataclasses.dataclass(frozen=True)
class BundleFile:
    name: str
    kind: str      # HEADER, "index" or one of ENTRY_FILES
    key: str       # the entry key or spec key of its path ("" for the header)
    data: bytes
    sha256: str


class _CappedStream:
    """The decompressed tar stream; refuses the bundle past `limit` bytes."""

    def __init__(self, raw, limit: int):
        self._gzip, self.limit, self.count = gzip.GzipFile(fileobj=raw, mode="rb"), limit, 0

    def read(self, size: int = -1) -> bytes:
        room = self.limit - self.count + 1  # one byte over the limit is enough to refuse
        data = self._gzip.read(room if size is None or size < 0 else min(size, room))
        self.count += len(data)
        if self.count > self.limit:
            raise Refusal(f"it unpacks to more than {self.limit} bytes (raise the cap with --max-size)")
        return data

    def drain(self):
        """Read to the end, so gzip checks its CRC."""
        while self.read(1 << 20):
            pass


class _Member(tarfile.TarInfo):
    """A tar header that refuses, before tarfile reads them into memory, extended headers too large
    to be real and sparse files (_proc_member is tarfile's documented hook for subclasses)."""

    def _proc_member(self, tar):
        if self.type in _EXTENDED and self.size > MAX_EXTENDED_HEADER:
            raise Refusal(f"it has an extended header of {self.size} bytes (at most {MAX_EXTENDED_HEADER})")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise Refusal(f"member {quoted(self.name)} is a sparse file; bundles hold regular files only")
        return super()._proc_member(tar)


class BundleReader:
    """A bundle's file members in order, checked against the layout and the limits on every read;
    every read after the first must see the bytes of the first."""

    def __init__(self, raw, path: Path, limits: Limits):
        self.raw, self.path, self.limits = raw, path, limits
        self.digests: dict[str, str] | None = None

    def files(self):
        self.raw.seek(0)
        stream, seen, digests = _CappedStream(self.raw, self.limits.total_bytes), set(), {}
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_Member) as tar:
            for count, member in enumerate(tar, 1):
                if count > self.limits.members:
                    raise Refusal(f"it holds more than {self.limits.members} members "
                                  "(raise the cap with --max-members)")
                kind, key = _classify(member, seen)
                if kind is None:
                    continue
                data = _read(tar, member)
                digests[member.name] = digest = hashlib.sha256(data).hexdigest()
                if self.digests is not None and self.digests.get(member.name) != digest:
                    raise BundleError(f"{self.path} changed while it was imported (member {quoted(member.name)}); "
                                      "import it again")
                yield BundleFile(member.name, kind, key, data, digest)
            stream.drain()
        if self.digests is None:
            self.digests = digests
        elif digests.keys() != self.digests.keys():
            raise BundleError(f"{self.path} changed while it was imported (members came and went); import it again")


def _classify(member: tarfile.TarInfo, seen: set) -> tuple[str | None, str]:
    """(kind, key) of a file member, (None, "") of a folder; refuses anything outside the layout."""
    name = member.name

    def refuse(why):
        return Refusal(f"member {quoted(name)} {why}")

    if name.startswith("/") or "\\" in name or any(part in ("", ".", "..") for part in name.rstrip("/").split("/")):
        raise refuse("has an absolute or non-normalized path")
    if member.isdir():
        if not _FOLDER.fullmatch(name):
            raise refuse("is a folder outside the bundle layout")
        return None, ""
    if not member.isfile():
        kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else
                "a device" if member.isdev() else "not a regular file")
        raise refuse(f"is {kind}; bundles hold regular files only")
    if name in seen:
        raise refuse("appears twice")
    seen.add(name)
    entry, indexed = _ENTRY_FILE.fullmatch(name), _INDEX_FILE.fullmatch(name)
    if name == HEADER:
        kind, key = HEADER, ""
    elif entry or indexed:
        version = int((entry or indexed).group("version"))
        if version != SCHEMA:
            raise Refusal(f"it holds cache entries of schema v{version} and this flashjit ({__version__}) reads "
                          f"v{SCHEMA}; export the bundle again with flashjit {__version__}, or import it with the "
                          "flashjit that made it")
        kind, key = (entry.group("file"), entry.group("key")) if entry else ("index", indexed.group("key"))
    else:
        raise refuse("is not part of the bundle layout (flashjit-bundle.json, "
                     f"v{SCHEMA}/entries/<key>/{{{','.join(ENTRY_FILES)}}}, v{SCHEMA}/index/<key>)")
    if member.size > MAX_BYTES[kind]:
        raise refuse(f"is {member.size} bytes, more than the {MAX_BYTES[kind]} a {kind} may hold")
    return kind, key


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    data = handle.read(member.size + 1) if handle else b""
    if len(data) != member.size:
        raise EOFError(f"member {quoted(member.name)} is truncated")
    return data


def by_entry(files, others: list):
    """(key, {kind: BundleFile}) for each entry of a file stream, in order; other files go to `others`.
    An entry's files lie next to each other (as export and tar of a cache folder write them), so
    one entry at a time is in memory."""
    key, group, done = None, {}, set()
    for file in files:
        if file.kind in ENTRY_FILES and file.key == key:
            group[file.kind] = file
            continue
        if key is not None:
            yield key, group
            done.add(key)
            key, group = None, {}
        if file.kind not in ENTRY_FILES:
            others.append(file)
        elif file.key in done:
            raise Refusal(f"member {quoted(file.name)} lies apart from the other files of its entry")
        else:
            key, group = file.key, {file.kind: file}
    if key is not None:
        yield key, group
