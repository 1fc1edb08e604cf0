"""PagedAttention: the per-layer attention function of transformers' continuous batching
(transformers 5.17 through 5.23), serving decode and short multi-token steps with a BatchDecode.

transformers calls fn(module, query [1, Hq, T, D], key/value [1, Hkv, T, D], attention_mask,
scaling=, cache=PagedAttentionCache, cu_seq_lens_q, cu_seq_lens_k, read_index, write_index, ...)
once per layer, with the step's new tokens after RoPE, packed across requests. The function writes
the new K/V into the layer's cache itself and returns (out, None).

One plan per step and layer group, not per layer: the group's first layer (layers run in order and
every forward runs it) plans, and the group's other layers reuse that plan while they see the very
tensors it was made from (`is`: get_model_kwargs makes new index views every step, and the memo
holds the planned ones, so a later step's views cannot be mistaken for them). A layer that sees
other tensors plans again.

Requests with more query tokens than the kernel takes (prefill chunks) are computed by torch SDPA
over their gathered keys (gathered.py); a step may mix both.

With cuda_graphs=True every step is served on the GPU alone, so transformers can capture and
replay it (graph_step.py): the page table is computed on the device from the step's tensors,
prefill chunks are cut into pieces the kernel takes, and no length is read back to the host.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ... import validation
from ...kernels.decode.spec import MAX_Q_LEN
from . import gathered
from .features import UnsupportedAttention, refuse_unsupported
from .graph_step import GraphDecoder
from .cache_layout import LayerCache, layer_cache
from .step_tables import StepTables, page_ids, step_tables


def flashjit_backend(device, **options):
    """The default backend: a BatchDecode on the cache's device (options: its CUDA-graph keywords)."""
    from ...serving.batch_decode import BatchDecode

    return BatchDecode(device=device, **options)


@dataclass
class GroupStep:
    """What one layer group planned for the current step, and the tensors it planned from."""

    sources: tuple  # (cu_seq_lens_q, cu_seq_lens_k, read_index, write_index): compared with `is`
    form: tuple  # (scaling, qo_heads, kv_heads, head_dim, dtypes, query rows): compared with ==
    tables: StepTables
    cu_q: list  # the step's cumulative query lengths, read to the host once, at plan time
    cu_k: list  # and its cumulative key lengths
    key_index: torch.Tensor  # the cache slot of every key position of the step, after the new tokens
    token_rows: torch.Tensor | None  # tables.token_rows on the device
    sinks: torch.Tensor | None = None  # the sinks the backend's kernel points at (each layer re-points it to its own)


class PagedAttention:
    """The attention function to register as "paged|NAME" (see register()).

    backend_factory(device) -> an object with BatchDecode's plan()/run() (default: a BatchDecode;
    ReferenceDecode runs the float32 oracle on any device). max_decode_q_len: most query tokens per
    request the backend serves (at most 16, DecodeSpec's limit); requests with more take the SDPA
    fallback. check_page_ids: passed to BatchDecode.plan; False (default) trusts transformers'
    allocator for the block ids and skips a read-back per step. cuda_graphs: serve every step on
    the GPU alone (capturable: ContinuousBatchingConfig(use_cuda_graph=True)); max_decode_q_len is
    then the size of the pieces prefill chunks are cut into, and backend_factory(device, **graph
    keywords) must make a BatchDecode-like CUDA-graph decoder. Sliding-window layers are refused
    in this mode.
    """

    def __init__(self, backend_factory: Callable | None = None, *, max_decode_q_len: int = MAX_Q_LEN,
                 check_page_ids: bool = False, cuda_graphs: bool = False):
        if not isinstance(max_decode_q_len, int) or not 1 <= max_decode_q_len <= MAX_Q_LEN:
            raise ValueError(f"max_decode_q_len: expected an int in 1..{MAX_Q_LEN}, got {max_decode_q_len!r}")
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs: expected True or False, got {cuda_graphs!r}")
        if backend_factory is None:  # at register(), before any model runs
            validation.require_cuda(torch, torch.device("cuda"), "flashjit's paged attention",
                                    "register(backend_factory=ReferenceDecode) serves the float32 reference instead")
        self.cuda_graphs = cuda_graphs
        self._graph_decoders: dict = {}  # (layer group, query rows, requests) -> GraphDecoder
        self._backend_factory = backend_factory or flashjit_backend
        self.max_decode_q_len = max_decode_q_len
        self.check_page_ids = check_page_ids
        self._backends: dict = {}  # (id(cache), layer group) -> backend: one plan per group per step
        self._steps: dict = {}  # (id(cache), layer group) -> GroupStep
        # The PagedAttentionCache those belong to, held weakly: a finished manager's cache (most of
        # the GPU's memory) is freed with the manager, not kept by the registered function.
        self._cache_of = lambda: None
        self.plans = 0  # steps planned (all groups), for tests and logs
        self._sinks: dict = {}  # layer -> (weak parameter, its version, float32 copy the kernels read)
        self._raised: dict | None = None  # inside collect_errors(): message -> the first exception raised with it

    @contextlib.contextmanager
    def collect_errors(self):
        """Within the block, the exceptions this function raises are also kept, the first of each message
        ({str(error): error}). transformers' generation thread catches them, logs them and fails the
        requests with their message; register()'s generate_batch raises them again from this record."""
        outer, self._raised = self._raised, {}
        try:
            yield self._raised
        finally:
            self._raised = outer  # (and nothing is kept past the block: a traceback holds the step's cache)

    # transformers' signature; torch.compile leaves it alone (it reads lengths on the host)
    @torch.compiler.disable
    def __call__(self, module, query, key, value, attention_mask=None, dropout: float = 0.0,
                 scaling: float | None = None, **kwargs):
        try:
            return self._attend(module, query, key, value, dropout, scaling, kwargs)
        except Exception as error:
            if self._raised is not None:
                self._raised.setdefault(str(error), error)
            raise

    def _attend(self, module, query, key, value, dropout: float, scaling: float | None, kwargs: dict):
        cache = kwargs.get("cache")
        if cache is None:
            raise ValueError("paged attention called without `cache`: it serves transformers' continuous batching "
                             "(model.generate_batch / ContinuousBatchingManager), not a plain forward")
        variant = refuse_unsupported(module, query, key, value, dropout, kwargs)
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing and not self.cuda_graphs:
            raise RuntimeError(
                "this flashjit paged attention plans on the host every step, which a CUDA graph's replay skips: "
                "register it with register(cuda_graphs=True) to serve transformers' graphs (the page table is "
                "then computed on the GPU), or use ContinuousBatchingConfig(use_cuda_graph=False)")
        layer = module.layer_idx
        where = layer_cache(cache, layer)
        group, ring = where.group, where.ring
        asked = kwargs.get("sliding_window")
        if asked is not None and asked != ring:
            raise ValueError(f"layer {layer}: the module asks for sliding_window={asked}, its cache group keeps "
                             f"{'a window of ' + str(ring) if ring else 'full attention'}")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5

        if kwargs.get("block_table") is not None:
            raise UnsupportedAttention(layer, "transformers' decode fast path (block_table)", "block_table")
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = cu_k[where.layer_type]
        read_index, write_index = kwargs["read_index"][group], kwargs["write_index"][group]
        k_cache, v_cache = where.keys, where.values
        new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
        q_all = query[0].transpose(0, 1)  # [T, Hq, D]
        sinks = None if variant.sinks is None else self._float_sinks(layer, variant.sinks, q_all.device, capturing)
        if self.cuda_graphs:
            if ring:
                raise UnsupportedAttention(layer, "sliding-window layers in CUDA graphs (cuda_graphs=True)", ring)
            return self._graph_step(cache, where, cu_q, cu_k, read_index, write_index, q_all, new_k, new_v, scaling,
                                    capturing, variant.softcap, sinks), None

        step = self._step(cache, where, (cu_q, cu_k, read_index, write_index),
                          (scaling, q_all.shape[1], new_k.shape[1], q_all.shape[2], q_all.dtype, k_cache.dtype,
                           q_all.shape[0], variant.softcap, sinks is not None), sinks)
        tables = step.tables
        # A ring may overwrite keys a long request still reads: those are gathered before the write.
        cu_q_host, cu_k_host = step.cu_q, step.cu_k
        long_kv = []
        for r in tables.fallback:
            span = (cu_k_host[r], cu_k_host[r + 1] - cu_k_host[r], cu_q_host[r], cu_q_host[r + 1] - cu_q_host[r])
            long_kv.append((r, gathered.gather_keys(k_cache, step.key_index, new_k, *span),
                            gathered.gather_keys(v_cache, step.key_index, new_v, *span)))
        k_cache.index_copy_(0, write_index, new_k)
        v_cache.index_copy_(0, write_index, new_v)

        pages = where.pages(1 if ring else where.block_size)
        backend = self._backends[(id(cache), group)]
        if tables.served and sinks is not None and step.sinks is not sinks:  # the group planned with another layer's
            backend.point_variant_at("sinks", sinks)
            step.sinks = sinks
        if tables.covers_all_rows and not long_kv:
            return backend.run(q_all.contiguous(), pages), None
        out = q_all.new_zeros(q_all.shape)
        if tables.served:
            if step.token_rows is None:
                backend.run(q_all[:tables.num_tokens].contiguous(), pages, out=out[:tables.num_tokens])
            else:
                out.index_copy_(0, step.token_rows, backend.run(q_all.index_select(0, step.token_rows), pages))
        for r, k, v in long_kv:
            rows = slice(cu_q_host[r], cu_q_host[r + 1])
            out[rows] = gathered.attend(q_all[rows], k, v, scaling, ring, variant.softcap, sinks)
        return out, None

    def _float_sinks(self, layer: int, sinks: torch.Tensor, device, capturing: bool) -> torch.Tensor:
        """The layer's sinks as the kernels read them (float32, contiguous, on the queries' device),
        converted once and kept while the parameter is unchanged (a capture reuses the eager copy)."""
        known = self._sinks.get(layer)
        if known is not None and known[0]() is sinks and known[1] == sinks._version:
            return known[2]
        if capturing:
            raise RuntimeError(f"layer {layer}: a CUDA-graph capture of sinks this attention has not converted "
                               "eagerly (transformers runs each step size eagerly before capturing it)")
        converted = sinks.detach().to(device=device, dtype=torch.float32).contiguous()
        self._sinks[layer] = (weakref.ref(sinks), sinks._version, converted)
        return converted

    # ---- CUDA-graph steps -------------------------------------------------------------------

    def _graph_step(self, cache, where, cu_q, cu_k, read_index, write_index, q_all, new_k, new_v, scaling, capturing,
                    softcap, sinks):
        """One layer of a step served on the GPU alone: the group's first layer writes the page table
        and queues the planner, every layer writes its new K/V and runs."""
        if self._cache_of() is not cache:
            self._graph_decoders.clear()
            self._cache_of = weakref.ref(cache)
        rows, requests = q_all.shape[0], cu_q.numel() - 1
        key = (where.group, rows, requests, softcap, sinks is not None)
        k_cache, v_cache, block_size = where.keys, where.values, where.block_size
        decoder = self._graph_decoders.get(key)
        if decoder is None:
            if capturing:  # transformers runs each size eagerly before capturing it: this one it did not
                raise RuntimeError(f"a CUDA-graph capture of a step size ({rows} query rows, {requests} requests) "
                                   "this attention has not run eagerly: its first plan compiles and copies from "
                                   "the host, which a capture cannot hold")
            form = dict(num_qo_heads=q_all.shape[1], num_kv_heads=new_k.shape[1], head_dim=q_all.shape[2],
                        mask="causal", q_dtype=q_all.dtype, kv_dtype=k_cache.dtype, sm_scale=float(scaling),
                        logits_soft_cap=softcap, sinks=sinks)
            decoder = self._graph_decoders[key] = GraphDecoder(
                self._backend_factory, k_cache.device, rows=rows, requests=requests, piece=self.max_decode_q_len,
                cache_blocks=k_cache.shape[0] // block_size, page_size=block_size, plan_form=form)
        if where.first_in_group:
            decoder.prepare(cu_q, cu_k, read_index if read_index.numel() else write_index)
            self.plans += 1
        k_cache.index_copy_(0, write_index, new_k)
        v_cache.index_copy_(0, write_index, new_v)
        if sinks is not None:  # each layer's own: the captured launch keeps the pointer of its layer
            decoder.decoder.point_variant_at("sinks", sinks)
        return decoder.run(q_all.contiguous(), where.pages(block_size), out=q_all.new_zeros(q_all.shape))

    # ---- planning ---------------------------------------------------------------------------

    def _step(self, cache, where: LayerCache, sources: tuple, form: tuple, sinks) -> GroupStep:
        """The group's plan for this step: made by its first layer, or by any layer that sees other tensors."""
        if self._cache_of() is not cache:  # a new manager: its groups and pages are new
            self._backends.clear()
            self._steps.clear()
            self._cache_of = weakref.ref(cache)
        key = (id(cache), where.group)
        known = self._steps.get(key)
        if (not where.first_in_group and known is not None and known.form == form
                and all(a is b for a, b in zip(known.sources, sources))):
            return known
        step = self._plan(where, key, sources, form, sinks)
        self._steps[key] = step
        return step

    def _plan(self, where: LayerCache, key, sources, form, sinks) -> GroupStep:
        cu_q, cu_k, read_index, write_index = sources
        scaling, qo_heads, kv_heads, head_dim, q_dtype, kv_dtype, query_rows, softcap, _ = form
        lengths = torch.cat((cu_q.reshape(-1), cu_k.reshape(-1))).tolist()  # the step's one wait for the GPU
        half = cu_q.numel()
        cu_q_host, cu_k_host = lengths[:half], lengths[half:]
        ring, device = where.ring, where.keys.device
        page_size = 1 if ring else where.block_size
        key_index = key_positions(read_index, write_index, ring, where.sentinel)
        tables = step_tables(cu_q_host, cu_k_host, page_size, self.max_decode_q_len, query_rows, ring)
        backend = self._backends.get(key)
        if backend is None:
            backend = self._backends[key] = self._backend_factory(device)
        if tables.served:
            mask = dict(mask="sliding_window", window_left=ring - 1) if ring else dict(mask="causal")
            if softcap is not None or sinks is not None:  # (keywords a backend without variants never sees)
                mask.update(logits_soft_cap=softcap, sinks=sinks)
            backend.plan(tables.indptr, page_ids(key_index, tables, page_size), tables.last_page_len, qo_heads,
                         kv_heads, head_dim, page_size, qo_indptr=tables.qo_indptr, q_dtype=q_dtype, kv_dtype=kv_dtype,
                         sm_scale=float(scaling), check_page_ids=self.check_page_ids, **mask)
        self.plans += 1
        rows = None if tables.token_rows is None else tables.token_rows.to(device, non_blocking=True)
        return GroupStep(sources=sources, form=form, tables=tables, cu_q=cu_q_host, cu_k=cu_k_host,
                         key_index=key_index, token_rows=rows, sinks=sinks)


def key_positions(read_index: torch.Tensor, write_index: torch.Tensor, ring: int | None, sentinel: int) -> torch.Tensor:
    """The cache slot of every key position of the step, as it will be once the new tokens are written.

    Full attention: transformers' read index lists each request's sequence, new tokens included.
    A ring marks each new token's place with the cache's sentinel slot; the token's write slot takes
    it (the sentinels come in token order, one per query token, as the write slots do). A step
    without cached keys has an empty read index: every key is a new token, at its write slot.
    """
    if read_index.numel() == 0:
        return write_index
    if ring is None:
        return read_index
    return read_index.masked_scatter(read_index == sentinel, write_index)
