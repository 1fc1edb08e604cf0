"""The `flashjit` commands on the kernel cache: list, clear, and cache export / import / info / prune."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

from .cli_kernels import hf_specs, named_specs
from .cli_output import UsageError, error, format_size, print_json, table


# ---- list / clear -----------------------------------------------------------------------------

def existing_cache(args, removes: bool = False):
    """The cache a command reads or removes from, opened without making anything. UsageError for
    a --cache-dir (or FLASHJIT_CACHE_DIR) that does not exist, and for a folder that is not a
    flashjit cache (a command that removes files never touches one; one that reads finds nothing)."""
    from .. import env
    from ..jit.cache import KernelCache

    cache = KernelCache(args.cache_dir, create=False)
    named = "--cache-dir" if args.cache_dir is not None else "FLASHJIT_CACHE_DIR" if env.cache_dir() else None
    if cache.missing and named:
        raise UsageError(f"{named} {cache.root}: no such folder")
    if cache.foreign:
        raise UsageError(cache.foreign + ("; nothing was removed" if removes else ""))
    return cache


def cmd_list(args) -> int:
    cache = existing_cache(args)
    entries = sorted(cache.entries(), key=lambda e: (e.get("name", ""), e.get("created", 0)))
    if args.json:
        keep = ("name", "arch", "key", "cubin_bytes", "compile_seconds", "created", "flashjit", "nvrtc", "path")
        print(json.dumps([{k: e.get(k) for k in keep} for e in entries], indent=1))
        return 0
    rows = [(e.get("name", "?"), e.get("arch", "?"), format_size(int(e.get("cubin_bytes", 0))),
             f"{e.get('compile_seconds', 0):.2f}") for e in entries]
    print(table(rows, ("spec", "arch", "cubin", "compile s")))
    print(f"{len(entries)} entries in {cache.root}" + (" (no cache there yet)" if cache.missing else ""))
    return 0


def cmd_clear(args) -> int:
    cache = existing_cache(args, removes=True)
    if cache.missing or not cache.base.exists():
        print(f"no kernel cache in {cache.root}: nothing to remove")
        return 0
    if not cache.writable:
        error(f"{not_writable(cache)}: nothing was removed")
        return 1
    try:
        count = cache.clear()
    except OSError as exc:
        left = len(cache.entries())
        error(f"could not clear the kernel cache at {cache.root} ({exc}); {left} entries remain")
        return 1
    print(f"removed {count} entries from {cache.root}")
    return 0


def not_writable(cache) -> str:
    """Why a command that removes files did nothing."""
    return f"the kernel cache at {cache.root} is read-only for this user (or not usable)"


# ---- cache export / import / info / prune -----------------------------------------------------

SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
              "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


MAX_SIZE = 1 << 60


def parse_size(text: str) -> int:
    """'2GB' -> 2*10**9, '1.5GiB' -> 1.5*2**30, '500M' -> 500*2**20 (like du), '0' -> 0."""
    match = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{0,30})?)\s*([a-zA-Z]*)\s*", str(text)[:100])
    unit = match.group(2).lower() if match else None
    if unit not in SIZE_UNITS or float(match.group(1)) * SIZE_UNITS[unit] > MAX_SIZE:
        shown = repr(text) if len(str(text)) <= 40 else f"{str(text)[:30]!r}... ({len(str(text))} characters)"
        raise UsageError(f"--max-size {shown}: expected a size such as 2GB, 500MiB, 1.5G or 0, at most 1 EiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def cmd_cache_export(args) -> int:
    from .bundle import export_bundle
    from .manifest import resolve_archs

    specs = None
    if args.manifest or args.spec or args.hf_config:
        specs = named_specs(args)
    else:
        hf_specs(args)  # rejects --page-size and friends without --hf-config
    archs = resolve_archs(args.arch) if args.arch and specs is None else None
    hint = ["flashjit", "prewarm"] + ([args.manifest] if args.manifest else [])
    for flag in ("spec", "hf_config", "page_size", "dtype", "kv_dtype", "max_q_len", "arch", "cache_dir"):
        values = getattr(args, flag)
        for value in (values if isinstance(values, list) else [values] if values else []):
            hint += ["--" + flag.replace("_", "-"), str(value)]
    report = export_bundle(args.out, args.cache_dir, specs=specs, archs=archs, prewarm_hint=shlex.join(hint))
    if args.json:
        print_json({"path": report.path, "bytes": report.bytes, "index_files": report.index_files,
                    "entries": [{k: e.get(k) for k in ("name", "arch", "key", "cubin_bytes")} for e in report.entries],
                    "skipped": [{"entry": key, "why": why} for key, why in report.skipped]})
    else:
        rows = [(e.get("name", "?"), e.get("arch", "?"), format_size(int(e.get("cubin_bytes", 0))))
                for e in report.entries]
        print(table(rows, ("spec", "arch", "cubin")))
        for key, why in report.skipped:
            print(f"flashjit: skipped entry {key[:16]}: {why}", file=sys.stderr)
        print(f"exported {len(report.entries)} entries and {report.index_files} index files to {report.path} "
              f"({format_size(report.bytes)})")
    if report.skipped:
        error(f"skipped {len(report.skipped)} entries of the cache that do not verify (listed above): the bundle "
              "lacks them; prewarm their specs again to rebuild them")
        return 1
    return 0


def cmd_cache_import(args) -> int:
    from ..jit.cache import KernelCache
    from .bundle import Limits, import_bundle
    from .cli_kernels import host_planner_status

    limits = Limits(members=args.max_members if args.max_members is not None else Limits.members,
                    total_bytes=parse_size(args.max_size) if args.max_size is not None else Limits.total_bytes)
    report = import_bundle(args.bundle, args.cache_dir, replace=args.replace, limits=limits)
    # A strict server builds nothing: the C planner it loads is built here, beside the kernels.
    planner = host_planner_status(KernelCache(args.cache_dir))
    if args.json:
        print_json({"path": report.path, "cache_dir": report.cache_dir, "imported": report.imported,
                    "present": report.present, "rejected": [{"key": key, "why": why} for key, why in report.rejected],
                    "index_files": report.index_files, "index_skipped": report.index_skipped,
                    "index_kept": report.index_kept, "host_planner": planner})
        return 1 if report.rejected or report.index_kept else 0
    for key, why in report.rejected:
        print(f"flashjit: rejected entry {key[:16]}: {why}", file=sys.stderr)
    if report.index_skipped:
        print(f"flashjit: skipped {report.index_skipped} index files naming entries neither imported nor "
              "in the cache", file=sys.stderr)
    if report.index_kept:
        print(f"flashjit: kept {report.index_kept} local index file{'s' if report.index_kept > 1 else ''} naming "
              "other verified kernels than the bundle's, which are imported but not served for those specs; "
              "--replace takes the bundle's", file=sys.stderr)
    print(f"imported {len(report.imported)} entries ({len(report.present)} already present, "
          f"{len(report.rejected)} rejected) and {report.index_files} index files from {report.path} "
          f"into {report.cache_dir}")
    print(f"host planner: {planner}")
    return 1 if report.rejected or report.index_kept else 0


def cmd_cache_info(args) -> int:
    usage = existing_cache(args).usage()
    if args.json:
        print(json.dumps(usage, indent=1))
        return 0
    print(f"cache dir: {usage['root']} ({'writable' if usage['writable'] else 'NOT writable: serves what it holds'})")
    print(f"schema v{usage['schema']}: {usage['entries']} entries ({format_size(usage['entry_bytes'])}), "
          f"{usage['incomplete']} incomplete, {usage['index_files']} index files ({usage['index_stale']} stale), "
          f"{format_size(usage['bytes'])} on disk")
    if usage["by_arch"]:
        rows = [(arch, slot["entries"], format_size(slot["bytes"])) for arch, slot in usage["by_arch"].items()]
        print(table(rows, ("arch", "entries", "size")))
    for v in usage["other_versions"]:
        hint = "; `flashjit cache prune --old-versions` removes it" if v["state"] == "older" else ""
        print(f"other version v{v['version']}: {v['entries']} entries, {format_size(v['bytes'])} at {v['path']} "
              f"({v['state']}{hint})")
    print(f"total: {format_size(usage['total_bytes'])}")
    return 0


def cmd_cache_prune(args) -> int:
    if args.max_size is None and not args.old_versions:
        error("nothing to prune: give --max-size SIZE and/or --old-versions")
        return 2
    max_bytes = parse_size(args.max_size) if args.max_size is not None else None
    cache = existing_cache(args, removes=True)
    if cache.missing:
        print(f"no kernel cache in {cache.root}: nothing to prune")
        return 0
    if not cache.writable and not args.dry_run and cache.base.exists():
        error(f"{not_writable(cache)}: nothing was removed (--dry-run shows what prune would remove)")
        return 1
    report = cache.prune(max_bytes=max_bytes, old_versions=args.old_versions, dry_run=args.dry_run)
    left = [e["name"] for e in report["removed"] if cache.entry_dir(e["key"]).exists()]
    left += [v["path"] for v in report["versions_removed"] if Path(v["path"]).exists()]
    left = [] if args.dry_run else left
    if args.json:
        kept_versions = [v for v in cache.usage()["other_versions"] if v["state"] != "older"] if args.old_versions else []
        print_json({**report, "dry_run": args.dry_run, "cache": cache.root, "kept_versions": kept_versions,
                    "not_removed": left})
        return 1 if left else 0
    verb = "would remove" if args.dry_run else "removed"
    for e in report["removed"]:
        print(f"{verb} {e['name']} ({e['arch']}, {format_size(e['bytes'])}, last used "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e['last_used']))})")
    for v in report["versions_removed"]:
        print(f"{verb} schema v{v['version']} ({v['entries']} entries, {format_size(v['bytes'])}) at {v['path']}")
    print(f"{verb} {len(report['removed'])} entries, {report['incomplete']} incomplete entries, "
          f"{report['index_removed']} index files and {len(report['versions_removed'])} old versions: "
          f"{format_size(report['freed_bytes'])} freed; kept {report['kept']} entries "
          f"({format_size(report['kept_bytes'])}) in {cache.root}")
    if args.old_versions:
        for v in cache.usage()["other_versions"]:
            if v["state"] != "older":
                print(f"kept v{v['version']} at {v['path']}: {v['state'].removesuffix(' (kept)')}")
    if left:
        error(f"could not remove {len(left)} of them ({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}): "
              "check the permissions in the cache dir")
        return 1
    return 0

