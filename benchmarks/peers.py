"""The implementations a row times, each as a server would call it: flashjit (BatchDecode, eager
and in CUDA-graph mode), cuDNN through torch SDPA, FlashInfer's paged decode wrapper (CUDA-core and
tensor-core paths, eager and in its CUDA-graph mode) and FlashAttention-3's paged
flash_attn_with_kvcache when `flash_attn_interface` imports, its scheduler metadata precomputed per
step as vLLM does (PLAN_COSTS says how every implementation pays for planning).

Each is an Impl: an eager Step and, where it can be captured, a factory of the Step a graph
captures (a graph-mode decoder planned before the capture; a later plan() and then replays, as a
server's step does). A Step's call() returns its output [tokens, qo_heads, head_dim] and keeps alive
everything it points into. Optional peers that do not import are left out with a note; any other
difference in a peer's API raises.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

from benchmarks.cases import Case
from benchmarks.inputs import Fp8Cache, mask_of, variant_of

FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_WORKSPACE = 256 * 2**20
# The split cap a server passes FA3 in CUDA-graph decode: vLLM's default
# (VLLM_FLASH_ATTN_MAX_NUM_SPLITS_FOR_CUDA_GRAPH); with per-request lengths FA3 splits each request
# on the GPU up to this many.
FA3_SERVER_SPLITS = 32
PEERS = ("sdpa-cudnn", "flashinfer", "flashinfer-tc", "fa3", f"fa3-splits{FA3_SERVER_SPLITS}")
# How the timed calls pay for planning (printed by benchmarks.decode, in its JSON header).
PLAN_COSTS = ("plans outside every timed call, once per step as a server plans: flashjit's plan() (CUDA-graph mode: "
              "its GPU planner queued before each replay, device time reported apart), FlashInfer's plan(), and "
              "FA3's scheduler_metadata from get_scheduler_metadata (as vLLM precomputes it; written into the "
              "captured buffer before each replay)")
FA3_SCHEDULES_INSIDE = ("FA3's flash_attn_interface has no get_scheduler_metadata: its scheduler runs inside every "
                        "timed FA3 call (the other implementations plan outside theirs)")


@dataclasses.dataclass
class Step:
    call: Callable                            # one decode step; returns the output
    before_replay: Callable | None = None     # graph steps: the plan() between capture and replays
    info: Callable | None = None              # what the step planned: {"splits": ..., "work_items": ...}


@dataclasses.dataclass
class Impl:
    eager: Step
    graph: Callable | None = None  # () -> the Step a CUDA graph captures; None: not capturable


def optional_module(name: str):
    """(module, None), or (None, why) when it does not import."""
    import importlib

    try:
        return importlib.import_module(name), None
    except ImportError as exc:
        return None, f"{name} not importable ({type(exc).__name__}: {exc})"


# ---- flashjit ---------------------------------------------------------------------------------

def plan_arguments(batch, case: Case, tensor_cores=None) -> tuple[tuple, dict]:
    mask, params = mask_of(case, batch)
    args = (batch.indptr, batch.indices, batch.last_page_len, case.heads_qo, case.heads_kv, case.head_dim,
            case.page_size)
    return args, {"mask": mask, "mask_params": params or None, "tensor_cores": tensor_cores,
                  "kv_dtype": case.kv_dtype, "kv_layout": case.kv_layout, **variant_of(case, batch)}


def _cache_and_scales(batch, fp8: Fp8Cache | None):
    return (fp8.cache, fp8.scales) if fp8 else ((batch.k_cache, batch.v_cache), (None, None))


def _work_info(decoder) -> dict:
    work = decoder.work
    return {"splits": int(work.max_splits), "work_items": int(work.num_work), "chunk": int(work.chunk_tokens)}


def flashjit_impl(torch, batch, case: Case, engine, fp8: Fp8Cache | None, tensor_cores=None, split=None):
    """(run, out, decoder): an eager BatchDecode planned for the row (split: plan()'s split options,
    chunk_tokens or disable_split_kv, where given); run() decodes into out."""
    import flashjit

    decoder = flashjit.BatchDecode(engine)
    args, options = plan_arguments(batch, case, tensor_cores)
    options.update(split or {})
    decoder.plan(*args, **options)
    out = torch.empty_like(batch.q)
    cache, (k_scale, v_scale) = _cache_and_scales(batch, fp8)
    return lambda: decoder.run(batch.q, cache, out=out, k_scale=k_scale, v_scale=v_scale), out, decoder


def flashjit_graph_step(torch, batch, case: Case, engine, fp8: Fp8Cache | None, tensor_cores=None,
                        split=None) -> Step:
    """A graph-mode BatchDecode sized for the row (max_batch_size: its requests, max_num_pages: its
    page ids), planned before the capture and again before the replays, as FlashInfer's graph
    wrapper is: plan() queues the GPU planner outside the replay (its device time is reported apart).
    split: as flashjit_impl's."""
    import flashjit

    decoder = flashjit.BatchDecode(engine, use_cuda_graph=True, max_batch_size=case.batch,
                                   max_num_pages=max(1, int(batch.indices.numel())))
    args, options = plan_arguments(batch, case, tensor_cores)
    options.update(split or {})
    decoder.plan(*args, **options)
    out = torch.empty_like(batch.q)
    cache, (k_scale, v_scale) = _cache_and_scales(batch, fp8)
    return Step(lambda: decoder.run(batch.q, cache, out=out, k_scale=k_scale, v_scale=v_scale), before_replay=lambda: decoder.plan(*args, **options), info=lambda: _work_info(decoder))


def flashjit_eager_and_graph(torch, batch, case, engine, fp8, tensor_cores=None, split=None) -> Impl:
    run, _, decoder = flashjit_impl(torch, batch, case, engine, fp8, tensor_cores, split)
    return Impl(Step(run, info=lambda: _work_info(decoder)),
                lambda: flashjit_graph_step(torch, batch, case, engine, fp8, tensor_cores, split))


# ---- cuDNN SDPA -------------------------------------------------------------------------------

def sdpa_skip(case: Case, kv_lens) -> str | None:
    if case.variant:
        return f"cuDNN SDPA takes no {case.variant} variant: variant rows leave it out"
    if len(set(kv_lens)) != 1:
        return "cuDNN SDPA runs on rows of one length only (a padded mixed batch needs a mask it does not take)"
    if case.kv_dtype:
        return "cuDNN SDPA takes no fp8 KV: fp8 rows compare with FlashInfer only"
    return None


def dense_kv(torch, batch, case: Case):
    """(k, v) [requests, kv_heads, keys, head_dim]: the keys each request attends (for a window, its
    sinks and the window), gathered from the pages into one dense tensor. Rows of one length only."""
    from flashjit.serving.reference import gather_request_kv

    length = batch.kv_lens[0]
    start = max(0, length - 1 - case.window) if case.window else 0
    keys = list(range(min(case.sinks or 0, start))) + list(range(start, length))
    ks, vs = [], []
    for b in range(case.batch):
        ids = batch.indices[int(batch.indptr[b]):int(batch.indptr[b + 1])]
        ks.append(gather_request_kv(batch.k_cache, ids, length, case.kv_layout)[keys].transpose(0, 1))
        vs.append(gather_request_kv(batch.v_cache, ids, length, case.kv_layout)[keys].transpose(0, 1))
    return torch.stack(ks), torch.stack(vs)


def sdpa(torch, batch, case: Case, backend=None, live_q: bool = False) -> Impl:
    """cuDNN attention (backend: another SDPBackend) on a dense copy of the KV: not paged, an advantage
    it has. q is copied into SDPA's layout once, or with live_q read from batch.q by every call (a
    layer's q, which its projection rewrites each step)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if backend is None else backend
    k, v = dense_kv(torch, batch, case)
    fixed_q = None if live_q else batch.q[:, :, None, :].contiguous()

    def call():
        q = batch.q[:, :, None, :] if live_q else fixed_q
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0, :]

    step = Step(call)
    return Impl(step, lambda: step)


# ---- FlashInfer -------------------------------------------------------------------------------

def flashinfer_skip(case: Case) -> str | None:
    if case.variant and "sinks" in case.variant:
        return "FlashInfer's decode wrapper takes no learned sinks: sinks rows leave it out"
    if case.sinks is not None:
        return "FlashInfer's decode wrapper has no sinks + window mask (sink rows compare with SDPA only)"
    if case.head_dim not in FLASHINFER_HEAD_DIMS:
        return f"FlashInfer is left out at head_dim {case.head_dim}: its decode crashes there"
    return None


def flashinfer_step(torch, flashinfer, batch, case: Case, fp8: Fp8Cache | None, tensor_cores: bool,
                    graph: bool) -> Step:
    """BatchDecodeWithPagedKVCacheWrapper; in its CUDA-graph mode over fixed page-table buffers
    sized for the row, planned before the capture and again before the replays."""
    device = batch.q.device
    indptr, last = batch.indptr.to(device), batch.last_page_len.to(device)
    buffers = {}
    if graph:
        buffers = {"paged_kv_indptr_buffer": torch.empty_like(indptr),
                   "paged_kv_indices_buffer": torch.empty(max(1, batch.indices.numel()), dtype=torch.int32,
                                                          device=device),
                   "paged_kv_last_page_len_buffer": torch.empty_like(last)}
    workspace = torch.zeros(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, case.kv_layout, use_cuda_graph=graph,
                                                             use_tensor_cores=tensor_cores, **buffers)

    def plan():
        wrapper.plan(indptr, batch.indices, last, case.heads_qo, case.heads_kv, case.head_dim, case.page_size,
                     q_data_type=torch.bfloat16, kv_data_type=getattr(torch, case.kv_dtype) if fp8 else torch.bfloat16,
                     window_left=case.window if case.window else -1,
                     **({"logits_soft_cap": case.logits_soft_cap} if case.variant == "soft_cap" else {}))

    plan()
    out = torch.empty_like(batch.q)
    cache = fp8.cache if fp8 else (batch.k_cache, batch.v_cache)
    scales = {"k_scale": fp8.scales[0], "v_scale": fp8.scales[1]} if fp8 else {}
    return Step(lambda: wrapper.run(batch.q, cache, out=out, **scales), before_replay=plan if graph else None)


def flashinfer_impl(torch, flashinfer, batch, case, fp8, tensor_cores: bool) -> Impl:
    return Impl(flashinfer_step(torch, flashinfer, batch, case, fp8, tensor_cores, graph=False),
                lambda: flashinfer_step(torch, flashinfer, batch, case, fp8, tensor_cores, graph=True))


# ---- FlashAttention-3 -------------------------------------------------------------------------

def fa3_skip(case: Case) -> str | None:
    if case.variant and "sinks" in case.variant:
        return "FA3's paged decode takes no learned sinks here: sinks rows leave it out"
    if case.head_dim > 256:
        return f"FA3 supports head_dim up to 256: the d{case.head_dim} rows leave it out"
    if case.kv_dtype:
        return "FA3 takes an fp8 cache only with fp8 queries: fp8 rows leave it out"
    if case.kv_layout != "NHD":
        return "FA3's paged cache is NHD only: HND rows leave it out"
    if case.sinks is not None:
        return "FA3 has no StreamingLLM sink tokens (its sinks are learned logits): sink rows leave it out"
    return None


def fa3_variants(fa3) -> dict:
    """name -> num_splits keyword (None: none passed): its own heuristic, and a server's cap where it takes one."""
    if "num_splits" not in inspect.signature(fa3.flash_attn_with_kvcache).parameters:
        return {"fa3": None}
    return {"fa3": 0, f"fa3-splits{FA3_SERVER_SPLITS}": FA3_SERVER_SPLITS}


def page_table(torch, indptr, indices):
    """[requests, most pages] int32 on the ids' device: each request's page ids, then 0s (a valid page FA3 never reads)."""
    pages = (indptr[1:] - indptr[:-1]).tolist()
    table = torch.zeros(len(pages), max(pages + [1]), dtype=torch.int32, device=indices.device)
    for b, n in enumerate(pages):
        start = int(indptr[b])
        table[b, :n] = indices[start:start + n]
    return table


def fa3_scheduler(fa3, num_splits: int | None):
    """FA3's get_scheduler_metadata where it has one and the call takes num_splits (they must agree),
    else None: FA3 then schedules inside every call."""
    scheduler = getattr(fa3, "get_scheduler_metadata", None)
    return scheduler if num_splits is not None else None


def fa3_step(torch, fa3, batch, case: Case, num_splits: int | None) -> Step:
    """flash_attn_with_kvcache over the row's page table. Its scheduler metadata is computed before
    the call, once per step as vLLM does, not inside the timed call; before_replay computes the
    step's again into the buffer a captured graph reads."""
    q = batch.q.view(case.batch, 1, case.heads_qo, case.head_dim)
    table = page_table(torch, batch.indptr, batch.indices)
    seqlens = torch.tensor(batch.kv_lens, dtype=torch.int32, device=q.device)
    options = {} if num_splits is None else {"num_splits": num_splits}
    if case.window:
        options["window_size"] = (case.window, 0)
    if case.variant == "soft_cap":
        options["softcap"] = case.logits_soft_cap
    scheduler = fa3_scheduler(fa3, num_splits)
    metadata = {}

    def schedule():
        fresh = scheduler(case.batch, 1, max(batch.kv_lens), case.heads_qo, case.heads_kv, case.head_dim, seqlens,
                          qkv_dtype=batch.q.dtype, page_size=case.page_size, causal=True,
                          window_size=options.get("window_size", (-1, -1)), has_softcap=case.variant == "soft_cap",
                          num_splits=num_splits)
        if "buffer" in metadata:
            metadata["buffer"].copy_(fresh)
        else:
            metadata["buffer"] = fresh

    if scheduler is not None:
        schedule()

    def call():
        out = fa3.flash_attn_with_kvcache(q, batch.k_cache, batch.v_cache, cache_seqlens=seqlens, page_table=table,
                                          softmax_scale=case.head_dim ** -0.5, causal=True,
                                          **({"scheduler_metadata": metadata["buffer"]} if metadata else {}), **options)
        return out[:, 0]

    return Step(call, before_replay=schedule if scheduler is not None else None)


def fa3_impl(torch, fa3, batch, case, num_splits) -> Impl:
    step = fa3_step(torch, fa3, batch, case, num_splits)
    return Impl(step, lambda: step)


# ---- a row's candidates -----------------------------------------------------------------------

def candidates(torch, batch, case: Case, engine, fp8: Fp8Cache | None, cuda_cores: bool = False,
               live_q: bool = False):
    """({name: () -> Impl}, notes): the implementations to time on this row, built when called
    (so that one that fails to build is reported under its own name), and why others are left out.
    live_q: every call reads batch.q as it is then (the others do already; see sdpa)."""
    found = {"flashjit": lambda: flashjit_eager_and_graph(torch, batch, case, engine, fp8)}
    if cuda_cores:
        found["flashjit-cc"] = lambda: flashjit_eager_and_graph(torch, batch, case, engine, fp8, tensor_cores=False)
    notes = []
    skip = sdpa_skip(case, batch.kv_lens)
    if skip:
        notes.append(skip)
    else:
        found["sdpa-cudnn"] = lambda: sdpa(torch, batch, case, live_q=live_q)
    flashinfer_module, absent = optional_module("flashinfer")
    skip = absent or flashinfer_skip(case)
    if skip:
        notes.append(skip)
    else:
        for name, tc in (("flashinfer", False), ("flashinfer-tc", True)):
            found[name] = lambda tc=tc: flashinfer_impl(torch, flashinfer_module, batch, case, fp8, tc)
    fa3_module, absent = optional_module("flash_attn_interface")
    skip = absent or fa3_skip(case)
    if skip:
        notes.append(skip)
    else:
        variants = fa3_variants(fa3_module)
        if len(variants) == 1:
            notes.append("FA3's flash_attn_with_kvcache takes no num_splits: only its default split is timed")
        if fa3_scheduler(fa3_module, next(iter(variants.values()))) is None:
            notes.append(FA3_SCHEDULES_INSIDE)
        for name, splits in variants.items():
            found[name] = lambda splits=splits: fa3_impl(torch, fa3_module, batch, case, splits)
    return found, notes
