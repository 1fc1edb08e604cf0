"""MLA decode for a framework's latent cache (one [blocks, block_size, 576] tensor: c_kv then k_pe),
planned once a step: the MLA counterpart of FormDecoders.

An eager BatchDecodeMLA serves eager steps; graph steps use a graph decoder per power of two of
query tokens (as FormDecoders'), each planned on the host before every replay from the host's page
table, with its page ids in one buffer the step owner writes."""

from __future__ import annotations

import dataclasses

import torch

from ...kernels.mla.spec import MAX_Q_LEN, MLASpec
from ...kernels.decode.spec import normalize_dtype, KV_DTYPES
from ...jit.engine import default_engine
from ...serving.batch_mla import BatchDecodeMLA
from ... import validation
from .decoders import graph_decoder_of
from .kv_cache import FP8_CACHE_DTYPES
from .page_tables import HostPageTable

LATENT_WIDTH = 576  # kv_lora_rank 512 + rope 64: the only MLA shape flashjit's kernels take


@dataclasses.dataclass(frozen=True)
class MLAForm:
    num_heads: int
    page_size: int
    q_dtype: str
    kv_dtype: str
    sm_scale: float

    def __post_init__(self):
        object.__setattr__(self, "q_dtype", normalize_dtype(self.q_dtype))
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype, "kv_dtype", KV_DTYPES))

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype.startswith("float8")

    def plan_kwargs(self) -> dict:
        return dict(num_heads=self.num_heads, page_size=self.page_size, sm_scale=self.sm_scale,
                    q_dtype=self.q_dtype, kv_dtype=self.kv_dtype)

    def specs(self, arch: str, max_q_len: int) -> list[MLASpec]:
        return [MLASpec(num_heads=self.num_heads, dtype=self.q_dtype, kv_dtype=self.kv_dtype, page_size=self.page_size,
                        max_q_len=q, arch=arch) for q in range(1, max_q_len + 1)]


def latent_cache(kv_cache: torch.Tensor, cache_dtype: str = "auto") -> torch.Tensor:
    """The framework's [blocks, block_size, 576] latent cache, an fp8 one viewed as its fp8 type."""
    validation.tensor("kv_c_and_k_pe_cache", kv_cache, ndim=3)
    if kv_cache.shape[-1] != LATENT_WIDTH:
        validation.fail("kv_c_and_k_pe_cache", f"[blocks, block_size, {LATENT_WIDTH}] (kv_lora_rank 512 + rope 64)",
                        f"shape {tuple(kv_cache.shape)}")
    fp8 = FP8_CACHE_DTYPES.get(cache_dtype)
    return kv_cache if fp8 is None or kv_cache.dtype == fp8 else kv_cache.view(fp8)


class MLADecoders:
    def __init__(self, form: MLAForm, device, *, max_decode_q_len: int, engine=None,
                 page_ids_buffer: torch.Tensor | None = None, **decoder_options):
        if not 1 <= max_decode_q_len <= MAX_Q_LEN:
            validation.fail("max_decode_q_len", f"an int in 1..{MAX_Q_LEN} (query tokens flashjit's MLA kernels take)",
                            max_decode_q_len)
        self.form, self.device = form, torch.device(device)
        self.max_decode_q_len = max_decode_q_len
        self.engine = engine or default_engine()
        self.page_ids_buffer = page_ids_buffer
        self._options = decoder_options
        self.eager = BatchDecodeMLA(self.engine, self.device, **decoder_options)
        self.graphs: dict[int, BatchDecodeMLA] = {}

    def prewarm(self, arch: str, jobs: int | None = None):
        return self.engine.prewarm(self.form.specs(arch, self.max_decode_q_len), jobs=jobs)

    def plan_eager(self, table: HostPageTable) -> BatchDecodeMLA:
        self.eager.plan(table.indptr, table.indices, table.last_page_len, qo_indptr=table.qo_indptr,
                        check_page_ids=False, **self.form.plan_kwargs())
        return self.eager

    def graph_decoder(self, tokens: int) -> BatchDecodeMLA:
        return graph_decoder_of(self, BatchDecodeMLA, tokens, check_page_ids=False, **self.form.plan_kwargs())

    def plan_graph(self, tokens: int, table: HostPageTable) -> BatchDecodeMLA:
        decoder = self.graph_decoder(tokens)
        decoder.plan(table.indptr, table.indices, table.last_page_len, qo_indptr=table.qo_indptr,
                     check_page_ids=False, **self.form.plan_kwargs())
        return decoder

    def run(self, decoder: BatchDecodeMLA, q_nope, q_pe, kv_cache: torch.Tensor, out, *, scale=None):
        """Attention of the decode rows over the latent cache (as latent_cache() sees it) into out
        ([tokens, heads, 512]); scale: the fp8 cache's (its c_kv and k_pe share it)."""
        return decoder.run(q_nope, q_pe, kv_cache, out=out, ckv_scale=scale if self.form.kv_is_fp8 else None)
