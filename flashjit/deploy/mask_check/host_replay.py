"""The mask's hooks on the host, without a GPU: the walk every kernel makes, replayed in C++.

check_on_host(name) compiles the mask's hooks alone with the host C++ compiler and replays the
walk every kernel makes (base.cuh.j2's contract: span positions from kv_span, each mapped by
mask_kv_position, positions outside [0, kv_len) skipped, mask_visible per query row) for random
requests, against the torch predicate: every visible key is read exactly once, no hidden key is
attended, kv_position increases within a page. It tests the mask (template, kv_span, reference
together), not the kernel.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import random

from ...errors import SpecError
from ...kernels.decode.spec import DecodeSpec
from ...masks.params import MASK_PARAM_CTYPES
from ...masks.registry import MaskDef, masks
from .cases import CPU_SPEC, PAGE_SIZES, Q_LENS, random_lengths
from .host_build import build_host_library
from .params import describe_params, parse_overrides, sample_params

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

# The walk of templates/decode/*.cuh for one request: counts[i * kv_len + pos] += 1 for
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


def render_mask_hooks(mask: MaskDef, spec: DecodeSpec) -> str:
    """The mask template alone (MaskParams and its two hooks), rendered as for `spec`."""
    from ..._version import __version__
    from ...jit.dtypes import STORAGE_TYPES
    from ...jit.render import environment
    from ...kernels.decode.tiling import decode_tiling

    # The context render.render() gives the entry template, which includes the mask template.
    context = dict(spec=spec, tiling=decode_tiling(spec), mask=mask, ctype=STORAGE_TYPES, version=__version__)
    return environment().get_template(mask.template).render(**context)


def _params_struct(mask: MaskDef, params: dict):
    """MaskParams for the host library; returns (struct, arrays to keep alive)."""
    import numpy as np

    class MaskParams(ctypes.Structure):
        _fields_ = [(p.name, MASK_PARAM_CTYPES[p.kind]) for p in mask.params] + [("_unused", ctypes.c_int)]

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
        lib, why = build_host_library(HOST_SHIM + render_mask_hooks(mask, spec) + HOST_WALK)
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
