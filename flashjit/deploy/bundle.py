"""Cache bundles: one .tar.gz that carries compiled kernels from a build box to GPU hosts.

Inside a bundle (every path relative, files only):
    flashjit-bundle.json                                   format, schema, flashjit version, entries
    v{SCHEMA}/entries/<key>/kernel.cubin|source.cu|meta.json   verified cache entries, as on disk
    v{SCHEMA}/index/<spec key>                             index files, so GPU hosts skip rendering

Import invariants:
  * nothing is extracted: each member is read into memory and written through KernelCache.store /
    store_index (temp file, fsync, os.replace), under names built from 64-hex-digit keys, so no
    bundle can write outside the cache dir;
  * the bundle is refused, before anything is written, if any member is not a regular file
    (symlinks, hard links, devices, FIFOs), has an absolute path, '..', a name outside the layout
    above, a duplicate name, an implausible size, or belongs to another schema or bundle format;
  * each entry is verified (meta.json parses, names its own key and this schema, the cubin's
    SHA-256 matches cubin_sha256) and skipped with a reason if not; an index file is copied only
    when the entry it names is verified here.
A bundle holds machine code that will run on your GPUs: import only bundles your build made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import tarfile
import time
import zlib
from pathlib import Path

from .._version import __version__
from ..jit.cache import ENTRY_FILES, KEY_PATTERN, SCHEMA, KernelCache, atomic_file
from ..errors import CacheError, FlashJITError

BUNDLE_FORMAT = 1
HEADER = "flashjit-bundle.json"
# Upper bounds on member sizes: a real cubin is well under a few MiB.
MAX_BYTES = {"kernel.cubin": 256 << 20, "source.cu": 64 << 20, "meta.json": 16 << 20, "index": 1024,
             HEADER: 256 << 20}
_ENTRY_FILE = re.compile(r"v(?P<version>\d+)/entries/(?P<key>[0-9a-f]{64})/(?P<file>kernel\.cubin|source\.cu|meta\.json)")
_INDEX_FILE = re.compile(r"v(?P<version>\d+)/index/(?P<key>[0-9a-f]{64})")
_FOLDER = re.compile(r"v\d+(/entries(/[0-9a-f]{64})?|/index)?/?")


class BundleError(FlashJITError):
    """A bundle that cannot be made or must not be imported; says which file and member, and why."""


@dataclasses.dataclass
class ExportReport:
    path: Path
    entries: list[dict]   # metadata of every exported entry
    index_files: int
    bytes: int            # size of the .tar.gz


@dataclasses.dataclass
class ImportReport:
    path: Path
    cache_dir: Path
    imported: list[str] = dataclasses.field(default_factory=list)    # spec names written
    present: list[str] = dataclasses.field(default_factory=list)     # already in the cache, verified
    rejected: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (key, why)
    index_files: int = 0
    index_skipped: int = 0


# ---- export -------------------------------------------------------------------------------------

def export_bundle(out, cache_dir=None, specs=None, archs=None, prewarm_hint: str | None = None) -> ExportReport:
    """Write the cache's verified entries (only those of `specs`, if given; only `archs`, if given)
    and their index files to `out` (.tar.gz), atomically. Missing specs are an error: prewarm first
    (`prewarm_hint`, the command that would, goes in the message).
    """
    cache = KernelCache(cache_dir)
    entries = {e["key"]: e for e in cache.entries()}
    if specs is not None:
        from ..jit.engine import Engine, prewarm_command  # the engine knows how a spec maps to an entry

        engine = Engine(cache_dir, allow_compile=False)
        index, missing = {}, []
        for spec in specs:
            found = engine.cached_entry(spec)
            if found is None or found[1] not in entries:
                missing.append(spec)
            else:
                index[found[0]] = found[1]
        if missing:
            names = ", ".join(s.name for s in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise BundleError(f"{len(missing)} of {len(specs)} specs are not in the kernel cache at {cache.root} "
                              f"({names}); prewarm them first: {prewarm_hint or prewarm_command(missing[0], cache.root)}")
        keep = set(index.values())
    else:
        keep = {key for key, e in entries.items() if not archs or e.get("arch") in archs}
        index = {spec_key: key for spec_key, key in cache.index().items() if key in keep}
    if not keep:
        where = f" for {', '.join(archs)}" if archs else ""
        raise BundleError(f"nothing to export: the kernel cache at {cache.root} holds no verified entries{where}")
    chosen = [entries[key] for key in sorted(keep, key=lambda k: (entries[k].get("name", ""), k))]
    header = {"format": BUNDLE_FORMAT, "schema": SCHEMA, "flashjit": __version__, "created": time.time(),
              "entries": [{k: e.get(k) for k in ("key", "name", "arch", "nvrtc", "cubin_sha256")} for e in chosen],
              "index_files": len(index)}

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        _add(tar, HEADER, json.dumps(header, indent=1).encode())
        for e in chosen:
            folder = Path(e["path"])
            for name in ENTRY_FILES:
                _add(tar, f"v{SCHEMA}/entries/{e['key']}/{name}", (folder / name).read_bytes(), e.get("created", 0))
        for spec_key, key in sorted(index.items()):
            _add(tar, f"v{SCHEMA}/index/{spec_key}", key.encode())
    return ExportReport(out, chosen, len(index), out.stat().st_size)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float = 0):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(mtime or time.time())
    tar.addfile(info, io.BytesIO(data))


# ---- import -------------------------------------------------------------------------------------

def import_bundle(path, cache_dir=None) -> ImportReport:
    """Verify a bundle and write its entries and index files into the cache (see the module doc)."""
    path = Path(path)
    cache = KernelCache(cache_dir)
    if not cache.writable:
        raise CacheError(f"cannot import {path}: the kernel cache at {cache.root} is not writable; "
                         "set FLASHJIT_CACHE_DIR or --cache-dir to a writable folder")
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            members = tar.getmembers()  # reads every header: a truncated file fails here
            header, entry_members, index_members = _check_members(members, path)
            _check_header(json.loads(_read(tar, header)), path)
            return _import(tar, path, cache, entry_members, index_members)
    except (tarfile.TarError, EOFError, zlib.error, ValueError) as exc:
        raise BundleError(f"{path}: not a readable flashjit bundle ({type(exc).__name__}: {exc})") from None
    except FileNotFoundError:
        raise BundleError(f"{path}: no such file") from None


def _check_members(members, path):
    """Refuse the whole bundle on any member outside the layout; returns what to import, in order."""
    header, entries, index, seen = None, {}, {}, set()

    def refuse(member, why):
        return BundleError(f"{path}: refusing the bundle (nothing was imported): member {member.name!r} {why}")

    for member in members:
        name = member.name
        if name.startswith("/") or "\\" in name or any(part in ("", ".", "..") for part in name.rstrip("/").split("/")):
            raise refuse(member, "has an absolute or non-normalized path")
        if member.isdir():
            if not _FOLDER.fullmatch(name):
                raise refuse(member, "is a folder outside the bundle layout")
            continue
        if not member.isfile():
            kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else
                    "a device" if member.isdev() else "not a regular file")
            raise refuse(member, f"is {kind}; bundles hold regular files only")
        if name in seen:
            raise refuse(member, "appears twice")
        seen.add(name)
        entry, indexed = _ENTRY_FILE.fullmatch(name), _INDEX_FILE.fullmatch(name)
        match = entry or indexed
        if name == HEADER:
            header, kind = member, HEADER
        elif match:
            version = int(match.group("version"))
            if version != SCHEMA:
                raise BundleError(f"{path}: refusing the bundle (nothing was imported): it holds cache entries of "
                                  f"schema v{version} and this flashjit ({__version__}) reads v{SCHEMA}; export the "
                                  f"bundle again with flashjit {__version__}, or import it with the flashjit that made it")
            kind = entry.group("file") if entry else "index"
            if entry:
                entries.setdefault(entry.group("key"), {})[kind] = member
            else:
                index[indexed.group("key")] = member
        else:
            raise refuse(member, "is not part of the bundle layout (flashjit-bundle.json, "
                                 f"v{SCHEMA}/entries/<key>/{{{','.join(ENTRY_FILES)}}}, v{SCHEMA}/index/<key>)")
        if member.size > MAX_BYTES[kind]:
            raise refuse(member, f"is {member.size} bytes, more than the {MAX_BYTES[kind]} a {kind} may hold")
    if header is None:
        raise BundleError(f"{path}: not a flashjit bundle (no {HEADER}); make one with `flashjit cache export`")
    return header, entries, index


def _check_header(header, path):
    if not isinstance(header, dict):
        raise BundleError(f"{path}: {HEADER} is not a JSON object")
    made_by = header.get("flashjit", "an unknown flashjit")
    if header.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{path}: bundle format {header.get('format')!r} (made by flashjit {made_by}) is not the "
                          f"format {BUNDLE_FORMAT} this flashjit ({__version__}) reads; nothing was imported")
    if header.get("schema") != SCHEMA:
        raise BundleError(f"{path}: the bundle holds cache schema v{header.get('schema')} (made by flashjit "
                          f"{made_by}); this flashjit ({__version__}) reads v{SCHEMA}; nothing was imported. "
                          f"Export it again with flashjit {__version__}")


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    data = handle.read(member.size + 1) if handle else b""
    if len(data) != member.size:
        raise BundleError(f"{tar.name}: member {member.name!r} is truncated")
    return data


def _verify(key: str, files: dict[str, bytes]):
    """(cubin, source, meta) of a sound entry, or the reason it is not."""
    missing = [name for name in ENTRY_FILES if name not in files]
    if missing:
        return f"incomplete: no {', '.join(missing)}"
    try:
        meta = json.loads(files["meta.json"])
        source = files["source.cu"].decode()
    except (ValueError, UnicodeDecodeError) as exc:
        return f"unreadable meta.json or source.cu ({exc})"
    if not isinstance(meta, dict) or meta.get("key") != key:
        return "meta.json names another key"
    if meta.get("schema") != SCHEMA:
        return f"meta.json says schema {meta.get('schema')!r}, not {SCHEMA}"
    if meta.get("cubin_sha256") != hashlib.sha256(files["kernel.cubin"]).hexdigest():
        return "kernel.cubin does not match meta.json's cubin_sha256 (damaged in transit?)"
    return files["kernel.cubin"], source, meta


def _import(tar, path, cache: KernelCache, entry_members: dict, index_members: dict) -> ImportReport:
    report, good = ImportReport(path, cache.root), set()
    for key, files in entry_members.items():
        checked = _verify(key, {name: _read(tar, member) for name, member in
                                sorted(files.items(), key=lambda item: item[1].offset)})
        if isinstance(checked, str):
            report.rejected.append((key, checked))
            continue
        cubin, source, meta = checked
        name = meta.get("name", key[:12])
        if cache.load(key) is not None:
            report.present.append(name)
        elif cache.store(key, cubin, source, meta):
            report.imported.append(name)
        else:
            raise CacheError(f"could not write entry {key} ({name}) into {cache.root} after importing "
                             f"{len(report.imported)} entries; free space or fix permissions and import again")
        good.add(key)
    for spec_key, member in index_members.items():
        key = _read(tar, member).decode(errors="replace").strip()
        if KEY_PATTERN.fullmatch(key) and (key in good or cache.load(key) is not None):
            cache.store_index(spec_key, key)
            report.index_files += 1
        else:
            report.index_skipped += 1
    return report
