"""PoolDecoder: flashjit's decode attention over SGLang's token pool, planned from a step's
req_to_token metadata (torch and flashjit only; the SGLang backend translates into it).

A step is planned once for all layers: one BatchDecode per LayerForm (the settings that change the
kernel or its launch: sm_scale, sliding window, logit soft-cap), all over the same page table.
Eager steps plan on the host (plan()'s C fast path, no synchronization: SGLang's page ids are
valid pool slots). CUDA-graph steps go through decoders of fixed capacity (use_cuda_graph=True,
the page ids in one buffer they all read): a graph captured once per batch size replays after
plan_graph() has planned the replay's batch, any composition of up to the captured size, and the
GPU planner makes the work list where the mask allows it (none, causal, sliding_window).
"""

from __future__ import annotations

import dataclasses
import math
import typing

import torch

from ... import validation
from ...jit.arch import current_arch
from ...kernels.decode.spec import DecodeSpec, KV_DTYPES, MAX_Q_LEN, QUERY_DTYPES, normalize_dtype
from ...jit.engine import default_engine
from ...serving.batch_decode import BatchDecode
from .tables import HostTable, check_layout, check_page_size, host_table, page_ids, paged_kv


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What every layer the decoder serves has in common: heads, dtypes and the pool's pages."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: str = "bfloat16"
    kv_dtype: str | None = None  # None: q_dtype
    page_size: int = 1
    kv_layout: str = "NHD"

    def __post_init__(self):
        set_ = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731 (frozen dataclass)
        validation.head_counts(self.num_qo_heads, self.num_kv_heads, check_page_size(self.page_size))
        set_("q_dtype", normalize_dtype(self.q_dtype, "q_dtype", QUERY_DTYPES))
        set_("kv_dtype", normalize_dtype(self.q_dtype if self.kv_dtype is None else self.kv_dtype, "kv_dtype",
                                         KV_DTYPES))
        set_("kv_layout", check_layout(self.kv_layout))

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype.startswith("float8")


@dataclasses.dataclass(frozen=True)
class LayerForm:
    """A layer's settings that its plan depends on. window_left: SGLang's sliding_window_size (a
    query at position p sees keys p - window_left .. p; None: every key); logit_cap: the soft cap
    cap·tanh(s / cap) of the scaled scores (None: none)."""

    sm_scale: float
    window_left: int | None = None
    logit_cap: float | None = None

    def __post_init__(self):
        validation.positive_float32("sm_scale", self.sm_scale)
        if self.window_left is not None:
            validation.int32_param("window_left", self.window_left)
        if self.logit_cap is not None:
            validation.positive_float32("logit_cap", self.logit_cap)

    def mask(self, multi_token: bool) -> str:
        if self.window_left is not None:
            return "sliding_window"
        return "causal" if multi_token else "none"

    def plan_options(self, multi_token: bool) -> dict:
        """plan()'s keywords for this form (a decode step: one query token per request)."""
        return dict(mask=self.mask(multi_token), window_left=self.window_left, sm_scale=self.sm_scale,
                    logits_soft_cap=self.logit_cap)


class Step(typing.NamedTuple):
    """One planned step: its decoder per form, ready for run(), and its page table."""

    decoders: dict
    table: HostTable
    graph: bool


class PoolDecoder:
    """Decode attention over an SGLang-style token pool for the layers of `forms`.

    make_decoder(engine, device, **options) builds each BatchDecode (tests pass a CPU one);
    max_q_len: most query tokens per request a step may have (1: decode); arch: the GPU arch
    specs() and prewarm() build for (default the current GPU's)."""

    def __init__(self, shape: AttentionShape, forms, device="cuda", *, engine=None, make_decoder=BatchDecode,
                 max_q_len: int = 1, arch: str | None = None):
        self.shape = shape
        self.forms = tuple(dict.fromkeys(forms))
        if not self.forms or not all(isinstance(f, LayerForm) for f in self.forms):
            validation.fail("forms", "one LayerForm or more", forms)
        if not isinstance(max_q_len, int) or not 1 <= max_q_len <= MAX_Q_LEN:
            validation.fail("max_q_len", f"an int in 1..{MAX_Q_LEN}", repr(max_q_len))
        self.max_q_len, self.arch = max_q_len, arch
        self.engine = engine or default_engine()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the buffers' device, as BatchDecode's
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._make_decoder = make_decoder
        self._eager = {form: make_decoder(self.engine, self.device) for form in self.forms}
        self._graph: dict | None = None
        self._graph_page_ids: torch.Tensor | None = None
        self._graph_batch = 0
        self._views: dict = {}  # (data_ptr, shape, strides, dtype) of a pool buffer -> its paged view

    # ---- kernels ------------------------------------------------------------------------------

    def specs(self, arch: str | None = None) -> list[DecodeSpec]:
        """Every kernel the decoder's plans use (arch: default the decoder's): a decode step's per form,
        and with max_q_len > 1 the kernels of steps with up to max_q_len query tokens per request."""
        arch = arch or self.arch or current_arch()
        s = self.shape
        return list(dict.fromkeys(
            DecodeSpec(head_dim=s.head_dim, dtype=s.q_dtype, kv_dtype=s.kv_dtype, mask=form.mask(q_len > 1),
                       page_size=s.page_size, group_size=s.group_size, max_q_len=q_len, kv_layout=s.kv_layout,
                       arch=arch, variant="soft_cap" if form.logit_cap is not None else "none")
            for form in self.forms for q_len in range(1, self.max_q_len + 1)))

    def prewarm(self, jobs: int | None = None, arch: str | None = None):
        """Compile (or find in the cache) every kernel of specs(); with FLASHJIT_NO_COMPILE=1 a
        kernel missing from the cache raises KernelNotPrewarmed naming it."""
        return self.engine.prewarm(self.specs(arch), jobs=jobs)

    # ---- plans ----------------------------------------------------------------------------------

    def plan(self, req_to_token, req_pool_indices, seq_lens, seq_lens_cpu=None, q_lens_cpu=None) -> Step:
        """An eager step: its page table from SGLang's metadata (seq_lens_cpu: the host copy of
        seq_lens; None reads seq_lens back, which waits for the GPU), planned for every form."""
        table = host_table(seq_lens.cpu() if seq_lens_cpu is None else seq_lens_cpu, self.shape.page_size,
                           q_lens_cpu)
        self._check_q_len(table)
        ids = page_ids(req_to_token, req_pool_indices, seq_lens, self.shape.page_size, table.num_page_ids)
        for form, decoder in self._eager.items():
            self._plan_one(decoder, form, table, ids)
        return Step(self._eager, table, graph=False)

    def init_graphs(self, max_batch_size: int, max_pages_per_request: int):
        """CUDA-graph decoders for batches of up to max_batch_size requests of up to
        max_pages_per_request pages each (SGLang: its context length in pages), reading one page-id
        buffer of both's product; each planned once here, which fixes its kernel and buffers."""
        for name, value in (("max_batch_size", max_batch_size), ("max_pages_per_request", max_pages_per_request)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                validation.fail(name, "a positive int", repr(value))
        capacity = max_batch_size * max_pages_per_request
        if capacity > validation.INT32_MAX:
            validation.fail("max_batch_size x max_pages_per_request", f"at most {validation.INT32_MAX} page ids",
                            capacity)
        ids = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        options = dict(use_cuda_graph=True, max_batch_size=max_batch_size, max_num_pages=capacity,
                       max_tokens=max_batch_size * self.max_q_len, max_q_len=self.max_q_len, page_ids_buffer=ids)
        graph = {form: self._make_decoder(self.engine, self.device, **options) for form in self.forms}
        one_key = host_table([1], self.shape.page_size)  # one request of one key on page 0
        for form, decoder in graph.items():
            self._plan_one(decoder, form, one_key, ids)
        self._graph, self._graph_page_ids, self._graph_batch = graph, ids, max_batch_size

    def plan_graph(self, req_to_token, req_pool_indices, seq_lens, seq_lens_cpu=None, q_lens_cpu=None) -> Step:
        """A CUDA-graph step (init_graphs() first): the page ids written into the graph decoders'
        buffer and every form planned over it. A batch beyond the capacity is refused before
        anything is written."""
        if self._graph is None:
            raise RuntimeError("PoolDecoder.plan_graph() needs init_graphs() first")
        table = host_table(seq_lens.cpu() if seq_lens_cpu is None else seq_lens_cpu, self.shape.page_size,
                           q_lens_cpu)
        self._check_q_len(table)
        if table.batch > self._graph_batch:
            validation.fail("CUDA-graph step", f"at most max_batch_size={self._graph_batch} requests", table.batch)
        page_ids(req_to_token, req_pool_indices, seq_lens, self.shape.page_size, table.num_page_ids,
                 out=self._graph_page_ids)
        for form, decoder in self._graph.items():
            self._plan_one(decoder, form, table, self._graph_page_ids)
        return Step(self._graph, table, graph=True)

    @property
    def graph_page_ids(self) -> torch.Tensor | None:
        """The page-id buffer the CUDA-graph decoders read (None before init_graphs())."""
        return self._graph_page_ids

    def _check_q_len(self, table: HostTable):
        if table.max_q_len > self.max_q_len:
            validation.fail("q_lens", f"at most max_q_len={self.max_q_len} query tokens per request",
                            table.max_q_len)

    def _plan_one(self, decoder, form: LayerForm, table: HostTable, ids):
        s = self.shape
        decoder.plan(table.indptr, ids, table.last_page_len, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size,
                     qo_indptr=table.qo_indptr, q_dtype=s.q_dtype, kv_dtype=s.kv_dtype, kv_layout=s.kv_layout,
                     check_page_ids=False, share_prefixes=False, **form.plan_options(table.max_q_len > 1))

    # ---- run ------------------------------------------------------------------------------------

    def run(self, step: Step, form: LayerForm, q, k_buffer, v_buffer, *, out=None, k_scale=None, v_scale=None):
        """Attention of q ([tokens, qo_heads, head_dim]) for a layer of `form` over its pool
        buffers (read in place); returns out. An fp8 pool holds K / k_scale and V / v_scale
        (floats or float32 tensors; None: 1)."""
        decoder = step.decoders.get(form)
        if decoder is None:
            validation.fail("form", f"one of the planned forms {list(step.decoders)}", form)
        if self.shape.kv_is_fp8:
            k_scale, v_scale = (1.0 if k_scale is None else k_scale), (1.0 if v_scale is None else v_scale)
        return decoder.run(q, (self._paged(k_buffer), self._paged(v_buffer)), out=out, k_scale=k_scale,
                           v_scale=v_scale)

    def _paged(self, buffer: torch.Tensor) -> torch.Tensor:
        """paged_kv(buffer), the same view object for the same storage (BatchDecode validates a
        cache once a plan per object)."""
        key = (buffer.data_ptr(), tuple(buffer.shape), buffer.stride(), buffer.dtype)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = paged_kv(buffer, self.shape.page_size, self.shape.kv_layout)
        return view


def pages_per_request(context_len: int, page_size: int) -> int:
    """Most pages one request of context_len tokens spans."""
    return max(1, math.ceil(context_len / page_size))
