"""FormDecoders: the BatchDecodes that serve one DecodeForm's layers, planned once a step.

Eager steps plan one decoder (share_prefixes=None: plan() finds shared leading blocks). A step
that a framework replays in a CUDA graph uses a graph decoder sized for it: graphs capture fixed
grids, so a small graph should not launch the largest one's, yet a decoder per captured size would
hold dozens of plan buffers. Graph decoders come in powers of two of query tokens (a step of 24
uses the one of 32), each made and planned once, before the first capture it serves. Graph
decoders read their page ids from one buffer the step owner writes in place, and either plan on
the host with the shared-prefix kernel (forms that share, with the host's lengths) or keep
flashjit's GPU planner (replan(): the lengths stay on the device).
"""

from __future__ import annotations

import torch

from ...jit.engine import default_engine
from ...serving.batch_decode import BatchDecode
from .forms import DecodeForm
from .page_tables import DevicePageTable, HostPageTable
from .rows import check_decode_q_len


def graph_capacity(tokens: int) -> int:
    """The query tokens of the graph decoder that serves graphs of `tokens`: the next power of two."""
    return 1 << max(tokens - 1, 0).bit_length()


def graph_decoder_of(decoders, decoder_type, tokens: int, **plan_kwargs):
    """The graph decoder (decoder_type: BatchDecode, BatchDecodeMLA) of decoders (FormDecoders,
    MLADecoders) for graphs of `tokens` padded query tokens: the one of the next power of two, made on
    first use and planned with plan_kwargs for one request of one key on the page-id buffer's first
    page, which fixes its kernel and buffers before a framework captures that size."""
    tokens = graph_capacity(tokens)
    decoder = decoders.graphs.get(tokens)
    if decoder is None:
        if decoders.page_ids_buffer is None:
            raise RuntimeError(f"{type(decoders).__name__}(page_ids_buffer=...) is needed for CUDA-graph decoders")
        decoder = decoder_type(decoders.engine, decoders.device, use_cuda_graph=True, max_batch_size=tokens,
                               max_tokens=tokens, max_q_len=decoders.max_decode_q_len,
                               page_ids_buffer=decoders.page_ids_buffer, **decoders._options)
        int32 = dict(dtype=torch.int32)
        decoder.plan(torch.tensor([0, 1], **int32), decoders.page_ids_buffer, torch.tensor([1], **int32),
                     qo_indptr=torch.tensor([0, 1], **int32), **plan_kwargs)
        decoders.graphs[tokens] = decoder
    return decoder


class FormDecoders:
    """Decoders of one form on one device. share_prefixes: read shared leading blocks once, in
    eager steps and in graphs (plans then wait once for the page ids to reach the host).
    decoder_options: BatchDecode's test keywords (arch, load_kernel, host_planner, ...)."""

    def __init__(self, form: DecodeForm, device, *, max_decode_q_len: int, engine=None, share_prefixes: bool = True,
                 page_ids_buffer: torch.Tensor | None = None, **decoder_options):
        self.form = form
        self.device = torch.device(device)
        self.max_decode_q_len = check_decode_q_len(max_decode_q_len)
        self.engine = engine or default_engine()
        self.share_prefixes = bool(share_prefixes)
        self.page_ids_buffer = page_ids_buffer
        self._options = decoder_options
        self.eager = BatchDecode(self.engine, self.device, **decoder_options)
        self.graphs: dict[int, BatchDecode] = {}
        # The layers' sinks pass through this buffer: a plan holds one tensor, each layer copies its own in.
        self.sinks = (torch.zeros(form.num_qo_heads, dtype=torch.float32, device=self.device)
                      if form.has_sinks else None)

    # ---- kernels ----------------------------------------------------------------------------

    def prewarm(self, arch: str, jobs: int | None = None):
        """Compile (or load) every kernel this form's plans may pick; with FLASHJIT_NO_COMPILE=1 a
        kernel missing from the cache raises KernelNotPrewarmed naming it and its prewarm command."""
        return self.engine.prewarm(self.form.specs(arch, self.max_decode_q_len, self.share_prefixes), jobs=jobs)

    # ---- plans ------------------------------------------------------------------------------

    @property
    def graph_shares(self) -> bool:
        return self.share_prefixes and self.form.may_share_prefixes

    def plan_eager(self, table: HostPageTable) -> BatchDecode:
        """Plan the eager decoder for a step's decode rows."""
        # Detection reads the page ids on the host (one wait); a form that cannot share waits for nothing.
        shares = self.share_prefixes and self.form.may_share_prefixes
        self.eager.plan(table.indptr, table.indices, table.last_page_len, qo_indptr=table.qo_indptr,
                        share_prefixes=None if shares else False, check_page_ids=shares,
                        **self.form.plan_kwargs(self.sinks))
        return self.eager

    def graph_decoder(self, tokens: int) -> BatchDecode:
        """The decoder of graphs of `tokens` padded query tokens: the one of the next power of two
        (made and planned on first use, which a framework makes before it captures that size)."""
        return graph_decoder_of(self, BatchDecode, tokens, check_page_ids=self.graph_shares,
                                share_prefixes=True if self.graph_shares else None, **self.form.plan_kwargs(self.sinks))

    def plans_on_device(self, tokens: int) -> bool:
        """Whether the graph decoder of that size plans on the GPU (no host lengths needed)."""
        return self.graph_decoder(tokens).graph_page_table is not None

    def plan_graph(self, tokens: int, table: HostPageTable) -> BatchDecode:
        """Plan the graph decoder of that size on the host; table.indices is the shared page-id buffer."""
        decoder = self.graph_decoder(tokens)
        decoder.plan(table.indptr, table.indices, table.last_page_len, qo_indptr=table.qo_indptr,
                     check_page_ids=self.graph_shares, share_prefixes=True if self.graph_shares else None,
                     **self.form.plan_kwargs(self.sinks))
        return decoder

    def plan_graph_on_device(self, tokens: int, table: DevicePageTable) -> BatchDecode:
        """Re-plan the graph decoder of that size from a page table on the device: its GPU planner
        runs on the current stream, nothing is read back. The page ids must be in the shared buffer."""
        decoder = self.graph_decoder(tokens)
        page_table = decoder.graph_page_table
        if page_table is None:
            raise RuntimeError("this form's graph decoders plan on the host (shared-prefix kernel): give host lengths")
        rows = table.indptr.numel() - 1
        if rows > graph_capacity(tokens):
            raise ValueError(f"a graph step of {tokens} tokens holds at most {graph_capacity(tokens)} requests, "
                             f"got {rows}")
        page_table.batch.copy_(table.batch)
        page_table.indptr[: rows + 1].copy_(table.indptr)
        page_table.last_page_len[:rows].copy_(table.last_page_len)
        page_table.qo_indptr[: rows + 1].copy_(table.qo_indptr)
        decoder.replan()
        return decoder
