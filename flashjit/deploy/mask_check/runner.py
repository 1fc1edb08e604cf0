"""The whole `flashjit check-mask` check of one mask.

check_mask(name) draws random cases (head_dim, dtype, GQA group, query tokens, page size, both
kernels, lengths including 0, 1 and page multiples), samples mask parameters with
MaskDef.sample_params (or small defaults for int/float params), and collects a Report the CLI
prints. It compiles for the requested archs and replays the hooks on the host; without a GPU it
skips the GPU part.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import time

from ...errors import FlashJITError, SpecError
from ...jit.spec import DecodeSpec
from ...masks.registry import masks
from ..smoke_test import gpu_available
from .batch_check import SPLITS, check_batch
from .cases import CPU_SPEC, NUM_KV_HEADS, Case, random_cases, random_lengths
from .host_replay import check_on_host
from .params import describe_params, parse_overrides, sample_params
from .report import CaseResult, CompileResult, Report


def compile_specs(mask: str, archs) -> list[DecodeSpec]:
    """What the compile-only check builds per arch: a GQA speculative-decoding spec on both kernels."""
    specs = []
    for arch in archs:
        for tensor_cores in (False, True):
            try:
                specs.append(DecodeSpec(mask=mask, arch=arch, tensor_cores=tensor_cores, **CPU_SPEC))
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


def check_case(engine, mask: str, case: Case, *, overrides=None, device="cuda", splits=SPLITS) -> CaseResult:
    """One random batch of a case through check_batch; an exception becomes the case's error."""
    import torch

    from ..random_batches import make_batch

    mask_def = masks.get(mask)
    rng = random.Random(case.seed)
    kv_lens = random_lengths(rng, case.page_size)
    q_lens = [min(case.q_len, n) for n in kv_lens]
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[case.dtype]
    spec_name = case.spec(mask, _device_arch(device)).name
    params = {}
    try:
        batch = make_batch(kv_lens, num_qo_heads=NUM_KV_HEADS * case.group, num_kv_heads=NUM_KV_HEADS,
                           head_dim=case.head_dim, page_size=case.page_size, dtype=dtype, q_lens=q_lens,
                           seed=rng.randrange(1 << 30), device=device)
        params = sample_params(mask_def, rng, kv_lens, q_lens, case.page_size, device, overrides)
        runs = check_batch(engine, batch, mask, params, splits=splits, tensor_cores=case.tensor_cores)
    except Exception as exc:  # report and go on: one broken case should not hide the others
        return CaseResult(case, spec_name, tuple(kv_lens), tuple(q_lens), describe_params(params), (),
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return CaseResult(case, spec_name, tuple(kv_lens), tuple(q_lens), describe_params(params), tuple(runs))


def _device_arch(device) -> str:
    import torch

    return "sm_%d%d" % torch.cuda.get_device_capability(torch.device(device))


def check_mask(name: str, *, archs=None, overrides=None, engine=None, seed: int = 0, cases=None,
               device="cuda", jobs: int | None = None) -> Report:
    """The `flashjit check-mask` check of one registered mask (see the module docstring).

    Compiles (archs), replays the hooks on the host (check_on_host), and with a GPU runs the cases.
    archs: compile for these (a list or 'sm_80,sm_90'); default: none with a GPU, sm_90 without.
    overrides: int/float mask params fixed for every case (dict, or ['name=value', ...]).
    cases: the GPU cases (default random_cases(seed)).
    """
    from ...jit.engine import Engine

    mask = masks.get(name)
    overrides = parse_overrides(mask, overrides)  # the CLI's checks and types for Python callers too
    if isinstance(archs, str):
        archs = [a.strip() for a in archs.split(",") if a.strip()]
    engine = engine or Engine()
    has_gpu = gpu_available()
    report = Report(name)
    if archs or not has_gpu:
        specs = compile_specs(name, archs or ["sm_90"])
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
    compile_all(engine, list(dict.fromkeys(c.spec(name, arch) for c in cases)), jobs)  # in parallel, up front
    report.cases = [check_case(engine, name, case, overrides=overrides, device=device) for case in cases]
    return report
