"""The dtype vocabulary every kernel family's spec speaks: canonical names (torch's), their aliases
and the short forms spec names use."""

from __future__ import annotations

from ..errors import SpecError

QUERY_DTYPES = ("float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # OCP fp8, as torch names them
KV_DTYPES = QUERY_DTYPES + FP8_DTYPES

_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",  # merge_states states only
}
SHORT_NAMES = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float32": "f32"}
LONG_NAMES = {short: name for name, short in SHORT_NAMES.items()}
# The C storage type of each dtype in the templates (common/kv_types.cuh, common/prelude.cuh)
STORAGE_TYPES = {"float16": "half_t", "bfloat16": "bfloat16_t", "float8_e4m3fn": "e4m3_t", "float8_e5m2": "e5m2_t"}


def normalize_dtype(value, field: str = "dtype", accepted=QUERY_DTYPES) -> str:
    """Map 'bf16', 'torch.bfloat16' or a torch dtype to its canonical name."""
    text = str(value).lower().removeprefix("torch.")
    name = _ALIASES.get(text)
    if name not in accepted:
        note = (" (fp8 is for the KV cache, kv_dtype; e4m3 queries keep a 16-bit output: "
                "a spec's query_fp8=True, plan(q_dtype='e4m3', out_dtype=...))"
                if name in FP8_DTYPES and not set(accepted) & set(FP8_DTYPES)
                else " (or short names such as 'bf16', 'e4m3', or torch dtypes)")
        raise SpecError(field, value, ", ".join(accepted) + note)
    return name
