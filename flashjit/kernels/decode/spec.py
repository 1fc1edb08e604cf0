"""DecodeSpec: everything that changes the generated code, and nothing else.

Runtime values (batch, lengths, window size, sm_scale, the page table) are launch
arguments, never spec fields, so one compiled kernel serves every batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from ...errors import SpecError
from ...jit.arch import FP8_CONVERT_MIN_ARCH, WGMMA_COMPILE_ARCH, arch_number, check_shared_memory, normalize_arch
from ...jit.dtypes import KV_DTYPES, QUERY_DTYPES, SHORT_NAMES, normalize_dtype
from ...jit.spec_fields import CacheAndArch, check_int
from .tiling import decode_tiling

HEAD_DIMS = (64, 96, 128, 256, 512)
CUDA_CORE_HEAD_DIMS = (64, 96, 128, 256)  # head_dim 512 runs on tensor cores only
KV_LAYOUTS = ("NHD", "HND")
MAX_PAGE_SIZE = 256
MAX_GROUP_SIZE = 64
MAX_Q_LEN = 16
FP8_QUERY_DTYPE = "float8_e4m3fn"  # the queries' dtype with query_fp8
TENSOR_CORE_HEAD_DIMS = (64, 96, 128, 256, 512)
# Group x query tokens from which tensor cores win (docs/architecture.md): one. With 15 of the
# MMA's 16 rows idle a step still reads at the memory's speed; the CUDA-core kernel does not.
TENSOR_CORE_MIN_ROWS = 1

_NAME_PATTERN = re.compile(r"decode_d(?P<d>\d+)_(?P<dtype>[a-z0-9]+)_kv(?P<kv>[a-z0-9]+)_(?P<mask>\w+?)(?:-(?P<variant>\w+?))?"
                           r"_p(?P<p>\d+)_g(?P<g>\d+)_q(?P<q>\d+)_(?P<layout>nhd|hnd)_sm(?P<arch>\d+a?)(?P<tc>_tc)?(?P<sp>_sp)?"
                           r"(?P<fp8q>_fp8q)?")


@dataclasses.dataclass(frozen=True)
class DecodeSpec(CacheAndArch):
    """One kernel specialization. Frozen, hashable, picklable; validated on construction."""

    head_dim: int
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    mask: str = "none"
    page_size: int = 16
    group_size: int = 1
    max_q_len: int = 1
    kv_layout: str = "NHD"
    arch: str | None = None
    tensor_cores: bool | None = None  # None: chosen from the rows per CTA and head_dim
    variant: str = "none"  # how visible scores become weights (flashjit.masks.variants): soft_cap, sinks, ...
    # The kernel also reads shared-prefix records (worklist/shared.py): one chunk of a span many
    # requests share, for the rows of all of them. 16-bit tensor cores, masks without per-request state.
    shared_prefix: bool = False
    # The queries are e4m3 (dtype stays the output's): a framework quantized them for an fp8 cache,
    # as vLLM does for FA3 (and then runs the prefill rows on the same queries). Tensor cores, sm_89+.
    query_fp8: bool = False

    def __post_init__(self):
        set_ = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731 (frozen dataclass)
        check_int("head_dim", self.head_dim, 0, 0, HEAD_DIMS)
        set_("dtype", normalize_dtype(self.dtype, "dtype", QUERY_DTYPES))
        set_("kv_dtype", normalize_dtype(self.dtype if self.kv_dtype is None else self.kv_dtype, "kv_dtype", KV_DTYPES))
        check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        check_int("group_size", self.group_size, 1, MAX_GROUP_SIZE)
        check_int("max_q_len", self.max_q_len, 1, MAX_Q_LEN)
        layout = str(self.kv_layout).upper()
        if layout not in KV_LAYOUTS:
            raise SpecError("kv_layout", self.kv_layout, ", ".join(KV_LAYOUTS))
        set_("kv_layout", layout)
        set_("arch", normalize_arch(self.arch))
        tc_ok = self.head_dim in TENSOR_CORE_HEAD_DIMS
        cc_ok = self.head_dim in CUDA_CORE_HEAD_DIMS
        if self.tensor_cores is None:
            set_("tensor_cores", tc_ok and (not cc_ok or self.group_size * self.max_q_len >= TENSOR_CORE_MIN_ROWS))
        elif self.tensor_cores not in (True, False) or (self.tensor_cores and not tc_ok):
            raise SpecError("tensor_cores", self.tensor_cores,
                            f"None (automatic), False, or True with head_dim in {TENSOR_CORE_HEAD_DIMS}")
        elif not self.tensor_cores and not cc_ok:
            raise SpecError("tensor_cores", self.tensor_cores,
                            f"None or True at head_dim {self.head_dim} (CUDA-core kernels take head_dim in "
                            f"{CUDA_CORE_HEAD_DIMS})")
        if self.shared_prefix not in (True, False) or (self.shared_prefix and (not self.tensor_cores or self.kv_is_fp8)):
            raise SpecError("shared_prefix", self.shared_prefix, "False, or True for tensor cores over a 16-bit cache")
        reads_fp8_queries = (self.tensor_cores and self.kv_dtype == FP8_QUERY_DTYPE
                             and arch_number(self.arch) >= FP8_CONVERT_MIN_ARCH)
        if self.query_fp8 not in (True, False) or (self.query_fp8 and not reads_fp8_queries):
            raise SpecError("query_fp8", self.query_fp8, "False, or True for tensor cores over an e4m3 cache on "
                            f"sm_89 or later (this spec: tensor_cores={self.tensor_cores}, kv_dtype={self.kv_dtype}, "
                            f"arch={self.arch})")
        from ...masks.registry import masks  # late import: the registry imports nothing from here

        from ...validation import did_you_mean  # noqa: E402

        masks.get(self.mask)  # SpecError naming the masks (did you mean), and any plugin or template folder that failed
        from ...masks.variants import variants

        if self.variant not in variants:
            raise SpecError("variant", self.variant, ", ".join(sorted(variants.names())) + " (or a variant added "
                            "with register_variant)" + did_you_mean(self.variant, variants.names()))
        if self.shared_prefix and self.variant != "none":  # plan() shares prefixes under no variant
            raise SpecError("shared_prefix", self.shared_prefix, f"False with variant {self.variant!r} "
                            "(shared-prefix kernels take variant 'none')")
        if self.tensor_cores:  # the CUDA-core kernel's arrays are static, within 48 KB on every arch
            check_shared_memory(self, decode_tiling(self).smem_bytes, "a smaller head_dim or an fp8 cache takes less")

    @classmethod
    def cached(cls, head_dim, dtype, kv_dtype, mask, page_size, group_size, max_q_len, kv_layout, arch,
               tensor_cores, variant="none", shared_prefix=False, query_fp8=False) -> "DecodeSpec":
        """DecodeSpec(...) of these exact arguments, validated once: plan() asks for the same spec at
        every step, and validation costs more than the rest of a planned step's bookkeeping.

        Keys hold each argument's type as well (128.0 == 128 and True == 1, yet only the ints are
        accepted), so a memo hit answers exactly what construction would. Failures are not kept, nor
        specs of arch=None (that is the current GPU's arch, which is not an argument).
        """
        args = (head_dim, dtype, kv_dtype, mask, page_size, group_size, max_q_len, kv_layout, arch, tensor_cores,
                variant, shared_prefix, query_fp8)
        key = (args, tuple(map(type, args)))
        try:
            return _CACHED_SPECS[key]
        except KeyError:
            spec = cls(*args)
        except TypeError:  # an unhashable argument: construction names what is wrong with it
            return cls(*args)
        if arch is not None:
            if len(_CACHED_SPECS) >= _CACHED_SPECS_MAX:
                _CACHED_SPECS.clear()
            _CACHED_SPECS[key] = spec
        return spec

    @property
    def q_dtype(self) -> str:
        """The queries' dtype: e4m3 with query_fp8, else dtype (which is always the output's)."""
        return FP8_QUERY_DTYPE if self.query_fp8 else self.dtype

    @property
    def compile_arch(self) -> str:
        """sm_90a for a shared-prefix kernel whose shared records run on warpgroup MMAs
        (tiling.uses_shared_wgmma), whose instructions only that form of the arch has."""
        if not self.shared_prefix:
            return self.arch
        return WGMMA_COMPILE_ARCH if decode_tiling(self).shared_wgmma else self.arch

    @property
    def name(self) -> str:
        """A readable, unique name, e.g. decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc.

        The suffix _tc marks the tensor-core kernel (_tc_sp: one that reads shared-prefix records); a variant follows the mask after a hyphen
        (decode_d64_bf16_kvbf16_sliding_window-sinks_p16_g8_q1_nhd_sm90_tc), and "none" is left out."""
        variant = "" if self.variant == "none" else f"-{self.variant}"
        return (
            f"decode_d{self.head_dim}_{SHORT_NAMES[self.dtype]}_kv{SHORT_NAMES[self.kv_dtype]}_{self.mask}{variant}"
            f"_p{self.page_size}_g{self.group_size}_q{self.max_q_len}_{self.kv_layout.lower()}"
            f"_{self.arch.replace('_', '')}{'_tc' if self.tensor_cores else ''}{'_sp' if self.shared_prefix else ''}"
            f"{'_fp8q' if self.query_fp8 else ''}"
        )

    def _key_fields(self) -> list:
        """(name, value) of the fields, shared_prefix and query_fp8 only when set: the specs without
        them keep the reprs, digests and cache keys they have always had."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("shared_prefix", "query_fp8") or getattr(self, f.name)]

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({', '.join(f'{name}={value!r}' for name, value in self._key_fields())})"

    @property
    def digest(self) -> str:
        """Content digest of the fields (not of the generated code; the cache key covers that)."""
        return hashlib.sha256(repr(tuple(value for _, value in self._key_fields())).encode()).hexdigest()[:16]

    @classmethod
    def from_name(cls, name: str) -> "DecodeSpec":
        """Inverse of .name, so specs can be named on the command line."""
        match = _NAME_PATTERN.fullmatch(name.strip())
        if not match:
            raise SpecError("name", name, "names like decode_d128_bf16_kvbf16_causal_p16_g4_q1_nhd_sm90_tc")
        g = match.groupdict()
        return cls(head_dim=int(g["d"]), dtype=g["dtype"], kv_dtype=g["kv"], mask=g["mask"], page_size=int(g["p"]),
                   group_size=int(g["g"]), max_q_len=int(g["q"]), kv_layout=g["layout"], arch="sm_" + g["arch"],
                   tensor_cores=bool(g["tc"]), variant=g["variant"] or "none", shared_prefix=bool(g["sp"]),
                   query_fp8=bool(g["fp8q"]))

    def replace(self, **changes) -> "DecodeSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_CACHED_SPECS: dict = {}
_CACHED_SPECS_MAX = 1024  # distinct plan() argument sets kept; a serving process uses a handful
