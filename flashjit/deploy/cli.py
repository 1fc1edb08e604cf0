"""The `flashjit` command: prewarm, list, show, clear, cache, doctor, run-example.

Argument parsing and printing only; the work is done by the engine, the cache, the manifest
module and smoke_test. Tables go to stdout, progress bars and log lines to stderr.
Exit codes: 0 success, 1 a compile/check failure, 2 a bad argument, spec or manifest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import re
import shlex
import sys
import threading
import time
from pathlib import Path

from .._version import __version__
from ..errors import FlashJITError, SpecError

DEFAULT_EXAMPLE = "llama-3-8b.toml"
log = logging.getLogger("flashjit")


# ---- helpers ----------------------------------------------------------------------------------

def _err(message: str) -> None:
    print(f"flashjit: error: {message}", file=sys.stderr)


class _TqdmHandler(logging.Handler):
    """Log lines that do not tear the progress bar."""

    def emit(self, record):
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


@contextlib.contextmanager
def _logging(verbose: bool):
    """Route the 'flashjit' logger through tqdm for one command, then restore it (main() may run in-process)."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("flashjit: %(message)s"))
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _table(rows: list[tuple], header: tuple) -> str:
    rows = [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


_ORIGIN = {"memory": "hit (memory)", "disk": "hit (disk)", "compiled": "compiled"}


# ---- prewarm ----------------------------------------------------------------------------------

def _collect_specs(manifest, spec_names, arch_text) -> list:
    from .manifest import parse_arch_list, resolve_archs, specs_from_manifest
    from ..jit.spec import DecodeSpec

    specs = []
    if manifest:
        specs += specs_from_manifest(manifest, arch_text)
    for name in spec_names or ():
        spec = DecodeSpec.from_name(name)
        if arch_text:  # --arch retargets named specs too (one name, a fleet of archs)
            specs += [spec.replace(arch=arch) for arch in resolve_archs(parse_arch_list(arch_text))]
        else:
            specs.append(spec)
    return list(dict.fromkeys(specs))


class _UsageError(SpecError):
    """A bad command-line value: exit status 2, like a bad spec or manifest."""

    def __init__(self, message: str):
        self.field = self.value = self.accepted = None
        Exception.__init__(self, message)


def _hf_specs(args) -> list:
    """The specs of every --hf-config (a config.json or its folder); says what it derived on stderr."""
    from .hf_config import manifest_from_hf_config, read_hf_config
    from .manifest import parse_arch_list

    configs = getattr(args, "hf_config", None) or ()
    if not configs:
        if args.page_size or args.dtype or args.kv_dtype or args.max_q_len:
            raise _UsageError("--page-size, --dtype, --kv-dtype and --max-q-len apply to --hf-config only")
        return []
    ints = lambda text, default: [int(v) for v in parse_arch_list(text)] if text else default  # noqa: E731
    try:
        page_sizes, max_q_lens = ints(args.page_size, [16]), ints(args.max_q_len, [1])
    except ValueError:
        raise _UsageError(f"--page-size {args.page_size} / --max-q-len {args.max_q_len}: expected "
                          "comma-separated integers such as 16,32") from None
    specs = []
    for config in configs:
        model = read_hf_config(config, dtype=args.dtype)
        print(f"flashjit: {model.path}: {model.summary()}", file=sys.stderr)
        for note in model.notes:
            print(f"flashjit: note: {note}", file=sys.stderr)
        specs += manifest_from_hf_config(config, page_sizes, args.dtype, args.kv_dtype, max_q_lens).specs(args.arch)
    return specs


def prewarm_specs(engine, specs, jobs: int | None, *, progress: bool = True) -> tuple[list, float]:
    """Engine.prewarm with a progress bar on stderr; returns (results, wall seconds)."""
    from tqdm import tqdm

    lock = threading.Lock()
    start = time.perf_counter()
    with tqdm(total=len(specs), desc="prewarm", unit="kernel", file=sys.stderr,
              disable=None if progress else True, leave=False) as bar:
        def on_done(result):
            with lock:
                bar.set_postfix_str(result.spec.name, refresh=False)
                bar.update(1)

        results = engine.prewarm(specs, jobs=jobs, on_done=on_done)
    return results, time.perf_counter() - start


def summary(results, wall_s: float) -> str:
    rows = [(r.spec.name, r.spec.arch, _ORIGIN.get(r.source, r.source), f"{r.seconds:.2f}") for r in results]
    counts = {origin: sum(r.source == origin for r in results) for origin in ("compiled", "disk", "memory")}
    total = (f"total: {len(results)} kernels, {counts['compiled']} compiled, {counts['disk']} disk hits, "
             f"{counts['memory']} memory hits in {wall_s:.2f} s")
    return _table(rows, ("spec", "arch", "result", "seconds")) + "\n" + total


def cmd_prewarm(args) -> int:
    from ..jit.engine import Engine

    if not args.manifest and not args.spec and not args.hf_config:
        _err("nothing to prewarm: give a MANIFEST.toml and/or --spec NAME, or --hf-config config.json")
        return 2
    specs = list(dict.fromkeys(_collect_specs(args.manifest, args.spec, args.arch) + _hf_specs(args)))
    engine = Engine(args.cache_dir, allow_compile=True)  # compiling is its job, even where FLASHJIT_NO_COMPILE is set
    results, wall = prewarm_specs(engine, specs, args.jobs)
    print(summary(results, wall))
    print(f"cache: {engine.cache.root}" + ("" if engine.cache.writable else " (not writable: kept in memory only)"))
    print(f"host planner: {host_planner_status(engine)}")
    return 0


def host_planner_status(engine) -> str:
    """Builds plan()'s C helper into the cache too, so the first plan() of a server does not."""
    from ..jit.host_library import load

    return "built (C)" if load("host_plan", engine.cache) is not None else "numpy (no C helper: see the warning)"


# ---- list / show / clear ----------------------------------------------------------------------

def cmd_list(args) -> int:
    from ..jit.cache import KernelCache

    cache = KernelCache(args.cache_dir)
    entries = sorted(cache.entries(), key=lambda e: (e.get("name", ""), e.get("created", 0)))
    if args.json:
        keep = ("name", "arch", "key", "cubin_bytes", "compile_seconds", "created", "flashjit", "nvrtc", "path")
        print(json.dumps([{k: e.get(k) for k in keep} for e in entries], indent=1))
        return 0
    rows = [(e.get("name", "?"), e.get("arch", "?"), _size(int(e.get("cubin_bytes", 0))),
             f"{e.get('compile_seconds', 0):.2f}") for e in entries]
    print(_table(rows, ("spec", "arch", "cubin", "compile s")))
    print(f"{len(entries)} entries in {cache.root}")
    return 0


def cmd_show(args) -> int:
    from ..jit.render import render
    from ..jit.spec import DecodeSpec

    sys.stdout.write(render(DecodeSpec.from_name(args.spec_name)))
    return 0


def cmd_clear(args) -> int:
    from ..jit.cache import KernelCache

    cache = KernelCache(args.cache_dir)
    count = cache.clear()
    print(f"removed {count} entries from {cache.root}")
    return 0


# ---- cache export / import / info / prune -----------------------------------------------------

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
               "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'2GB' -> 2*10**9, '1.5GiB' -> 1.5*2**30, '500M' -> 500*2**20 (like du), '0' -> 0."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise _UsageError(f"--max-size {text!r}: expected a size such as 2GB, 500MiB, 1.5G or 0")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def cmd_cache_export(args) -> int:
    from .bundle import export_bundle
    from .manifest import resolve_archs

    specs = None
    if args.manifest or args.spec or args.hf_config:
        specs = list(dict.fromkeys(_collect_specs(args.manifest, args.spec, args.arch) + _hf_specs(args)))
    else:
        _hf_specs(args)  # rejects --page-size and friends without --hf-config
    archs = resolve_archs(args.arch) if args.arch and specs is None else None
    hint = ["flashjit", "prewarm"] + ([args.manifest] if args.manifest else [])
    for flag in ("spec", "hf_config", "page_size", "dtype", "kv_dtype", "max_q_len", "arch", "cache_dir"):
        values = getattr(args, flag)
        for value in (values if isinstance(values, list) else [values] if values else []):
            hint += ["--" + flag.replace("_", "-"), str(value)]
    report = export_bundle(args.out, args.cache_dir, specs=specs, archs=archs, prewarm_hint=shlex.join(hint))
    rows = [(e.get("name", "?"), e.get("arch", "?"), _size(int(e.get("cubin_bytes", 0)))) for e in report.entries]
    print(_table(rows, ("spec", "arch", "cubin")))
    print(f"exported {len(report.entries)} entries and {report.index_files} index files to {report.path} "
          f"({_size(report.bytes)})")
    return 0


def cmd_cache_import(args) -> int:
    from .bundle import import_bundle

    report = import_bundle(args.bundle, args.cache_dir)
    for key, why in report.rejected:
        print(f"flashjit: rejected entry {key[:16]}: {why}", file=sys.stderr)
    print(f"imported {len(report.imported)} entries ({len(report.present)} already present, "
          f"{len(report.rejected)} rejected) and {report.index_files} index files from {report.path} "
          f"into {report.cache_dir}")
    return 1 if report.rejected else 0


def cmd_cache_info(args) -> int:
    from ..jit.cache import KernelCache

    usage = KernelCache(args.cache_dir).usage()
    if args.json:
        print(json.dumps(usage, indent=1))
        return 0
    print(f"cache dir: {usage['root']} ({'writable' if usage['writable'] else 'NOT writable: serves what it holds'})")
    print(f"schema v{usage['schema']}: {usage['entries']} entries ({_size(usage['entry_bytes'])}), "
          f"{usage['incomplete']} incomplete, {usage['index_files']} index files ({usage['index_stale']} stale), "
          f"{_size(usage['bytes'])} on disk")
    if usage["by_arch"]:
        rows = [(arch, slot["entries"], _size(slot["bytes"])) for arch, slot in usage["by_arch"].items()]
        print(_table(rows, ("arch", "entries", "size")))
    for v in usage["other_versions"]:
        hint = "; `flashjit cache prune --old-versions` removes it" if v["state"] == "older" else ""
        print(f"other version v{v['version']}: {v['entries']} entries, {_size(v['bytes'])} at {v['path']} "
              f"({v['state']}{hint})")
    print(f"total: {_size(usage['total_bytes'])}")
    return 0


def cmd_cache_prune(args) -> int:
    from ..jit.cache import KernelCache

    if args.max_size is None and not args.old_versions:
        _err("nothing to prune: give --max-size SIZE and/or --old-versions")
        return 2
    max_bytes = parse_size(args.max_size) if args.max_size is not None else None
    cache = KernelCache(args.cache_dir)
    report = cache.prune(max_bytes=max_bytes, old_versions=args.old_versions, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for e in report["removed"]:
        print(f"{verb} {e['name']} ({e['arch']}, {_size(e['bytes'])}, last used "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(e['last_used']))})")
    for v in report["versions_removed"]:
        print(f"{verb} schema v{v['version']} ({v['entries']} entries, {_size(v['bytes'])}) at {v['path']}")
    print(f"{verb} {len(report['removed'])} entries, {report['incomplete']} incomplete entries, "
          f"{report['index_removed']} index files and {len(report['versions_removed'])} old versions: "
          f"{_size(report['freed_bytes'])} freed; kept {report['kept']} entries ({_size(report['kept_bytes'])}) "
          f"in {cache.root}")
    return 0


# ---- doctor -----------------------------------------------------------------------------------

def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as exc:  # doctor reports, never crashes
        return f"not available ({type(exc).__name__}: {exc})"


def _nvrtc_library() -> str:
    """Path of the loaded libnvrtc (cupy finds it through cuda-pathfinder)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libnvrtc.so" in line]
    except OSError:  # not Linux
        paths = []
    return paths[0] if paths else "?"


def cmd_doctor(args) -> int:
    from ..jit.cache import KernelCache
    from ..jit.compile import compile_source, nvrtc_version
    from ..jit.render import render
    from ..jit.spec import DecodeSpec, current_arch

    ok = True
    rows = [("flashjit", __version__), ("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", _version("torch")), ("cupy", _version("cupy")), ("jinja2", _version("jinja2"))]
    try:
        rows.append(("nvrtc", ".".join(map(str, nvrtc_version())) + f" ({_nvrtc_library()})"))
    except Exception as exc:
        ok = False
        rows.append(("nvrtc", f"NOT FOUND ({type(exc).__name__}: {exc}); install nvidia-cuda-nvrtc-cu12"))

    arch = None
    try:
        import torch

        if torch.cuda.is_available():
            arch = current_arch()
            rows.append(("gpu", f"{torch.cuda.get_device_name()} ({arch}), torch CUDA {torch.version.cuda}"))
        else:
            rows.append(("gpu", "none (CPU only: kernels still compile; prewarm with --arch)"))
    except Exception as exc:
        rows.append(("gpu", f"unknown ({type(exc).__name__}: {exc})"))

    cache = KernelCache(args.cache_dir)
    rows.append(("cache dir", f"{cache.root} ({'writable' if cache.writable else 'NOT writable: memory only'}), "
                              f"{len(cache.entries())} entries"))

    target = arch or "sm_90"
    spec = DecodeSpec(head_dim=64, dtype="bf16", mask="none", page_size=16, group_size=1, arch=target)
    try:
        start = time.perf_counter()
        compiled = compile_source(render(spec), spec.arch, spec.name)
        rows.append(("test compile", f"ok: {spec.name}, {_size(len(compiled.cubin))} cubin "
                                     f"in {time.perf_counter() - start:.2f} s"))
    except Exception as exc:
        ok = False
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        rows.append(("test compile", f"FAILED: {first}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    env = {k: v for k, v in os.environ.items() if k.startswith("FLASHJIT_")}
    for key, value in sorted(env.items()):
        print(f"{'env'.ljust(width)}  {key}={value}")
    return 0 if ok else 1


# ---- run-example ------------------------------------------------------------------------------

def _default_manifest() -> Path | None:
    """examples/llama-3-8b.toml from the working directory, else from the source checkout."""
    for folder in (Path.cwd() / "examples", Path(__file__).resolve().parents[2] / "examples"):
        if (folder / DEFAULT_EXAMPLE).is_file():
            return folder / DEFAULT_EXAMPLE
    return None


def cmd_run_example(args) -> int:
    from . import smoke_test
    from ..jit.engine import Engine
    from .manifest import specs_from_manifest

    manifest = args.manifest or _default_manifest()
    if manifest is None:
        _err(f"examples/{DEFAULT_EXAMPLE} not found here or next to the package; pass --manifest PATH")
        return 2
    specs = specs_from_manifest(manifest, args.arch)
    engine = Engine(args.cache_dir)
    print(f"prewarming {len(specs)} kernels from {manifest}")
    results, wall = prewarm_specs(engine, specs, args.jobs)
    print(summary(results, wall))
    print(f"cache: {engine.cache.root}")
    print(f"host planner: {host_planner_status(engine)}")
    if not smoke_test.gpu_available():
        print("no CUDA GPU: skipped the GPU decode step (kernels were compiled and cached only)")
        return 0
    check = smoke_test.decode_check(engine)
    verdict = "PASS" if check.passed else "FAIL"
    print(f"GPU decode step: {check.spec_name}, kv_lens {list(check.kv_lens)}: "
          f"max abs error {check.max_abs_err:.3e} vs float32 reference: {verdict}")
    return 0 if check.passed else 1


# ---- check-mask -------------------------------------------------------------------------------

def cmd_check_mask(args) -> int:
    from .mask_check import check_mask
    from ..jit.engine import Engine

    report = check_mask(args.mask, archs=args.arch, overrides=args.params, engine=Engine(args.cache_dir),
                        seed=args.seed, jobs=args.jobs)
    for title, header, rows in report.tables():
        print(f"{title}\n{_table(rows, header)}\n")
    for line in report.notes + report.failures():
        print(line)
    print(f"check-mask {args.mask}: {'PASS' if report.passed else 'FAIL'}")
    return 0 if report.passed else 1


# ---- parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashjit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashjit {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every compile (INFO) on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cache_dir(p):
        p.add_argument("--cache-dir", help="kernel cache folder (default: $FLASHJIT_CACHE_DIR, else the user cache dir)")

    def archs(p):
        p.add_argument("--arch", help="comma-separated target archs, e.g. sm_80,sm_90 (default: the manifest's "
                                      "archs, else this machine's GPU)")

    def jobs(p):
        p.add_argument("--jobs", "-j", type=int, default=None, help="parallel compiles (default: CPU count)")

    def specs_from(p, what):
        p.add_argument("--spec", action="append", metavar="NAME",
                       help=f"{what}a spec name such as decode_d128_bf16_kvbf16_none_p16_g4_q1_nhd_sm90_tc (repeatable)")
        p.add_argument("--hf-config", action="append", metavar="CONFIG.json",
                       help=f"{what}the kernels of a HuggingFace config.json (or its folder); repeatable")
        p.add_argument("--page-size", help="with --hf-config: comma-separated page sizes (default 16)")
        p.add_argument("--dtype", help="with --hf-config: query dtype instead of the config's torch_dtype")
        p.add_argument("--kv-dtype", help="with --hf-config: KV cache dtype (default: the query dtype)")
        p.add_argument("--max-q-len", help="with --hf-config: comma-separated query tokens per request (default 1)")

    p = sub.add_parser("prewarm", help="compile (or load) every kernel of a manifest and/or named specs")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST.toml")
    specs_from(p, "")
    archs(p), jobs(p), cache_dir(p)
    p.set_defaults(func=cmd_prewarm)

    p = sub.add_parser("list", help="list the kernels in the cache")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cache_dir(p)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="print the rendered CUDA source of a spec")
    p.add_argument("spec_name", metavar="SPEC_NAME")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("clear", help="remove every kernel from the cache")
    cache_dir(p)
    p.set_defaults(func=cmd_clear)

    p = sub.add_parser("cache", help="move kernels between hosts (export/import bundles), inspect and prune the cache")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = actions.add_parser("export", help="write verified cache entries (and index files) to a .tar.gz bundle")
    q.add_argument("out", metavar="OUT.tar.gz")
    q.add_argument("--manifest", help="only the kernels of this manifest (all must be cached)")
    specs_from(q, "only ")
    archs(q), cache_dir(q)
    q.set_defaults(func=cmd_cache_export)
    q = actions.add_parser("import", help="verify a bundle and add its entries to the cache")
    q.add_argument("bundle", metavar="IN.tar.gz")
    cache_dir(q)
    q.set_defaults(func=cmd_cache_import)
    q = actions.add_parser("info", help="size, entries per arch, other schema versions")
    q.add_argument("--json", action="store_true", help="print JSON instead of text")
    cache_dir(q)
    q.set_defaults(func=cmd_cache_info)
    q = actions.add_parser("prune", help="evict least recently used entries, or old schema versions")
    q.add_argument("--max-size", metavar="SIZE", help="keep at most SIZE of entries, e.g. 2GB, 500MiB")
    q.add_argument("--old-versions", action="store_true", help="remove the folders of older cache schemas")
    q.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    cache_dir(q)
    q.set_defaults(func=cmd_cache_prune)

    p = sub.add_parser("doctor", help="versions, GPU, cache dir and a test compile")
    cache_dir(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("run-example", help=f"prewarm examples/{DEFAULT_EXAMPLE}, then (with a GPU) check one "
                                           "decode step against the torch reference")
    p.add_argument("--manifest", help=f"manifest to prewarm (default: examples/{DEFAULT_EXAMPLE})")
    archs(p), jobs(p), cache_dir(p)
    p.set_defaults(func=cmd_run_example)

    p = sub.add_parser("check-mask", help="check a mask: compile it, replay its hooks on the CPU, and (with a GPU) "
                                          "run its kernels against the torch reference on random batches")
    p.add_argument("mask", metavar="NAME", help="a registered mask (built-in, template folder or plugin)")
    p.add_argument("--arch", help="comma-separated archs to compile for (default: sm_90 without a GPU, "
                                  "none beyond the GPU's own with one)")
    p.add_argument("--params", nargs="+", default=[], metavar="NAME=VALUE",
                   help="fix int/float mask params for every case (others are sampled)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random cases (default 0)")
    jobs(p), cache_dir(p)
    p.set_defaults(func=cmd_check_mask)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _logging(args.verbose):
            return args.func(args)
    except SpecError as exc:  # bad spec name, manifest or arch: the user's input
        _err(str(exc))
        return 2
    except FlashJITError as exc:  # CompileError carries the NVRTC log and the saved source's path
        _err(str(exc))
        return 1
    except BrokenPipeError:  # `flashjit show ... | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
