"""Cache bundles: one .tar.gz that carries compiled kernels from a build box to GPU hosts.

Inside a bundle (every path relative, files only):
    flashjit-bundle.json                                   format, schema, flashjit version, entries
    v{SCHEMA}/entries/<key>/kernel.cubin|source.cu|meta.json   verified cache entries, as on disk
    v{SCHEMA}/index/<spec key>                             index files, so GPU hosts skip rendering

Import reads the bundle twice and writes nothing until the first read is through:
  1. check: every member header (layout, kind, size), the running member count and uncompressed
     size (Limits), the header file, and each entry, whose files lie next to each other:
     meta.json of the shape flashjit writes (every field it reads, of its type; keys of 64 hex
     digits), a cubin that is an ELF file matching cubin_sha256, and an entry key and portable key
     that are the hashes of source.cu and meta.json's arch, options and versions. A malformed
     member refuses the whole bundle, naming the member and field; a damaged entry (checksum, key,
     schema) is rejected with its reason while the others go on.
  2. write: the same stream again, every member hashing as it did in step 1 (a bundle changed in
     between stops the import). Entries go through KernelCache.store and index files through
     store_index, under names built from the 64-hex-digit keys step 1 checked (meta.json's
     portable_key, a file name to store(), is one): no other value read from a bundle is used as
     a path. A bundle's index file never replaces a local one that names a verified entry, unless
     replace=True (`flashjit cache import --replace`).
bundle_stream reads and checks the members, bundle_meta decides whether an entry is sound; this
module writes bundles, runs the two steps and reports.
A bundle holds machine code that will run on your GPUs: import only bundles your build made.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import tarfile
import time
from pathlib import Path

from .._version import __version__
from ..jit.cache import KEY_PATTERN, SCHEMA, KernelCache
from ..jit.trusted_files import Refused
from ..jit.trusted_writes import output_file
from ..errors import CacheError
from .bundle_meta import check_entry
from .bundle_stream import (HEADER, MAX_BYTES, UNREADABLE, BundleError, BundleReader, Limits, Refusal, by_entry,
                            open_bundle, quoted, shown)

__all__ = ["BUNDLE_FORMAT", "HEADER", "MAX_BYTES", "BundleError", "ExportReport", "ImportReport", "Limits",
           "export_bundle", "import_bundle"]
BUNDLE_FORMAT = 1


@dataclasses.dataclass
class ExportReport:
    path: Path
    entries: list[dict]   # metadata of every exported entry
    index_files: int
    bytes: int            # size of the .tar.gz
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (entry folder, why not exported)


@dataclasses.dataclass
class ImportReport:
    path: Path
    cache_dir: Path
    imported: list[str] = dataclasses.field(default_factory=list)    # spec names written
    present: list[str] = dataclasses.field(default_factory=list)     # already in the cache, verified
    rejected: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (key, why)
    index_files: int = 0
    index_skipped: int = 0  # naming an entry neither imported nor verified here
    index_kept: int = 0     # local index files naming another verified entry, kept (replace=False)


# ---- export -------------------------------------------------------------------------------------

def export_bundle(out, cache_dir=None, specs=None, archs=None, prewarm_hint: str | None = None) -> ExportReport:
    """Write the cache's verified entries (only those of `specs`, if given; only `archs`, if given)
    and their index files to `out` (.tar.gz), atomically. Missing specs are an error: prewarm first
    (`prewarm_hint`, the command that would, goes in the message). Without `specs`, entry folders
    that are not verified (incomplete or damaged) are listed in the report's `skipped`.
    """
    out = Path(out)
    if not out.name or (out.is_dir() and not out.is_symlink()):
        raise BundleError(f"{out} is a folder: give the bundle's file name, such as {out / 'kernels.tar.gz'}")
    cache = KernelCache(cache_dir, create=False)
    if cache.missing or cache.foreign:
        raise BundleError(cache.foreign or f"no kernel cache at {cache.root} (no such folder): nothing to export")
    entries = {e["key"]: e for e in cache.entries()}
    skipped = []
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
        skipped = _unverified_entries(cache, set(entries))
    if not keep:
        where = f" for {', '.join(archs)}" if archs else ""
        raise BundleError(f"nothing to export: the kernel cache at {cache.root} holds no verified entries{where}")
    chosen = [entries[key] for key in sorted(keep, key=lambda k: (entries[k].get("name", ""), k))]
    header = {"format": BUNDLE_FORMAT, "schema": SCHEMA, "flashjit": __version__, "created": time.time(),
              "entries": [{k: e.get(k) for k in ("key", "name", "arch", "nvrtc", "cubin_sha256")} for e in chosen],
              "index_files": len(index)}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with output_file(out) as raw:
            counted = _Counted(raw)
            with tarfile.open(fileobj=counted, mode="w:gz") as tar:
                _add(tar, HEADER, json.dumps(header, indent=1).encode())
                for e in chosen:
                    for name, data in _entry_files(cache, e).items():
                        _add(tar, f"v{SCHEMA}/entries/{e['key']}/{name}", data, e.get("created", 0))
                for spec_key, key in sorted(index.items()):
                    _add(tar, f"v{SCHEMA}/index/{spec_key}", key.encode())
    except Refused as exc:
        raise BundleError(f"not writing the bundle: {exc}") from None
    except OSError as exc:
        raise BundleError(f"could not write {out}: {exc.strerror or exc}") from None
    return ExportReport(out, chosen, len(index), counted.bytes, skipped)


class _Counted:
    """A file object's write(), counting the bytes (a FIFO or device has no size to stat)."""

    def __init__(self, raw):
        self.raw, self.bytes = raw, 0

    def write(self, data) -> int:
        self.raw.write(data)
        self.bytes += len(data)
        return len(data)

    def flush(self):
        self.raw.flush()


def _entry_files(cache: KernelCache, entry: dict) -> dict[str, bytes]:
    """The entry's files, read under the cache's trust rule (no link or FIFO reaches a bundle)."""
    files = cache.entry_files(entry["key"])
    if files is None:  # verified a moment ago: pruned, cleared or replaced meanwhile
        raise BundleError(f"cache entry {entry['path']} ({entry.get('name')}) could not be read while exporting; "
                          "nothing was written, export again")
    return files


def _unverified_entries(cache: KernelCache, verified: set[str]) -> list[tuple[str, str]]:
    """Entry folders of the cache that export leaves out, with the reason."""
    folder = cache.base / "entries"
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    return [(name, "incomplete: no meta.json (its writer stopped, or the disk was full)"
             if not (folder / name / "meta.json").exists() else "damaged or unreadable: its files do not verify")
            for name in names if name not in verified]


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float = 0):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(mtime or time.time())
    tar.addfile(info, io.BytesIO(data))


# ---- import -------------------------------------------------------------------------------------

def import_bundle(path, cache_dir=None, *, replace: bool = False, limits: Limits = Limits()) -> ImportReport:
    """Verify a bundle and write its entries and index files into the cache (see the module doc)."""
    path = Path(path)
    cache = KernelCache(cache_dir)
    if not cache.writable:
        raise CacheError(f"cannot import {path}: the kernel cache at {cache.root} is not writable; "
                         "set FLASHJIT_CACHE_DIR or --cache-dir to a writable folder")
    with open_bundle(path) as raw:
        reader = BundleReader(raw, path, limits)
        try:
            checked = _check(reader)
        except Refusal as refusal:
            raise BundleError(f"{path}: refusing the bundle (nothing was imported): {refusal}") from None
        except UNREADABLE as exc:
            raise BundleError(f"{path}: not a readable flashjit bundle ({type(exc).__name__}: {exc})") from None
        _check_space(cache, checked)
        try:
            return _write(reader, cache, checked, replace)
        except (Refusal,) + UNREADABLE as exc:
            raise BundleError(f"{path} changed while it was imported ({exc}); import it again") from None


@dataclasses.dataclass
class _Checked:
    entries: dict[str, dict | str]   # entry key -> its meta.json, or why it is rejected
    index: dict[str, bytes]          # spec key -> the index file's contents
    sizes: dict[str, int]            # entry key -> bytes its files take


def _check(reader: BundleReader) -> _Checked:
    """Step 1 of the module doc: everything is checked, nothing written."""
    checked, others, malformed = _Checked({}, {}, {}), [], None
    for key, group in by_entry(reader.files(), others):
        try:
            checked.entries[key] = check_entry(key, group)
        except Refusal as refusal:  # raised once the header is known to be ours
            malformed = malformed or refusal
        checked.sizes[key] = sum(len(f.data) for f in group.values())
    header = next((f for f in others if f.kind == HEADER), None)
    if header is None:
        raise BundleError(f"{reader.path}: not a flashjit bundle (no {HEADER}); make one with `flashjit cache export`")
    _check_header(json.loads(header.data), reader.path)
    if malformed:
        raise malformed
    checked.index = {f.key: f.data for f in others if f.kind == "index"}
    return checked


def _check_header(header, path):
    if not isinstance(header, dict):
        raise BundleError(f"{path}: {HEADER} is not a JSON object")
    made_by = shown(header.get("flashjit", "an unknown flashjit"), 40)
    if header.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{path}: bundle format {quoted(header.get('format'), 40)} (made by flashjit {made_by}) is "
                          f"not the format {BUNDLE_FORMAT} this flashjit ({__version__}) reads; nothing was imported")
    if header.get("schema") != SCHEMA:
        raise BundleError(f"{path}: the bundle holds cache schema v{quoted(header.get('schema'), 40)} (made by "
                          f"flashjit {made_by}); this flashjit ({__version__}) reads v{SCHEMA}; nothing was imported. "
                          f"Export it again with flashjit {__version__}")


def _check_space(cache: KernelCache, checked: _Checked):
    needed = sum(checked.sizes[key] for key, meta in checked.entries.items() if isinstance(meta, dict))
    try:
        free = shutil.disk_usage(cache.base).free
    except OSError:
        return
    if needed > free:
        raise CacheError(f"the bundle's entries need {needed} bytes and {cache.root} has {free} free; "
                         "nothing was imported: free space (`flashjit cache prune`) and import again")


def _write(reader: BundleReader, cache: KernelCache, checked: _Checked, replace: bool) -> ImportReport:
    """Step 2 of the module doc."""
    report = ImportReport(reader.path, cache.root)
    report.rejected = [(key, why) for key, why in checked.entries.items() if isinstance(why, str)]
    good = set()
    for key, files in by_entry(reader.files(), []):
        meta = checked.entries[key]
        if not isinstance(meta, dict):
            continue
        if cache.load(key) is not None:
            report.present.append(meta["name"])
        elif cache.store(key, files["kernel.cubin"].data, files["source.cu"].data.decode(), meta):
            report.imported.append(meta["name"])
        else:
            raise CacheError(f"could not write entry {key} ({meta['name']}) into {cache.root} after importing "
                             f"{len(report.imported)} entries; free space or fix permissions and import again")
        good.add(key)
    for spec_key, data in checked.index.items():
        key = data.decode(errors="replace").strip()
        if not KEY_PATTERN.fullmatch(key) or not (key in good or cache.load(key) is not None):
            report.index_skipped += 1
            continue
        local = _local_index(cache, spec_key)
        if local != key and local is not None and not replace and cache.load(local) is not None:
            report.index_kept += 1
            continue
        if local != key:
            cache.store_index(spec_key, key)
            if _local_index(cache, spec_key) != key:
                raise CacheError(f"could not write index file {spec_key} into {cache.root} after importing "
                                 f"{len(report.imported)} entries; free space or fix permissions and import again")
        report.index_files += 1
    return report


def _local_index(cache: KernelCache, spec_key: str) -> str | None:
    try:
        return cache.lookup_index(spec_key)
    except ValueError:  # an index file that is not text: no mapping
        return None
