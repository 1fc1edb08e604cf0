"""MergeSpec: the one compile-time choice of the merge_states kernel, its states' dtype (and the arch).

Everything else (number of states, tokens, heads, head_dim, strides) is a launch argument, so three
kernels per arch serve every merge. The kernel's source is templates/merge_states/entry.cu.j2.
"""

from __future__ import annotations

import dataclasses
import re

from ...errors import SpecError
from ...jit.arch import arch_number, normalize_arch
from ...jit.dtypes import LONG_NAMES, SHORT_NAMES, normalize_dtype

MERGE_DTYPES = ("float16", "bfloat16", "float32")
VECTOR_BYTES = 16  # each thread moves one 16-byte vector of a row per state
MAX_HEAD_DIM = 1024
MAX_LANES = MAX_HEAD_DIM // 4  # fp32 at MAX_HEAD_DIM: the threads of one row (the kernel's launch bound)
_NAME_PATTERN = re.compile(r"merge_states_(?P<dtype>f16|bf16|f32)_sm(?P<arch>\d+a?)")


@dataclasses.dataclass(frozen=True)
class MergeSpec:
    """The merge_states kernel of one state dtype for one arch. Frozen, hashable; validated on construction."""

    dtype: str = "bfloat16"
    arch: str | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype, "dtype", MERGE_DTYPES))
            object.__setattr__(self, "arch", normalize_arch(self.arch))
        except SpecError as exc:
            raise SpecError(exc.field, exc.value, exc.accepted, owner="MergeSpec") from None

    @property
    def element_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def vector_elements(self) -> int:
        """Elements of one 16-byte vector: head_dim must be a multiple of it."""
        return VECTOR_BYTES // self.element_bytes

    @property
    def arch_number(self) -> int:
        return arch_number(self.arch)

    @property
    def compile_arch(self) -> str:
        return self.arch

    @property
    def name(self) -> str:
        """e.g. merge_states_bf16_sm90."""
        return f"merge_states_{SHORT_NAMES[self.dtype]}_{self.arch.replace('_', '')}"

    @classmethod
    def from_name(cls, name: str) -> "MergeSpec":
        match = _NAME_PATTERN.fullmatch(name.strip())
        if not match:
            raise SpecError("name", name, "names like merge_states_bf16_sm90 (dtypes f16, bf16, f32)", owner="MergeSpec")
        return cls(dtype=LONG_NAMES[match["dtype"]], arch="sm_" + match["arch"])

    def replace(self, **changes) -> "MergeSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def head_dims_accepted(dtype: str, head_dim: int) -> str | None:
    """None where the kernel merges rows of head_dim values of dtype (a MERGE_DTYPES name), else
    the head_dims it accepts: whole 16-byte vectors, at most MAX_HEAD_DIM."""
    step = VECTOR_BYTES // (4 if dtype == "float32" else 2)
    if 0 < head_dim <= MAX_HEAD_DIM and head_dim % step == 0:
        return None
    return f"multiples of {step} up to {MAX_HEAD_DIM} for {dtype} states"
