"""MLASpec: one multi-head latent attention (DeepSeek-V3/R1, Kimi-K2) decode specialization.

MLA caches one latent vector per token, c_kv (kv_lora_rank = 512 values) plus its RoPE part k_pe
(rope_dim = 64), shared by every query head. Per head, a query token scores
q_nope . c_kv + q_pe . k_pe (576 dims) and reads out sum p . c_kv (512 dims): GQA with one KV
head, a 576-wide key and a 512-wide value made of the key's first 512 bytes.

As with DecodeSpec, every field changes the generated code and nothing else does: lengths, the
page table, sm_scale and the cache scales are launch arguments. Query tokens of one request attend
causally (token i of q_len sees positions <= kv_len - q_len + i), so the spec's mask is always the
built-in "causal".
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

from ...errors import SpecError
from ...jit.arch import WGMMA_COMPILE_ARCH, check_shared_memory, normalize_arch
from ...jit.dtypes import FP8_DTYPES, QUERY_DTYPES, SHORT_NAMES, normalize_dtype
from ...jit.spec_fields import CacheAndArch, check_int
from .tiling import mla_tiling, uses_wgmma

LATENT_DIMS = (512,)  # kv_lora_rank of DeepSeek-V2/V3/R1 and Kimi-K2
ROPE_DIMS = (64,)     # qk_rope_head_dim of the same models
MAX_HEADS = 128       # query heads per latent head on one GPU (DeepSeek-V3 at TP 1)
MAX_Q_LEN = 4         # query tokens per request (multi-token prediction, speculative decoding)
MAX_PAGE_SIZE = 256
MASK = "causal"
VARIANT = "none"

_NAME_PATTERN = re.compile(r"mla_c(?P<c>\d+)_r(?P<r>\d+)_h(?P<h>\d+)_(?P<dtype>[a-z0-9]+)_kv(?P<kv>[a-z0-9]+)"
                           r"_p(?P<p>\d+)_q(?P<q>\d+)_sm(?P<arch>\d+a?)")


def _error(field: str, value, accepted: str) -> SpecError:
    return SpecError(field, value, accepted, owner="MLASpec")


@dataclasses.dataclass(frozen=True)
class MLASpec(CacheAndArch):
    """One MLA decode kernel. Frozen, hashable, picklable; validated on construction."""

    num_heads: int                 # query heads per latent head (num_attention_heads / TP)
    dtype: str = "bfloat16"        # queries and output
    kv_dtype: str | None = None    # latent cache: the query dtype, or fp8 (e4m3, e5m2) with scales
    page_size: int = 64
    max_q_len: int = 1
    arch: str | None = None
    kv_lora_rank: int = 512
    rope_dim: int = 64

    def __post_init__(self):
        set_ = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731 (frozen dataclass)
        try:
            check_int("num_heads", self.num_heads, 1, MAX_HEADS)
            set_("dtype", normalize_dtype(self.dtype, "dtype", QUERY_DTYPES))
            kv = self.dtype if self.kv_dtype is None else self.kv_dtype
            set_("kv_dtype", normalize_dtype(kv, "kv_dtype", (self.dtype,) + FP8_DTYPES))
            check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
            check_int("max_q_len", self.max_q_len, 1, MAX_Q_LEN)
            check_int("kv_lora_rank", self.kv_lora_rank, 0, 0, LATENT_DIMS)
            check_int("rope_dim", self.rope_dim, 0, 0, ROPE_DIMS)
            set_("arch", normalize_arch(self.arch))
        except SpecError as exc:  # the shared checks name DecodeSpec: name this class instead
            raise _error(exc.field, exc.value, exc.accepted) from None
        check_shared_memory(self, mla_tiling(self).smem_bytes, "a 16-bit cache takes less", owner="MLASpec")

    # What the shared parts of the engine and the decode headers ask of a spec.
    @property
    def mask(self) -> str:
        return MASK

    @property
    def variant(self) -> str:
        """Always "none": MLA kernels have no logits or sink hooks."""
        return VARIANT

    @property
    def head_dim(self) -> int:
        """The output width: the latent rank (the value is c_kv)."""
        return self.kv_lora_rank

    @property
    def compile_arch(self) -> str:
        """sm_90a for the wgmma kernel (mla_tiling.uses_wgmma), whose instructions only that form of
        sm_90 has; the spec's arch otherwise."""
        return WGMMA_COMPILE_ARCH if uses_wgmma(self) else self.arch

    @property
    def qk_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def name(self) -> str:
        """A readable, unique name, e.g. mla_c512_r64_h128_bf16_kvbf16_p64_q1_sm90."""
        return (f"mla_c{self.kv_lora_rank}_r{self.rope_dim}_h{self.num_heads}_{SHORT_NAMES[self.dtype]}"
                f"_kv{SHORT_NAMES[self.kv_dtype]}_p{self.page_size}_q{self.max_q_len}_{self.arch.replace('_', '')}")

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]

    @classmethod
    def from_name(cls, name: str) -> "MLASpec":
        """Inverse of .name, so specs can be named on the command line."""
        match = _NAME_PATTERN.fullmatch(name.strip())
        if not match:
            raise _error("name", name, "names like mla_c512_r64_h128_bf16_kvbf16_p64_q1_sm90")
        g = match.groupdict()
        return cls(num_heads=int(g["h"]), dtype=g["dtype"], kv_dtype=g["kv"], page_size=int(g["p"]),
                   max_q_len=int(g["q"]), arch="sm_" + g["arch"], kv_lora_rank=int(g["c"]), rope_dim=int(g["r"]))

    @classmethod
    def looks_like(cls, name: str) -> bool:
        return name.strip().startswith("mla_")

    def replace(self, **changes) -> "MLASpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
