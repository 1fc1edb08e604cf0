"""The `flashjit` commands that build and check kernels: prewarm, show, run-example, check-mask."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from .cli_output import UsageError, error, on_terminal, print_json, table

DEFAULT_EXAMPLE = "llama-3-8b.toml"
ORIGIN = {"memory": "hit (memory)", "disk": "hit (disk)", "compiled": "compiled"}


# ---- the kernels a command line names ---------------------------------------------------------

def collect_specs(manifest, spec_names, arch_text) -> list:
    """The specs of a manifest and of --spec names (retargeted to every --arch when given), once each."""
    from .manifest import parse_arch_list, resolve_archs, specs_from_manifest
    from ..jit.family import spec_from_name

    specs = []
    if manifest:
        specs += specs_from_manifest(manifest, arch_text)
    for name in spec_names or ():
        spec = spec_from_name(name)
        if arch_text:  # --arch retargets named specs too (one name, a fleet of archs)
            specs += [spec.replace(arch=arch) for arch in resolve_archs(parse_arch_list(arch_text))]
        else:
            specs.append(spec)
    return list(dict.fromkeys(specs))


def hf_specs(args) -> list:
    """The specs of every --hf-config (a config.json or its folder); says what it derived on stderr."""
    from .hf_config import manifest_from_hf_config, read_hf_config
    from .hf_mla import DEFAULT_TPS, is_mla_config, read_mla_config
    from .input_files import printable
    from .manifest import parse_arch_list

    configs = getattr(args, "hf_config", None) or ()
    tp_text = getattr(args, "tp", None)
    if not configs:
        if args.page_size or args.dtype or args.kv_dtype or args.max_q_len or tp_text:
            raise UsageError("--page-size, --dtype, --kv-dtype, --max-q-len and --tp apply to --hf-config only")
        return []
    ints = lambda text, default: [int(v) for v in parse_arch_list(text)] if text else default  # noqa: E731
    try:
        page_sizes, max_q_lens, tps = ints(args.page_size, None), ints(args.max_q_len, [1]), ints(tp_text, DEFAULT_TPS)
    except ValueError:
        raise UsageError(f"--page-size {args.page_size} / --max-q-len {args.max_q_len} / --tp {tp_text}: expected "
                         "comma-separated integers such as 16,32") from None
    specs = []
    for config in configs:
        if is_mla_config(config):  # latent attention: MLA kernels at each TP size
            mla = read_mla_config(config, dtype=args.dtype)
            print(f"flashjit: {printable(mla.path)}: {mla.summary()}", file=sys.stderr)
            for note in mla.notes:
                print(f"flashjit: note: {printable(note)}", file=sys.stderr)
            specs += mla.specs(args.arch, tps, page_sizes or [64], args.kv_dtype, max_q_lens)
            continue
        model = read_hf_config(config, dtype=args.dtype)
        print(f"flashjit: {printable(model.path)}: {model.summary()}", file=sys.stderr)
        for note in model.notes:
            print(f"flashjit: note: {printable(note)}", file=sys.stderr)
        specs += manifest_from_hf_config(config, page_sizes or [16], args.dtype, args.kv_dtype,
                                         max_q_lens).specs(args.arch)
    return specs


def named_specs(args) -> list:
    """Every spec the command line names: manifest, --spec and --hf-config, once each, in that order."""
    return list(dict.fromkeys(collect_specs(args.manifest, args.spec, args.arch) + hf_specs(args)))


# ---- prewarm ----------------------------------------------------------------------------------

def prewarm_specs(engine, specs, jobs: int | None, *, progress: bool = True) -> tuple[list, float]:
    """Engine.prewarm with a progress bar on stderr where stderr is a terminal, else (progress
    given) one summary line there when done; returns (results, wall seconds)."""
    from tqdm import tqdm

    lock = threading.Lock()
    start = time.perf_counter()
    drawn = progress and on_terminal()
    with tqdm(total=len(specs), desc="prewarm", unit="kernel", file=sys.stderr, disable=not drawn,
              leave=False) as bar:
        def on_done(result):
            with lock:
                bar.set_postfix_str(result.spec.name, refresh=False)
                bar.update(1)

        results = engine.prewarm(specs, jobs=jobs, on_done=on_done)
    wall = time.perf_counter() - start
    if progress and not drawn:
        print(f"flashjit: prewarm: {totals_line(results, wall)}", file=sys.stderr)
    return results, wall


def totals_line(results, wall_s: float) -> str:
    counts = {origin: sum(r.source == origin for r in results) for origin in ("compiled", "disk", "memory")}
    return (f"{len(results)} kernels, {counts['compiled']} compiled, {counts['disk']} disk hits, "
            f"{counts['memory']} memory hits in {wall_s:.2f} s")


def prewarm_summary(results, wall_s: float, unsaved=frozenset()) -> str:
    """One row per kernel (where it came from, seconds), then the totals."""
    rows = [(r.spec.name, r.spec.arch, ORIGIN.get(r.source, r.source) + (", not saved" if r.spec in unsaved else ""),
             f"{r.seconds:.2f}") for r in results]
    return table(rows, ("spec", "arch", "result", "seconds")) + "\ntotal: " + totals_line(results, wall_s)


def prewarm_json(results, wall_s: float, unsaved, cache, host_planner: str) -> dict:
    return {"kernels": [{"spec": r.spec.name, "arch": r.spec.arch, "result": r.source, "saved": r.spec not in unsaved,
                         "seconds": round(r.seconds, 4)} for r in results],
            "total": {origin: sum(r.source == origin for r in results) for origin in ("compiled", "disk", "memory")}
            | {"kernels": len(results), "seconds": round(wall_s, 4)},
            "cache": {"root": str(cache.root), "writable": cache.writable}, "host_planner": host_planner}


def cmd_prewarm(args) -> int:
    from ..jit.engine import Engine

    if not args.manifest and not args.spec and not args.hf_config:
        error("nothing to prewarm: give a MANIFEST.toml and/or --spec NAME, or --hf-config config.json")
        return 2
    specs = named_specs(args)
    engine = Engine(args.cache_dir, allow_compile=True)  # compiling is its job, even where FLASHJIT_NO_COMPILE is set
    results, wall = prewarm_specs(engine, specs, args.jobs)
    # A compile whose entry did not reach the disk (read-only, full) serves only this process.
    unsaved = {r.spec for r in results
               if r.source == "compiled" and engine.cache.load(engine.get_kernel(r.spec).key) is None}
    planner = host_planner_status(engine.cache)
    if args.json:
        print_json(prewarm_json(results, wall, unsaved, engine.cache, planner))
    else:
        print(prewarm_summary(results, wall, unsaved))
        print(f"cache: {engine.cache.root}" + ("" if engine.cache.writable else " (not writable: kept in memory only)"))
        print(f"host planner: {planner}")
    if unsaved:
        error(f"{len(unsaved)} kernels compiled but not saved in the kernel cache at {engine.cache.root} (read-only "
              "or full: see the warning); a later process or `flashjit cache export` will not find them")
        return 1
    return 0


def host_planner_status(cache) -> str:
    """Builds plan()'s C helper into the cache too, so the first plan() of a server does not."""
    from ..serving.host_plan import load_host_plan

    return "built (C)" if load_host_plan(cache) is not None else "numpy (no C helper: see the warning)"


# ---- show -------------------------------------------------------------------------------------

def cmd_show(args) -> int:
    from ..jit.family import mask_of, source_of, spec_from_name, variant_of

    spec = spec_from_name(args.spec_name)
    sys.stdout.write(source_of(spec, mask_of(spec), variant_of(spec)))
    return 0


# ---- run-example ------------------------------------------------------------------------------

def default_manifest() -> Path | None:
    """examples/llama-3-8b.toml from the working directory, else from the source checkout."""
    for folder in (Path.cwd() / "examples", Path(__file__).resolve().parents[2] / "examples"):
        if (folder / DEFAULT_EXAMPLE).is_file():
            return folder / DEFAULT_EXAMPLE
    return None


def cmd_run_example(args) -> int:
    from . import smoke_test
    from ..jit.engine import Engine
    from .manifest import specs_from_manifest

    manifest = args.manifest or default_manifest()
    if manifest is None:
        error(f"examples/{DEFAULT_EXAMPLE} not found here or next to the package; pass --manifest PATH")
        return 2
    specs = specs_from_manifest(manifest, args.arch)
    engine = Engine(args.cache_dir)
    print(f"prewarming {len(specs)} kernels from {manifest}")
    results, wall = prewarm_specs(engine, specs, args.jobs)
    print(prewarm_summary(results, wall))
    print(f"cache: {engine.cache.root}")
    print(f"host planner: {host_planner_status(engine.cache)}")
    if not smoke_test.gpu_available():
        print("no CUDA GPU: skipped the GPU decode step (kernels were compiled and cached only)")
        return 0
    check = smoke_test.decode_check(engine)
    verdict = "PASS" if check.passed else "FAIL"
    print(f"GPU decode step: {check.spec_name}, kv_lens {list(check.kv_lens)}: worst row error "
          f"{check.worst_row_err:.2e} (bound {check.tolerance:.1e}) vs float32 reference, keys counted: {verdict}")
    for failure in check.failures:
        print(f"  {failure}")
    return 0 if check.passed else 1


# ---- check-mask -------------------------------------------------------------------------------

def cmd_check_mask(args) -> int:
    from .mask_check import check_mask
    from ..jit.engine import Engine

    report = check_mask(args.mask, archs=args.arch, overrides=args.params, engine=Engine(args.cache_dir),
                        seed=args.seed, jobs=args.jobs, variant=args.variant)
    if args.json:
        print_json({"mask": args.mask, "variant": args.variant, "passed": report.passed,
                    "tables": [{"title": title, "rows": [dict(zip(header, row)) for row in rows]}
                               for title, header, rows in report.tables()],
                    "notes": report.notes, "failures": report.failures()})
        return 0 if report.passed else 1
    for title, header, rows in report.tables():
        print(f"{title}\n{table(rows, header)}\n")
    for line in report.notes + report.failures():
        print(line)
    print(f"check-mask {args.mask}: {'PASS' if report.passed else 'FAIL'}")
    return 0 if report.passed else 1

