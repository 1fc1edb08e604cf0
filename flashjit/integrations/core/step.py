"""StepPlanner: a framework's step metadata turned into the plans every layer of a KV-cache group
reads (StepPlan): which rows the decode kernels serve, one planned decoder per DecodeForm, and
the prefill rows another kernel takes.

The inputs are what vLLM's CommonAttentionMetadata carries, framework-free: query_start_loc (on
the device and the host), seq_lens (device; on the host where the framework knows them exactly),
the block table and the step's token count. A step the framework replays in a CUDA graph
(graph_tokens: its padded size) plans that size's graph decoders; every other step plans the
eager ones.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from .decoders import FormDecoders
from .forms import DecodeForm
from .page_tables import device_page_table, host_page_table
from .rows import RowSplit, split_rows


@dataclasses.dataclass(frozen=True)
class PrefillRows:
    """Rows [first_row, first_row + num_rows) of the step, query tokens [token_begin, token_end):
    their offsets (cu_seqlens_q, from 0, on the device and the host), key counts (seqused_k on the
    device) and block-table rows, as a varlen FlashAttention call takes them."""

    first_row: int
    token_begin: int
    token_end: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_cpu: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_rows(self) -> int:
        return self.cu_seqlens_q_cpu.numel() - 1


@dataclasses.dataclass
class StepPlan:
    """What a step's layers read: the row split, each form's planned decoder and its sinks buffer,
    the prefill rows (None without any) and, for a graph step, its padded token count."""

    rows: RowSplit
    decoders: dict
    sinks: dict
    prefill: PrefillRows | None
    num_actual_tokens: int
    graph_tokens: int | None = None

    @property
    def decode_tokens(self) -> int:
        """Query rows handed to the decode kernels: a graph's whole padded size (rows past the plan's
        tokens are left alone), else the decode rows' tokens."""
        return self.graph_tokens if self.graph_tokens is not None else self.rows.num_decode_tokens


class StepPlanner:
    """Plans the steps of one KV-cache group for its layers' forms.

    max_graph_tokens and max_pages: the largest CUDA-graph step (padded query tokens) and the most
    page ids one step lists (requests x blocks a request); 0 for no graphs. decoder_options:
    FormDecoders' (engine, share_prefixes, BatchDecode's test keywords)."""

    def __init__(self, forms, device, *, block_size: int, max_decode_q_len: int, max_graph_tokens: int = 0,
                 max_pages: int = 0, **decoder_options):
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_decode_q_len = max_decode_q_len
        self.max_graph_tokens = max_graph_tokens
        self.page_ids = (torch.zeros(max_pages, dtype=torch.int32, device=self.device)
                         if max_graph_tokens and max_pages else None)
        self.forms: dict[DecodeForm, FormDecoders] = {}
        for form in dict.fromkeys(forms):
            self.forms[form] = FormDecoders(form, self.device, max_decode_q_len=max_decode_q_len,
                                            page_ids_buffer=self.page_ids, **decoder_options)

    def prewarm(self, arch: str, jobs: int | None = None) -> list:
        return [result for decoders in self.forms.values() for result in decoders.prewarm(arch, jobs)]

    def uses_graph(self, rows: RowSplit, num_actual_tokens: int) -> bool:
        """Whether a step of this split and size runs on the graph decoders: decode rows only, within
        the largest graph. A framework replays graphs for such steps only."""
        return bool(self.page_ids is not None and rows.pure_decode and rows.num_decodes
                    and num_actual_tokens <= self.max_graph_tokens)

    def plan(self, *, query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor, num_reqs: int, num_actual_tokens: int, max_seq_len: int,
             seq_lens_cpu=None, read_seq_lens: Callable[[], object] | None = None,
             graph: bool | None = None, graph_tokens_for: Callable[[int], int] | None = None) -> StepPlan:
        """The step's plans. seq_lens_cpu: the exact key counts on the host, or None when only the
        device has them; then graph steps whose decoders plan on the GPU read nothing back and other
        steps call read_seq_lens() (default: copy seq_lens to the host, which waits for the stream).
        graph: plan the graph decoders (default: uses_graph()) of graph_tokens_for(num_actual_tokens)
        padded tokens (default num_actual_tokens: the framework pads a graph step to its captured size)."""
        rows = split_rows(query_start_loc_cpu, num_reqs, self.max_decode_q_len)
        if graph is None:
            graph = self.uses_graph(rows, num_actual_tokens)
        tokens = None
        if graph:
            tokens = num_actual_tokens if graph_tokens_for is None else graph_tokens_for(num_actual_tokens)
            if not num_actual_tokens <= tokens <= self.max_graph_tokens:
                raise ValueError(f"a graph step of {num_actual_tokens} tokens padded to {tokens}: expected a size "
                                 f"in {num_actual_tokens}..{self.max_graph_tokens} (max_graph_tokens)")
        decoders = {}
        host_lens = seq_lens_cpu

        def exact_lengths():
            nonlocal host_lens
            if host_lens is None:
                host_lens = read_seq_lens() if read_seq_lens is not None else seq_lens.cpu()
            return host_lens

        if rows.num_decodes:
            n = rows.num_decodes
            if graph and seq_lens_cpu is None and all(d.plans_on_device(tokens) for d in self.forms.values()):
                table = device_page_table(block_table, seq_lens, query_start_loc, n, self.block_size,
                                          self.max_decode_q_len)
                self.page_ids[: table.page_ids.numel()].copy_(table.page_ids)
                for form, d in self.forms.items():
                    decoders[form] = d.plan_graph_on_device(tokens, table)
            else:
                table = host_page_table(block_table, exact_lengths(), query_start_loc_cpu, n, self.block_size,
                                        out_indices=self.page_ids if graph else None)
                for form, d in self.forms.items():
                    decoders[form] = d.plan_graph(tokens, table) if graph else d.plan_eager(table)
        prefill = None
        if rows.num_prefills:
            prefill = prefill_rows(rows, query_start_loc, query_start_loc_cpu, seq_lens, block_table, num_reqs,
                                   max_seq_len, seq_lens_cpu)
        sinks = {form: d.sinks for form, d in self.forms.items()}
        return StepPlan(rows, decoders, sinks, prefill, num_actual_tokens, tokens)


def prefill_rows(rows: RowSplit, query_start_loc, query_start_loc_cpu, seq_lens, block_table, num_reqs: int,
                 max_seq_len: int, seq_lens_cpu=None) -> PrefillRows:
    """The PrefillRows of a step's rows from rows.num_decodes on (no value is read from the device)."""
    d = rows.num_decodes
    offsets = np.asarray(query_start_loc_cpu[d: num_reqs + 1], dtype=np.int64)
    cu_cpu = torch.from_numpy((offsets - offsets[0]).astype(np.int32))
    cu = (query_start_loc[d: num_reqs + 1] - query_start_loc[d: d + 1]).to(torch.int32)
    max_q = int(np.max(offsets[1:] - offsets[:-1]))
    # A prefill row's key count is exact on the host wherever the framework gives one.
    max_k = int(np.max(np.asarray(seq_lens_cpu[d:num_reqs]))) if seq_lens_cpu is not None else int(max_seq_len)
    return PrefillRows(d, int(offsets[0]), int(offsets[-1]), cu, cu_cpu, seq_lens[d:num_reqs],
                       block_table[d:num_reqs], max_q, max_k)
