"""Check a mask: its kernels against the torch reference on a GPU; render and compile it anywhere.

`flashjit check-mask NAME` and the GPU tests (tests/gpu/test_masks_gpu.py) share this runner:

- batch_check: one paged batch through BatchDecode under every split policy, with random and
  with zero queries, against flashjit.serving.reference (check_batch).
- host_replay: the mask's hooks compiled for the CPU (host_build) and the kernels' walk replayed
  against the torch predicate, no GPU needed (check_on_host).
- runner: the whole check of one mask (check_mask): compile, host replay, random GPU cases
  (cases), their parameters (params), collected in a Report (report).
"""

from .batch_check import (PROBES, SPLITS, RunResult, check_batch, compare, count_failures, plan_and_run,
                          run_tolerance, split_options)
from .cases import (CPU_SPEC, DTYPES, GROUPS, HEAD_DIMS, NUM_KV_HEADS, PAGE_SIZES, Q_LENS, Case, random_cases,
                    random_lengths)
from .host_build import build_host_library, host_compiler
from .host_replay import HOST_SHIM, HOST_WALK, HostResult, check_on_host, render_mask_hooks
from .params import DEFAULT_FLOATS, DEFAULT_INTS, describe_params, parse_overrides, sample_params
from .report import CaseResult, CompileResult, Report
from .runner import check_case, check_mask, compile_all, compile_specs, gpu_available

__all__ = [
    "CPU_SPEC", "DEFAULT_FLOATS", "DEFAULT_INTS", "DTYPES", "GROUPS", "HEAD_DIMS", "HOST_SHIM",
    "HOST_WALK", "NUM_KV_HEADS", "PAGE_SIZES", "PROBES", "Q_LENS", "SPLITS",
    "Case", "CaseResult", "CompileResult", "HostResult", "Report", "RunResult", "build_host_library", "check_batch",
    "check_case", "check_mask", "check_on_host", "compare", "compile_all", "compile_specs", "count_failures",
    "describe_params",
    "gpu_available", "host_compiler", "parse_overrides", "plan_and_run", "random_cases", "random_lengths",
    "render_mask_hooks", "run_tolerance", "sample_params", "split_options",
]
