"""The whole `flashjit check-mask` check of one mask.

check_mask(name) draws random cases (head_dim, dtype, GQA group, query tokens, page size, both
kernels, lengths including 0, 1 and page multiples), samples mask parameters with
MaskDef.sample_params (or small defaults for int/float params), and collects a Report the CLI
prints. It compiles for the requested archs and replays the hooks on the host; without a GPU it
skips the GPU part.

A variant (flashjit.masks.variants) is checked the same way: check_mask("sinks") runs the cases
with the variant, each case under the next built-in mask of VARIANT_MASKS, its parameters from
VariantDef.sample_params; check_mask(mask, variant=...) checks one mask under a variant.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

from ...errors import FlashJITError, SpecError
from ...kernels.decode.spec import DecodeSpec
from ...masks.registry import masks
from ...masks.variants import variants
from ..smoke_test import gpu_available
from .batch_check import SPLITS, check_batch
from .cases import CPU_SPEC, NUM_KV_HEADS, VARIANT_MASKS, Case, random_cases, random_lengths
from .host_replay import check_on_host
from .params import describe_params, parse_overrides, sample_params
from .report import CaseResult, CompileResult, Report


def compile_specs(mask: str, archs, variant: str = "none") -> list[DecodeSpec]:
    """What the compile-only check builds per arch: a GQA speculative-decoding spec on both kernels."""
    specs = []
    for arch in archs:
        for tensor_cores in (False, True):
            try:
                specs.append(DecodeSpec(mask=mask, arch=arch, tensor_cores=tensor_cores, variant=variant, **CPU_SPEC))
            except SpecError:
                if not tensor_cores:
                    raise
    return specs


def compile_all(engine, specs, jobs: int | None = None) -> list[CompileResult]:
    """Compile (or find in the cache) each spec; a failure is a row, not an exception."""
    origin = {"compiled": "compiled", "disk": "hit (disk)", "memory": "hit (memory)"}

    def one(spec):
        start = time.perf_counter()
        try:
            (result,) = engine.prewarm([spec], jobs=1)
        except FlashJITError as exc:
            return CompileResult(spec.name, spec.arch, "FAIL", time.perf_counter() - start, str(exc))
        return CompileResult(spec.name, spec.arch, origin.get(result.source, result.source), result.seconds)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        return list(pool.map(one, specs))


def check_case(engine, mask: str, case: Case, *, overrides=None, device="cuda", splits=SPLITS,
               variant: str = "none", variant_overrides=None) -> CaseResult:
    """One random batch of a case through check_batch; an exception becomes the case's error.
    overrides fix the mask's int/float params, variant_overrides the variant's."""
    import torch

    from ..random_batches import make_batch

    mask_def = masks.get(mask)
    rng = random.Random(case.seed)
    kv_lens = random_lengths(rng, case.page_size)
    q_lens = [min(case.q_len, n) for n in kv_lens]
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[case.dtype]
    spec_name = case.spec(mask, _device_arch(device), variant).name
    variant_def = variants.get(variant)
    params, variant_params = {}, {}
    try:
        batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * case.group, num_kv_heads=NUM_KV_HEADS,
                           head_dim=case.head_dim, page_size=case.page_size, dtype=dtype, q_lens=q_lens,
                           seed=rng.randrange(1 << 30), device=device)
        params = sample_params(mask_def, rng, kv_lens, q_lens, case.page_size, device, overrides)
        variant_params = sample_variant_params(variant_def, rng, NUM_KV_HEADS * case.group, device, variant_overrides)
        runs = check_batch(engine, batch, mask, params, splits=splits, tensor_cores=case.tensor_cores,
                           variant=variant, variant_params=variant_params or None)
    except Exception as exc:  # report and go on: one broken case should not hide the others
        return CaseResult(case, spec_name, tuple(kv_lens), tuple(q_lens), describe_params({**params, **variant_params}),
                          (), f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return CaseResult(case, spec_name, tuple(kv_lens), tuple(q_lens), describe_params({**params, **variant_params}),
                      tuple(runs))


def sample_variant_params(variant, rng, num_qo_heads: int, device, overrides=None) -> dict:
    """variant_params for a random batch: VariantDef.sample_params, then overrides, then small
    defaults for int and float params (a tensor param needs sample_params)."""
    params = dict(variant.sample_params(rng, num_qo_heads, device)) if variant.sample_params else {}
    params.update(overrides or {})
    for p in variant.params:
        if p.name not in params:
            if p.kind not in ("int", "float"):
                raise SpecError(f"variant {variant.name!r}", f"param {p.name} ({p.kind})",
                                "variants whose tensor params a sample_params callable builds: "
                                "register_variant(..., sample_params=fn), see docs/masks.md")
            params[p.name] = rng.choice((1, 5, 37) if p.kind == "int" else (0.5, 2.0, 30.0))
    return params


def _device_arch(device) -> str:
    import torch

    return "sm_%d%d" % torch.cuda.get_device_capability(torch.device(device))


def check_mask(name: str, *, archs=None, overrides=None, engine=None, seed: int = 0, cases=None,
               device="cuda", jobs: int | None = None, variant: str | None = None) -> Report:
    """The `flashjit check-mask` check of one registered mask (see the module docstring).

    Compiles (archs), replays the hooks on the host (check_on_host), and with a GPU runs the cases.
    archs: compile for these (a list or 'sm_80,sm_90'); default: none with a GPU, sm_90 without.
    overrides: int/float mask params fixed for every case (dict, or ['name=value', ...]).
    cases: the GPU cases (default random_cases(seed)).
    name may be a variant's (checked under the masks of VARIANT_MASKS in turn, overrides fixing its
    params); variant: check the mask `name` under this variant.
    """
    from ...jit.engine import Engine

    if variant is None and name not in masks and name in variants:
        return _check_variant(name, archs=archs, overrides=overrides, engine=engine, seed=seed, cases=cases,
                              device=device, jobs=jobs)
    variant = variant or "none"
    variants.get(variant)  # an unknown variant fails here, naming the registered ones
    mask = masks.get(name)
    overrides = parse_overrides(mask, overrides)  # the CLI's checks and types for Python callers too
    if isinstance(archs, str):
        archs = [a.strip() for a in archs.split(",") if a.strip()]
    engine = engine or Engine()
    has_gpu = gpu_available()
    report = Report(name)
    if archs or not has_gpu:
        specs = compile_specs(name, archs or ["sm_90"], variant)
        report.compiled = compile_all(engine, specs, jobs)
    report.host = check_on_host(name, seed=seed, overrides=overrides)
    host = report.host
    what = "against its torch reference" if mask.reference else "(no torch reference: spans and mappings only)"
    report.notes.append(f"host check (the mask's hooks replayed on the CPU {what}): " + (
        f"skipped: {host.skipped}" if host.skipped else
        f"{host.requests} requests, {'PASS' if host.passed else 'FAIL'}"))
    if not has_gpu:
        report.notes.append("no CUDA GPU: skipped the GPU check (the mask was rendered and compiled only)")
        return report
    if mask.reference is None:
        report.notes.append(f"mask {name!r} has no torch reference: each run was compared with its own unsplit "
                            "run (span, kv_position and split consistency, not the predicate)")
    import torch

    arch = _device_arch(device)
    report.gpu = f"{torch.cuda.get_device_name(torch.device(device))} ({arch})"
    cases = random_cases(seed) if cases is None else list(cases)
    compile_all(engine, list(dict.fromkeys(c.spec(name, arch, variant) for c in cases)), jobs)  # in parallel, up front
    report.cases = [check_case(engine, name, case, overrides=overrides, device=device, variant=variant)
                    for case in cases]
    return report


def _check_variant(name: str, *, archs, overrides, engine, seed: int, cases, device, jobs) -> Report:
    """check_mask of a variant: the cases cycle through VARIANT_MASKS. Variants do not change which
    keys are read, so the host replay (a mask's) is not run."""
    from ...jit.engine import Engine

    variant = variants.get(name)
    fixed = parse_overrides(variant, overrides, "variant")
    if isinstance(archs, str):
        archs = [a.strip() for a in archs.split(",") if a.strip()]
    engine = engine or Engine()
    has_gpu = gpu_available()
    report = Report(name)
    if archs or not has_gpu:
        specs = [spec for mask in VARIANT_MASKS for spec in compile_specs(mask, archs or ["sm_90"], name)]
        report.compiled = compile_all(engine, specs, jobs)
    report.notes.append(f"variant {name!r}: cases cycle through the masks {', '.join(VARIANT_MASKS)}; no host "
                        "replay (a variant does not change which keys are read)")
    if not has_gpu:
        report.notes.append("no CUDA GPU: skipped the GPU check (the variant was rendered and compiled only)")
        return report
    import torch

    arch = _device_arch(device)
    report.gpu = f"{torch.cuda.get_device_name(torch.device(device))} ({arch})"
    cases = random_cases(seed) if cases is None else list(cases)
    chosen = [(VARIANT_MASKS[i % len(VARIANT_MASKS)], case) for i, case in enumerate(cases)]
    compile_all(engine, list(dict.fromkeys(case.spec(mask, arch, name) for mask, case in chosen)), jobs)
    report.cases = [check_case(engine, mask, case, device=device, variant=name, variant_overrides=fixed)
                    for mask, case in chosen]
    return report
