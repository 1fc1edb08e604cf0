"""MLA kernels from HuggingFace `config.json` files of latent-attention models (DeepSeek-V2/V3/R1,
Kimi-K2): the fields DeepseekV3Config defines.

    num_heads      = num_attention_heads / TP, for each tensor-parallel size (default 1, 8 and 16)
    kv_lora_rank   = kv_lora_rank (the latent c_kv), 512
    rope_dim       = qk_rope_head_dim (k_pe), 64
    dtype          = torch_dtype (float32 checkpoints are served in bf16)
    sm_scale       = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times mscale ** 2 under YaRN
                     rope_scaling (mscale = 0.1 * mscale_all_dim * ln(factor) + 1): a plan()
                     argument, reported in the summary, not part of a kernel.
A config is an MLA config when it sets kv_lora_rank. Every problem raises ManifestError naming the
file, the model and the config field.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ..errors import SpecError
from ..kernels.mla.spec import LATENT_DIMS, MAX_HEADS, ROPE_DIMS, MLASpec
from .hf_config import _config_dtype, _model_name, _positive_int, config_path, load_config
from .input_files import ManifestError, dict_field, number_field, quote, str_field
from .manifest import resolve_archs

DEFAULT_TPS = (1, 8, 16)


@dataclasses.dataclass(frozen=True)
class MLAAttention:
    """The latent attention shape of one model, as a config.json describes it."""

    name: str
    path: str
    num_heads: int       # query heads of the whole model (TP 1)
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    sm_scale: float
    notes: tuple[str, ...] = ()

    def heads_at(self, tp: int) -> int:
        return self.num_heads // tp

    def summary(self) -> str:
        return (f"{self.name}: multi-head latent attention, {self.num_heads} query heads on one latent head "
                f"(c_kv {self.kv_lora_rank} + k_pe {self.rope_dim}), {self.dtype}; plan with "
                f"sm_scale={self.sm_scale:.6g}")

    def specs(self, archs, tps=DEFAULT_TPS, page_sizes=(64,), kv_dtype=None, max_q_lens=(1,)) -> list[MLASpec]:
        """One spec per TP size, page size, query tokens and arch (TP sizes must divide the heads)."""
        fail = lambda field, problem: ManifestError(self.path, self.name, field, problem)  # noqa: E731
        for tp in tps:
            if not isinstance(tp, int) or tp < 1 or self.num_heads % tp:
                raise fail("--tp", f"{quote(tp)} must be a positive divisor of num_attention_heads={self.num_heads}")
        targets = resolve_archs(archs, (), self.path)
        specs = []
        for tp, page_size, q_len, arch in itertools.product(tps, page_sizes, max_q_lens, targets):
            try:
                specs.append(MLASpec(num_heads=self.heads_at(tp), dtype=self.dtype, kv_dtype=kv_dtype,
                                     page_size=page_size, max_q_len=q_len, arch=arch, kv_lora_rank=self.kv_lora_rank,
                                     rope_dim=self.rope_dim))
            except SpecError as exc:
                raise fail(exc.field, f"{quote(exc.value)} is not supported; accepted: {exc.accepted}") from None
        return list(dict.fromkeys(specs))


def is_mla_config(path) -> bool:
    """Whether a config.json (or its folder) describes latent attention (sets kv_lora_rank)."""
    try:
        config = load_config(config_path(path))
    except ManifestError:
        return False  # read_hf_config reports what is wrong with it
    return bool(config.get("kv_lora_rank"))


def read_mla_config(path, dtype=None) -> MLAAttention:
    path = config_path(path)
    config = load_config(path)
    name = _model_name(config, path)
    fail = lambda field, problem: ManifestError(path, name, field, problem)  # noqa: E731
    heads = _positive_int(config, "num_attention_heads", fail)
    if heads > MAX_HEADS:
        raise fail("num_attention_heads", f"{heads}: at most {MAX_HEADS} query heads per latent head")
    rank = _positive_int(config, "kv_lora_rank", fail)
    if rank not in LATENT_DIMS:
        raise fail("kv_lora_rank", f"{rank} is not supported; accepted: {', '.join(map(str, LATENT_DIMS))}")
    rope = _positive_int(config, "qk_rope_head_dim", fail)
    if rope not in ROPE_DIMS:
        raise fail("qk_rope_head_dim", f"{rope} is not supported; accepted: {', '.join(map(str, ROPE_DIMS))}")
    nope = _positive_int(config, "qk_nope_head_dim", fail)
    notes: list[str] = []
    if dtype is None:
        dtype = _config_dtype(config, notes, fail)
    try:
        dtype = MLASpec(num_heads=1, dtype=dtype, arch="sm_90").dtype
    except SpecError as exc:
        raise fail("torch_dtype", f"{quote(dtype)} is not supported; accepted: {exc.accepted}") from None
    scale = (nope + rope) ** -0.5
    rope_scaling = dict_field(config, "rope_scaling", fail, default={})
    nested = lambda field, problem: fail(f"rope_scaling.{field}", problem)  # noqa: E731
    if (str_field(rope_scaling, "type", nested) or str_field(rope_scaling, "rope_type", nested)) == "yarn":
        factor = number_field(rope_scaling, "factor", nested, minimum=1e-30, default=1.0)
        all_dim = number_field(rope_scaling, "mscale_all_dim", nested, default=0.0)
        if factor > 1 and all_dim:
            mscale = 0.1 * all_dim * math.log(factor) + 1.0
            if not 1.0 <= mscale <= 1e6:  # DeepSeek-V3's is 1.37
                raise nested("mscale_all_dim", f"gives the YaRN mscale {mscale:.3g} (0.1 x mscale_all_dim x "
                                               "ln(factor) + 1), expected 1..1e6")
            scale *= mscale ** 2
    return MLAAttention(name, str(path), heads, rank, rope, dtype, scale, tuple(notes))
