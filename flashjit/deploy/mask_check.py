"""Check a mask: its kernels against the torch reference on a GPU; render and compile it anywhere.

`flashjit check-mask NAME` and the GPU tests (tests/gpu/test_masks_gpu.py) share this runner:

- check_batch(engine, batch, mask, params) plans and runs BatchDecode on one paged batch under
  every split policy (SPLITS), with outputs poisoned with NaN first, twice: with the batch's
  random queries, and with zero queries. Zero queries give every visible key the same weight, so
  a row's LSE is ln(number of visible keys): an exact count that a missed or an extra key fails
  (COUNT_LSE_ATOL), however long the row. Each run is compared with
  flashjit.decode.reference.decode_reference, which applies the mask's torch predicate. A mask without
  a predicate (a template folder's mask) is compared with its own unsplit run instead: that
  checks the span, the kv_position mapping and split/merge consistency, not the predicate.
- check_mask(name) draws random cases (head_dim, dtype, GQA group, query tokens, page size,
  both kernels, lengths including 0, 1 and page multiples), samples mask parameters with
  MaskDef.sample_params (or small defaults for int/float params), and collects a Report the CLI
  prints. Without a GPU it renders and compiles, for the requested archs, and skips the GPU part.
- check_on_host(name) needs no GPU: it compiles the mask's hooks alone with the host C++
  compiler and replays the walk every kernel makes (base.cuh.j2's contract: span positions from
  kv_span, each mapped by mask_kv_position, positions outside [0, kv_len) skipped, mask_visible
  per query row) for random requests, against the torch predicate: every visible key is read
  exactly once, no hidden key is attended, kv_position increases within a page. It tests the
  mask (template, kv_span, reference together), not the kernel.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import itertools
import os
import random
import shutil
import subprocess
import tempfile
import time

from ..errors import FlashJITError, SpecError
from ..masks.registry import MaskDef, masks
from ..jit.spec import DecodeSpec

GROUPS = (1, 4, 7)
Q_LENS = (1, 4)
PAGE_SIZES = (1, 16, 64)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
NUM_KV_HEADS = 2
SPLITS = ("auto", "one", "two", "many")  # planner's choice, no split, two chunks, 16-token chunks
PROBES = ("random q", "zero q")
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}  # relative (Frobenius) error of out
LSE_ATOL, LSE_RTOL = 2e-2, 1e-3
COUNT_LSE_ATOL = 5e-5  # zero q: ln(N + 1) - ln(N) > 1.9e-4 for the N <= 5000 keys of random_lengths
DEFAULT_INTS = (0, 1, 5, 37)  # int params of masks without sample_params
DEFAULT_FLOATS = (0.0, 0.5, 2.0)
CPU_SPEC = dict(head_dim=128, dtype="bfloat16", page_size=16, group_size=4, max_q_len=4)  # compile-only check


# ---- one batch ------------------------------------------------------------------------------------

def random_lengths(rng: random.Random, page_size: int) -> list[int]:
    """Zero, one, page multiples and not, and a long request beside short ones."""
    lengths = [0, 1, page_size, 3 * page_size + 1, rng.randint(2, 300), rng.randint(1500, 5000)]
    rng.shuffle(lengths)
    return lengths


def split_options(split: str, kv_lens) -> dict:
    """plan() keywords of a split policy."""
    return {"auto": {}, "one": {"disable_split_kv": True},
            "two": {"chunk_tokens": max(1, -(-max(kv_lens, default=1) // 2))},
            "many": {"chunk_tokens": 16}}[split]


def plan_and_run(engine, batch, mask: str, params: dict, split: str = "auto", *, q=None, tensor_cores=None):
    """BatchDecode on a flashjit.deploy.random_batches.PagedBatch; out and lse start as NaN. Returns (out, lse, decoder)."""
    import torch

    from ..decode.batch_decode import BatchDecode

    q = batch.q if q is None else q
    num_kv_heads = batch.k_cache.shape[2 if batch.kv_layout == "NHD" else 1]
    decoder = BatchDecode(engine, device=q.device)
    decoder.plan(batch.indptr, batch.indices, batch.last_page_len, q.shape[1], num_kv_heads, q.shape[2],
                 batch.page_size, qo_indptr=batch.qo_indptr, mask=mask, mask_params=params, q_dtype=q.dtype,
                 kv_layout=batch.kv_layout, tensor_cores=tensor_cores, **split_options(split, batch.kv_lens))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    decoder.run(q, (batch.k_cache, batch.v_cache), out=out, lse=lse)
    return out, lse, decoder


def compare(out, lse, ref, ref_lse, *, tolerance: float, lse_atol: float = LSE_ATOL,
            lse_rtol: float = LSE_RTOL) -> tuple[float, float, list[str]]:
    """(relative error of out, max lse error, failures) of one run against a reference."""
    from .random_batches import rel_error

    failures = []
    nan_rows = int(out.isnan().any(-1).sum())
    if nan_rows:
        failures.append(f"NaN in {nan_rows} output rows (never written?)")
    if lse.isnan().any():
        failures.append(f"NaN in {int(lse.isnan().sum())} lse entries")
    err = rel_error(out, ref)
    if not err <= tolerance:
        failures.append(f"out: relative error {err:.2e} > {tolerance:.0e}")
    finite = ref_lse.isfinite()
    disagree = lse.isfinite() != finite
    if disagree.any():
        failures.append(f"{int(disagree.sum())} (token, head) rows disagree with the reference on being fully masked")
    both = finite & lse.isfinite()
    diff = (lse[both] - ref_lse[both]).abs()
    lse_err = float(diff.max()) if diff.numel() else 0.0
    if diff.numel() and (diff > lse_atol + lse_rtol * ref_lse[both].abs()).any():
        failures.append(f"lse: max error {lse_err:.2e} (atol {lse_atol:.0e})")
    if (~finite).any() and not (out[~finite] == 0).all():
        failures.append("fully masked rows are not 0")
    return err, lse_err, failures


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One plan + run of a batch, compared with the reference."""

    spec: str       # the kernel that ran (DecodeSpec.name)
    split: str      # one of SPLITS
    probe: str      # one of PROBES
    rel_err: float
    lse_err: float
    failures: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failures


def check_batch(engine, batch, mask: str, params: dict, *, splits=SPLITS, probes=PROBES,
                tensor_cores=None) -> list[RunResult]:
    """Every split policy x probe of one batch against decode_reference (see the module docstring)."""
    import torch

    from ..decode.reference import decode_reference
    from ..jit.spec import normalize_dtype

    has_reference = masks.get(mask).reference is not None
    tolerance = TOLERANCE[normalize_dtype(batch.q.dtype)]
    order = sorted(splits, key=lambda s: s != "one")  # without a reference the unsplit run is the baseline
    results = []
    for probe in probes:
        q = batch.q if probe == "random q" else torch.zeros_like(batch.q)
        ref = ref_lse = None
        if has_reference:
            ref, ref_lse = decode_reference(q, batch.k_cache, batch.v_cache, batch.indptr, batch.indices,
                                            batch.last_page_len, qo_indptr=batch.qo_indptr, mask=mask,
                                            mask_params=params, kv_layout=batch.kv_layout)
        for split in order:
            out, lse, decoder = plan_and_run(engine, batch, mask, params, split, q=q, tensor_cores=tensor_cores)
            if ref is None:
                ref, ref_lse = out.float(), lse.clone()
            err, lse_err, failures = compare(out, lse, ref, ref_lse, tolerance=tolerance,
                                             **({"lse_atol": COUNT_LSE_ATOL, "lse_rtol": 0.0}
                                                if probe == "zero q" else {}))
            results.append(RunResult(decoder.spec.name, split, probe, err, lse_err, tuple(failures)))
    return results


# ---- parameters -----------------------------------------------------------------------------------

def parse_overrides(mask: MaskDef, items) -> dict:
    """['window_left=37', ...] (or {'window_left': '37'}) -> {'window_left': 37}, typed by the param kinds."""
    kinds = {p.name: p.kind for p in mask.params}
    if isinstance(items, dict):
        items = [f"{k}={v}" for k, v in items.items()]
    values = {}
    for item in items or ():
        name, sep, text = str(item).partition("=")
        name = name.strip()
        if not sep or name not in kinds:
            raise SpecError("--params", item, f"NAME=VALUE with NAME one of {list(kinds)} (mask {mask.name!r})")
        if kinds[name] == "int_tensor":
            raise SpecError("--params", item, f"int or float params only; {name!r} is a tensor, built by the "
                                              "mask's sample_params")
        try:
            values[name] = int(text) if kinds[name] == "int" else float(text)
        except ValueError:
            raise SpecError("--params", item, f"a{'n int' if kinds[name] == 'int' else ' float'} value for "
                                              f"{name!r}") from None
    return values


def sample_params(mask: MaskDef, rng: random.Random, kv_lens, q_lens, page_size: int, device,
                  overrides: dict | None = None) -> dict:
    """mask_params for a random batch: MaskDef.sample_params, then overrides, then small defaults."""
    overrides = dict(overrides or {})
    params = dict(mask.sample_params(rng, list(kv_lens), list(q_lens), page_size, device)) if mask.sample_params else {}
    for p in mask.params:
        if p.name in overrides:
            params[p.name] = overrides[p.name]
        elif p.name not in params:
            if p.kind == "int_tensor":
                raise SpecError(f"mask {mask.name!r}", f"param {p.name} (int_tensor)",
                                "masks whose tensor params a sample_params callable builds: "
                                "register_mask(..., sample_params=fn), see docs/masks.md")
            params[p.name] = rng.choice(DEFAULT_INTS if p.kind == "int" else DEFAULT_FLOATS)
    return params


def describe_params(params: dict) -> str:
    """Short text of mask params for failure messages (tensors by length, or values when short)."""
    parts = []
    for name, value in params.items():
        if hasattr(value, "tolist"):
            value = value.tolist() if value.numel() <= 16 else f"<{value.numel()} values>"
        parts.append(f"{name}={value}")
    return ", ".join(parts)


# ---- on the host: the mask's hooks without a GPU ------------------------------------------------

# CUDA built-ins mask code commonly uses, for the host compiler. A template that needs others
# makes check_on_host skip (with the compiler's message), not fail.
HOST_SHIM = r"""
#include <cstddef>
#include <cstring>
#define FJ_INLINE static inline
#define __device__
#define __forceinline__
template <typename T> static inline T __ldg(const T* p) { return *p; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
"""

# The walk of templates/include/decode*.cuh for one request: counts[i * kv_len + pos] += 1 for
# each (query row i, key pos) the kernel attends. Returns the first span position whose
# kv_position does not increase within its page, or -1.
HOST_WALK = r"""
extern "C" int fj_walk(const MaskParams* runtime, int request, int kv_len, int q_len, int begin, int end,
                       int page_size, unsigned char* counts) {
  MaskParams unbound{};  // the host passes the runtime parameters; the state that follows is bind's
  memcpy(&unbound, runtime, offsetof(MaskParams, _unused));
  const MaskParams bound = mask_bind(unbound, request), *params = &bound;
  int bad = -1, prev = 0;
  for (int v = begin; v < end; ++v) {
    const int pos = mask_kv_position(*params, request, v);
    if (v > begin && v % page_size != 0 && pos <= prev && bad < 0) bad = v;
    prev = pos;
    if (pos < 0 || pos >= kv_len) continue;
    for (int i = 0; i < q_len; ++i)
      if (mask_visible(*params, request, i, q_len, kv_len - q_len + i, pos, kv_len)) counts[i * kv_len + pos] += 1;
  }
  return bad;
}
"""


def host_compiler() -> str | None:
    """$CXX, else c++ on PATH; None when there is none."""
    return shutil.which(os.environ.get("CXX") or "c++")


def render_mask_hooks(mask: MaskDef, spec: DecodeSpec) -> str:
    """The mask template alone (MaskParams and its two hooks), rendered as for `spec`."""
    from .._version import __version__
    from ..jit.render import STORAGE_TYPES, environment
    from ..jit.tiling import decode_tiling

    # The context render.render() gives the entry template, which includes the mask template.
    context = dict(spec=spec, tiling=decode_tiling(spec), mask=mask, ctype=STORAGE_TYPES, version=__version__)
    return environment().get_template(mask.template).render(**context)


_host_dir: str | None = None


@functools.lru_cache(maxsize=None)
def _host_library(source: str):
    """Compile source into a shared library once per process; (library, None) or (None, why not)."""
    global _host_dir
    compiler = host_compiler()
    if compiler is None:
        return None, "no host C++ compiler (set CXX or install c++)"
    if _host_dir is None:
        _host_dir = tempfile.mkdtemp(prefix="flashjit-host-mask-")
        atexit.register(shutil.rmtree, _host_dir, True)
    stem = os.path.join(_host_dir, hashlib.sha256(source.encode()).hexdigest()[:16])
    with open(stem + ".cpp", "w") as f:
        f.write(source)
    proc = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", stem + ".cpp", "-o", stem + ".so"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
        return None, f"the mask's hooks do not compile for the host ({first.strip()})"
    lib = ctypes.CDLL(stem + ".so")
    lib.fj_walk.restype = ctypes.c_int
    return lib, None


_PARAM_CTYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "int_tensor": ctypes.c_void_p}


def _params_struct(mask: MaskDef, params: dict):
    """MaskParams for the host library; returns (struct, arrays to keep alive)."""
    import numpy as np

    class MaskParams(ctypes.Structure):
        _fields_ = [(p.name, _PARAM_CTYPES[p.kind]) for p in mask.params] + [("_unused", ctypes.c_int)]

    struct, keep = MaskParams(), []
    for p in mask.params:
        value = params[p.name]
        if p.kind == "int_tensor":
            array = np.ascontiguousarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value,
                                         dtype=np.int32)
            keep.append(array)
            value = array.ctypes.data
        setattr(struct, p.name, value)
    return struct, keep


@dataclasses.dataclass(frozen=True)
class HostResult:
    mask: str
    requests: int                   # requests replayed
    failures: tuple[str, ...] = ()
    skipped: str = ""               # why it did not run

    @property
    def passed(self) -> bool:
        return not self.failures


def check_on_host(name: str, *, seed: int = 0, overrides=None, page_sizes=PAGE_SIZES, q_lens=Q_LENS,
                  max_failures: int = 10) -> HostResult:
    """Replay the kernels' walk of the mask's hooks on the CPU against its torch predicate."""
    import numpy as np
    import torch

    mask = masks.get(name)
    overrides = parse_overrides(mask, overrides)
    failures: list[str] = []
    requests = 0
    for page_size, q_len in itertools.product(page_sizes, q_lens):
        spec = DecodeSpec(mask=name, arch="sm_90", **{**CPU_SPEC, "page_size": page_size, "max_q_len": q_len})
        lib, why = _host_library(HOST_SHIM + render_mask_hooks(mask, spec) + HOST_WALK)
        if lib is None:
            return HostResult(name, requests, skipped=why)
        rng = random.Random(hash((seed, page_size, q_len)) & 0xFFFFFFFF)
        kv = random_lengths(rng, page_size)
        ql = [min(q_len, n) for n in kv]
        try:
            params = sample_params(mask, rng, kv, ql, page_size, "cpu", overrides)
        except SpecError as exc:  # tensor params and no sampler
            return HostResult(name, requests, skipped=f"no parameters to test with: {exc.accepted}")
        kv_lens, q_lens_h = np.array(kv, dtype=np.int64), np.array(ql, dtype=np.int64)
        begin, end = mask.kv_span(kv_lens, q_lens_h, params) if mask.kv_span else (np.zeros_like(kv_lens), kv_lens)
        struct, _keep = _params_struct(mask, params)
        for r, (kv_len, n) in enumerate(zip(kv, ql)):
            if kv_len == 0 or n == 0:
                continue
            requests += 1
            counts = np.zeros((n, kv_len), dtype=np.uint8)
            bad = lib.fj_walk(ctypes.byref(struct), r, kv_len, n, int(begin[r]), int(end[r]), page_size,
                              counts.ctypes.data_as(ctypes.c_void_p))
            where = f"page_size={page_size} kv_len={kv_len} q_len={n} span=[{int(begin[r])}, {int(end[r])}) " \
                    f"request {r}, params: {describe_params(params)}"
            if bad >= 0:
                failures.append(f"kv_position not increasing within a page at span position {bad} ({where})")
            if counts.max(initial=0) > 1:
                failures.append(f"{int((counts > 1).sum())} (query, key) pairs attended more than once: "
                                f"kv_position maps two span positions to one key ({where})")
            if mask.reference is not None:
                q_pos = torch.arange(kv_len - n, kv_len)[:, None]
                kv_pos = torch.arange(kv_len)[None, :]
                visible = mask.reference(q_pos, kv_pos, r, params).expand(n, kv_len).numpy()
                missed, extra = visible & (counts == 0), ~visible & (counts > 0)
                if missed.any():
                    i, k = map(int, np.argwhere(missed)[0])
                    failures.append(f"{int(missed.sum())} visible (query, key) pairs never read, e.g. query {i} "
                                    f"key {k}: kv_span too short or kv_position wrong ({where})")
                if extra.any():
                    i, k = map(int, np.argwhere(extra)[0])
                    failures.append(f"{int(extra.sum())} (query, key) pairs attended that the reference hides, "
                                    f"e.g. query {i} key {k} ({where})")
            if len(failures) >= max_failures:
                return HostResult(name, requests, tuple(failures))
    return HostResult(name, requests, tuple(failures))


# ---- the whole check ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    group: int
    q_len: int
    page_size: int
    tensor_cores: bool
    seed: int

    def spec(self, mask: str, arch: str) -> DecodeSpec:
        """The DecodeSpec plan() builds for this case (q_len = the longest request's query count)."""
        return DecodeSpec(self.head_dim, dtype=self.dtype, mask=mask, page_size=self.page_size,
                          group_size=self.group, max_q_len=self.q_len, arch=arch, tensor_cores=self.tensor_cores)


def random_cases(seed: int = 0, *, groups=GROUPS, q_lens=Q_LENS, page_sizes=PAGE_SIZES) -> list[Case]:
    """Every group x query length x page size, each with a random head_dim and dtype, on both kernels."""
    rng = random.Random(seed)
    cases = []
    for group, q_len, page_size in itertools.product(groups, q_lens, page_sizes):
        head_dim, dtype = rng.choice(HEAD_DIMS), rng.choice(DTYPES)
        for tensor_cores in (False, True):
            case = Case(dtype, head_dim, group, q_len, page_size, tensor_cores, rng.randrange(1 << 30))
            try:
                case.spec("none", "sm_90")
            except SpecError:  # e.g. no tensor-core kernel for this head_dim
                continue
            cases.append(case)
    return cases


@dataclasses.dataclass(frozen=True)
class CompileResult:
    spec: str
    arch: str
    result: str     # "compiled", "hit (disk)", "hit (memory)" or "FAIL"
    seconds: float
    error: str = ""


@dataclasses.dataclass(frozen=True)
class CaseResult:
    case: Case
    spec: str
    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    params: str
    runs: tuple[RunResult, ...]
    error: str = ""  # an exception that stopped the case

    @property
    def passed(self) -> bool:
        return not self.error and all(r.passed for r in self.runs)


@dataclasses.dataclass
class Report:
    mask: str
    compiled: list[CompileResult] = dataclasses.field(default_factory=list)
    cases: list[CaseResult] = dataclasses.field(default_factory=list)
    host: HostResult | None = None
    gpu: str | None = None  # the device the cases ran on; None: skipped
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (all(c.result != "FAIL" for c in self.compiled) and all(c.passed for c in self.cases)
                and (self.host is None or self.host.passed))

    def tables(self) -> list[tuple[str, tuple, list[tuple]]]:
        """(title, header, rows) for the CLI to print."""
        tables = []
        if self.compiled:
            tables.append((f"compile: mask {self.mask!r}", ("spec", "arch", "result", "seconds"),
                           [(c.spec, c.arch, c.result, f"{c.seconds:.2f}") for c in self.compiled]))
        if self.cases:
            rows = []
            for c in self.cases:
                passed = sum(r.passed for r in c.runs)
                rows.append((c.spec, f"{passed}/{len(c.runs)}",
                             f"{max((r.rel_err for r in c.runs), default=0.0):.1e}",
                             f"{max((r.lse_err for r in c.runs if r.probe == 'zero q'), default=0.0):.1e}",
                             "PASS" if c.passed else "FAIL"))
            tables.append((f"GPU check on {self.gpu}: {len(SPLITS)} split policies x {len(PROBES)} probes "
                           f"per kernel", ("kernel", "runs ok", "max rel err", "max count-lse err", "result"), rows))
        return tables

    def failures(self) -> list[str]:
        lines = [f"FAIL compile {c.spec}: {c.error}" for c in self.compiled if c.result == "FAIL"]
        lines += [f"FAIL host check: {f}" for f in (self.host.failures if self.host else ())]
        for c in self.cases:
            where = f"kv_lens={list(c.kv_lens)} q_lens={list(c.q_lens)} params: {c.params}"
            if c.error:
                lines.append(f"FAIL {c.spec}: {c.error} ({where})")
            for r in c.runs:
                if not r.passed:
                    lines.append(f"FAIL {r.spec} split={r.split} probe={r.probe}: {'; '.join(r.failures)} ({where})")
        return lines


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

    from .random_batches import make_batch

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


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def check_mask(name: str, *, archs=None, overrides=None, engine=None, seed: int = 0, cases=None,
               device="cuda", jobs: int | None = None) -> Report:
    """The `flashjit check-mask` check of one registered mask (see the module docstring).

    Compiles (archs), replays the hooks on the host (check_on_host), and with a GPU runs the cases.
    archs: compile for these (a list or 'sm_80,sm_90'); default: none with a GPU, sm_90 without.
    overrides: int/float mask params fixed for every case (dict, or ['name=value', ...]).
    cases: the GPU cases (default random_cases(seed)).
    """
    from ..jit.engine import Engine

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
