"""FlashInfer's decode arguments (0.6 and 0.7) in BatchDecode's terms, and the refusals of what flashjit lacks.

Pure functions of the arguments: the wrappers call them before they change anything, so a refused
plan() or run() leaves the previous plan in place. Each refusal of a feature flashjit does not have
is a NotImplementedError naming the argument and its value; a malformed value is a ValueError, as
in the rest of flashjit.
"""

from __future__ import annotations

import numbers

from ... import validation
from ...serving.plan_setup import LOG2E

KV_LAYOUTS = ("NHD", "HND")
# FlashInfer's kernel families; flashjit serves each with its own kernels (and picks tensor cores itself).
BACKENDS = ("auto", "fa2", "fa3")
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
FP8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2")
NO_WINDOW = -1  # FlashInfer's window_left for "every key"


def not_implemented(name: str, value, hint: str):
    raise NotImplementedError(f"flashjit.compat.flashinfer: {name}={value!r} is not implemented: {hint}")


def checked_kv_layout(kv_layout) -> str:
    if kv_layout not in KV_LAYOUTS:
        not_implemented("kv_layout", kv_layout, f"flashjit's paged caches are {' or '.join(KV_LAYOUTS)}")
    return kv_layout


def check_backend(backend, jit_args, jit_kwargs=None) -> None:
    if backend == "trtllm-gen":
        not_implemented("backend", backend, f"its block_tables/seq_lens plan is not served; use one of {BACKENDS}")
    if backend not in BACKENDS:
        validation.fail("backend", f"one of {BACKENDS} (flashjit picks its kernel for each)", repr(backend))
    for name, value in (("jit_args", jit_args), ("jit_kwargs", jit_kwargs)):
        if value is not None:
            not_implemented(name, "<custom kernel>", "register a flashjit mask or variant instead (docs/masks.md)")


def torch_dtype(name: str, value):
    """FlashInfer's dtype argument (a torch dtype or its name) as a torch dtype."""
    import torch

    found = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(found, torch.dtype):
        validation.fail(name, "a torch dtype or its name ('float16', 'bfloat16', 'float8_e4m3fn', ...)", repr(value))
    return found


def plan_dtypes(q_data_type, kv_data_type, data_type, o_data_type=None, kept_output=None) -> tuple:
    """(query dtype, cache dtype, output dtype) as FlashInfer's plan() resolves them: data_type
    fills whichever of the two is None, the cache dtype defaults to the query's, and the output
    dtype to o_data_type, else to kept_output (the earlier plan's, which FlashInfer's run() keeps
    after a fast_decode_plan), else to the query's. e4m3 queries (quantized for an e4m3 cache, as
    vLLM hands them over) need a 16-bit output; 16-bit queries write their own dtype."""
    import torch

    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    q_dtype = torch_dtype("q_data_type", q_data_type)
    kv_dtype = q_dtype if kv_data_type is None else torch_dtype("kv_data_type", kv_data_type)
    out_dtype = kept_output if o_data_type is None else torch_dtype("o_data_type", o_data_type)
    if str(q_dtype).removeprefix("torch.") in FP8_DTYPE_NAMES:
        if q_dtype != torch.float8_e4m3fn or kv_dtype != q_dtype:
            not_implemented("q_data_type", q_dtype, f"fp8 queries are float8_e4m3fn, over a cache of that dtype "
                            f"(kv_data_type is {kv_dtype})")
        if out_dtype not in (torch.float16, torch.bfloat16):
            not_implemented("o_data_type", o_data_type, "e4m3 queries write a 16-bit output: pass "
                            "o_data_type=torch.bfloat16 or torch.float16")
        return q_dtype, kv_dtype, out_dtype
    if o_data_type is not None and out_dtype != q_dtype:
        not_implemented("o_data_type", o_data_type, f"16-bit queries write their own dtype ({q_dtype}); pass None")
    return q_dtype, kv_dtype, q_dtype


def plan_options(*, page_size: int, pos_encoding_mode="NONE", window_left=NO_WINDOW, window_right=0,
                 logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, fixed_split_size=None,
                 disable_split_kv=False, block_tables=None, seq_lens=None, q_len_per_req=1, is_causal=None,
                 use_token_head_sf=False) -> dict:
    """BatchDecode.plan()'s keywords (mask, window_left, q_len, logits_soft_cap, sm_scale, chunk_tokens,
    disable_split_kv) for FlashInfer's plan() arguments."""
    if pos_encoding_mode not in POS_ENCODING_MODES:
        validation.fail("pos_encoding_mode", f"one of {POS_ENCODING_MODES}", repr(pos_encoding_mode))
    if pos_encoding_mode != "NONE":
        not_implemented("pos_encoding_mode", pos_encoding_mode, "apply RoPE/ALiBi before attention and pass 'NONE'")
    for name, value in (("rope_scale", rope_scale), ("rope_theta", rope_theta)):
        if value is not None:
            not_implemented(name, value, "it belongs to pos_encoding_mode='ROPE_LLAMA'; pass None")
    if logits_soft_cap is not None and not _real(logits_soft_cap):
        validation.fail("logits_soft_cap", "None or a float", repr(logits_soft_cap))
    if block_tables is not None:
        not_implemented("block_tables", "<tensor>", "trtllm-gen's page table; flashjit reads indptr and indices")
    if seq_lens is not None:
        not_implemented("seq_lens", "<tensor>", "flashjit derives the lengths from indptr and last_page_len")
    if use_token_head_sf is not False:
        not_implemented("use_token_head_sf", use_token_head_sf, "per-(token, head) fp8 scales are not read; "
                        "flashjit's fp8 caches take k_scale/v_scale per tensor or per KV head")
    if not isinstance(disable_split_kv, bool):
        validation.fail("disable_split_kv", "True or False", repr(disable_split_kv))
    # FlashInfer caps the logits only for a cap > 0: None, 0 and below leave them alone.
    capped = logits_soft_cap is not None and logits_soft_cap > 0
    options = {"disable_split_kv": disable_split_kv, "sm_scale": sm_scale,
               "logits_soft_cap": float(logits_soft_cap) if capped else None}
    causal = query_mask(q_len_per_req, is_causal, window_right)
    if not causal and q_len_per_req > 1 and window_left != NO_WINDOW:
        not_implemented("is_causal", False, "flashjit's sliding window is causal; pass is_causal=None or True "
                        "with window_left >= 0")
    options.update(window_options(window_left, causal))
    options["q_len"] = q_len_per_req
    options["chunk_tokens"] = None if disable_split_kv else chunk_tokens(fixed_split_size, page_size)
    return options


def query_mask(q_len_per_req, is_causal, window_right) -> bool:
    """Whether a request's query tokens see each other causally (FlashInfer 0.7's q_len_per_req,
    is_causal and window_right). is_causal defaults to q_len_per_req > 1, as in FlashInfer;
    window_right 0 bounds the keys at the query's own position, -1 not at all."""
    if not isinstance(q_len_per_req, numbers.Integral) or isinstance(q_len_per_req, bool) or q_len_per_req < 1:
        validation.fail("q_len_per_req", "an int >= 1 (query tokens per request)", repr(q_len_per_req))
    if window_right not in (0, -1) or isinstance(window_right, bool):
        not_implemented("window_right", window_right, "keys after the query are not read; pass 0 (up to the "
                        "query's position) or -1 (no right bound)")
    if is_causal is not None and not isinstance(is_causal, bool):
        validation.fail("is_causal", "None, True or False", repr(is_causal))
    if window_right == -1 and is_causal:
        validation.fail("window_right", "0 with is_causal=True (a causal mask bounds the keys at the query)", -1)
    return (q_len_per_req > 1 and window_right == 0) if is_causal is None else is_causal


def window_options(window_left, causal: bool = False) -> dict:
    """The mask for FlashInfer's window_left (-1 reads every key, w >= 0 the keys at most w back) and
    whether a request's query tokens are causal. flashjit's sliding window is causal."""
    if not isinstance(window_left, numbers.Integral) or isinstance(window_left, bool) or window_left < NO_WINDOW:
        validation.fail("window_left", f"{NO_WINDOW} (no window) or an int >= 0", repr(window_left))
    if window_left == NO_WINDOW:
        return {"mask": "causal" if causal else "none", "window_left": None}
    return {"mask": "sliding_window", "window_left": int(window_left)}


def chunk_tokens(fixed_split_size, page_size: int):
    """BatchDecode's chunk_tokens for FlashInfer's fixed_split_size, which counts pages; None, 0 or
    below (vLLM passes -1) leaves the split to the planner."""
    if fixed_split_size is None:
        return None
    if not isinstance(fixed_split_size, numbers.Integral) or isinstance(fixed_split_size, bool):
        validation.fail("fixed_split_size", "None or an int (pages per split; <= 0: planned)", repr(fixed_split_size))
    return int(fixed_split_size) * page_size if fixed_split_size > 0 else None


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ---- run ---------------------------------------------------------------------------------------

def check_run_extras(args: tuple, planned_q_len: int, *, q_len_per_req=None, skip_softmax_threshold_scale_factor=None,
                     kv_cache_sf=None) -> None:
    """run()'s arguments for FlashInfer's other kernels: refused unless they ask for nothing."""
    if args:
        not_implemented("*args", f"{len(args)} values", "they are a custom kernel's (jit_args) or fp8 queries' scales")
    if q_len_per_req is not None and q_len_per_req != planned_q_len:
        validation.fail("q_len_per_req", f"None or plan()'s q_len_per_req={planned_q_len} (pass it to plan(), as "
                        "FlashInfer 0.7 does)", repr(q_len_per_req))
    if skip_softmax_threshold_scale_factor is not None:
        not_implemented("skip_softmax_threshold_scale_factor", skip_softmax_threshold_scale_factor,
                        "flashjit computes exact attention")
    if kv_cache_sf is not None:
        not_implemented("kv_cache_sf", "<scale factors>", "NVFP4 KV caches are not read; flashjit's caches are "
                        "fp16, bf16 or fp8 with k_scale/v_scale")


def run_scales(q_scale, k_scale, v_scale) -> tuple:
    """BatchDecode.run()'s (k_scale, v_scale). FlashInfer multiplies the softmax scale by q_scale
    and k_scale and the output by v_scale; flashjit folds k_scale into the softmax scale and v_scale
    into the epilogue, so q_scale joins k_scale. A missing scale is 1, as in FlashInfer."""
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    if q_scale is None or (_real(q_scale) and q_scale == 1):
        return k_scale, v_scale
    if not _real(q_scale) or not q_scale > 0:
        validation.fail("q_scale", "None or a float > 0", repr(q_scale))
    return k_scale * q_scale, v_scale  # a tensor k_scale gives a tensor: read by the kernel as BatchDecode's


def cache_for_run(paged_kv_cache, kv_layout: str):
    """The cache as BatchDecode.run() takes it: a (k, v) pair of 4-d tensors or one 5-d [pages, 2,
    ...] tensor. FlashInfer also takes the page_size-1 forms without the page dimension (3-d pairs,
    4-d stacks), which become views with it."""
    slot_dim = -3 if kv_layout == "NHD" else -2
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            validation.fail("paged_kv_cache", "a (k_cache, v_cache) pair or one [pages, 2, ...] tensor",
                            f"{len(paged_kv_cache)} tensors")
        k, v = paged_kv_cache
        if getattr(k, "dim", None) and k.dim() == 3 and v.dim() == 3:
            return k.unsqueeze(slot_dim), v.unsqueeze(slot_dim)
        return paged_kv_cache
    if getattr(paged_kv_cache, "dim", None) and paged_kv_cache.dim() == 4:
        return paged_kv_cache.unsqueeze(slot_dim)
    return paged_kv_cache


def lse_to_base2(lse):
    """flashjit's natural-log LSE, in place, as FlashInfer's base-2 one (log2(x) = ln(x) * log2(e))."""
    return lse.mul_(LOG2E)
