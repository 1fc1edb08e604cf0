"""The `flashjit` command: prewarm, list, show, clear, doctor, run-example.

Argument parsing and printing only; the work is done by the engine, the cache, the manifest
module and selfcheck. Tables go to stdout, progress bars and log lines to stderr.
Exit codes: 0 success, 1 a compile/check failure, 2 a bad argument, spec or manifest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

from . import __version__
from .errors import FlashJITError, SpecError

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
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


_ORIGIN = {"memory": "hit (memory)", "disk": "hit (disk)", "compiled": "compiled"}


# ---- prewarm ----------------------------------------------------------------------------------

def _collect_specs(manifest, spec_names, arch_text) -> list:
    from .manifest import parse_arch_list, resolve_archs, specs_from_manifest
    from .spec import DecodeSpec

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
    from .engine import Engine

    if not args.manifest and not args.spec:
        _err("nothing to prewarm: give a MANIFEST.toml and/or --spec NAME")
        return 2
    specs = _collect_specs(args.manifest, args.spec, args.arch)
    engine = Engine(args.cache_dir)
    results, wall = prewarm_specs(engine, specs, args.jobs)
    print(summary(results, wall))
    print(f"cache: {engine.cache.root}" + ("" if engine.cache.writable else " (not writable: kept in memory only)"))
    return 0


# ---- list / show / clear ----------------------------------------------------------------------

def cmd_list(args) -> int:
    from .cache import KernelCache

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
    from .render import render
    from .spec import DecodeSpec

    sys.stdout.write(render(DecodeSpec.from_name(args.spec_name)))
    return 0


def cmd_clear(args) -> int:
    from .cache import KernelCache

    cache = KernelCache(args.cache_dir)
    count = cache.clear()
    print(f"removed {count} entries from {cache.root}")
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
    from .cache import KernelCache
    from .compile import compile_source, nvrtc_version
    from .render import render
    from .spec import DecodeSpec, current_arch

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
    for folder in (Path.cwd() / "examples", Path(__file__).resolve().parent.parent / "examples"):
        if (folder / DEFAULT_EXAMPLE).is_file():
            return folder / DEFAULT_EXAMPLE
    return None


def cmd_run_example(args) -> int:
    from . import selfcheck
    from .engine import Engine
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
    if not selfcheck.gpu_available():
        print("no CUDA GPU: skipped the GPU decode step (kernels were compiled and cached only)")
        return 0
    check = selfcheck.decode_check(engine)
    verdict = "PASS" if check.passed else "FAIL"
    print(f"GPU decode step: {check.spec_name}, kv_lens {list(check.kv_lens)}: "
          f"max abs error {check.max_abs_err:.3e} vs float32 reference: {verdict}")
    return 0 if check.passed else 1


# ---- check-mask -------------------------------------------------------------------------------

def cmd_check_mask(args) -> int:
    from .check_mask import check_mask
    from .engine import Engine

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

    p = sub.add_parser("prewarm", help="compile (or load) every kernel of a manifest and/or named specs")
    p.add_argument("manifest", nargs="?", metavar="MANIFEST.toml")
    p.add_argument("--spec", action="append", metavar="NAME",
                   help="a spec name such as decode_d128_bf16_kvbf16_none_p16_g4_q1_nhd_sm90_tc (repeatable)")
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
