"""FlashInfer 0.6's decode arguments in BatchDecode's terms, and the refusals of what flashjit lacks.

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


def check_backend(backend, jit_args) -> None:
    if backend == "trtllm-gen":
        not_implemented("backend", backend, f"its block_tables/seq_lens plan is not served; use one of {BACKENDS}")
    if backend not in BACKENDS:
        validation.fail("backend", f"one of {BACKENDS} (flashjit picks its kernel for each)", repr(backend))
    if jit_args is not None:
        not_implemented("jit_args", "<custom kernel>", "register a flashjit mask instead (docs/masks.md)")


def torch_dtype(name: str, value):
    """FlashInfer's dtype argument (a torch dtype or its name) as a torch dtype."""
    import torch

    found = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(found, torch.dtype):
        validation.fail(name, "a torch dtype or its name ('float16', 'bfloat16', 'float8_e4m3fn', ...)", repr(value))
    return found


def plan_dtypes(q_data_type, kv_data_type, data_type, o_data_type=None) -> tuple:
    """(query dtype, cache dtype) as FlashInfer's plan() resolves them: data_type fills whichever of
    the two is None, the cache dtype defaults to the query's, and the output is the query's dtype."""
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    q_dtype = torch_dtype("q_data_type", q_data_type)
    kv_dtype = q_dtype if kv_data_type is None else torch_dtype("kv_data_type", kv_data_type)
    if str(q_dtype).removeprefix("torch.") in FP8_DTYPE_NAMES:
        not_implemented("q_data_type", q_dtype, "fp8 is read for the KV cache only; pass 16-bit queries")
    if o_data_type is not None and torch_dtype("o_data_type", o_data_type) != q_dtype:
        not_implemented("o_data_type", o_data_type, f"the output has the query dtype ({q_dtype}); pass None")
    return q_dtype, kv_dtype


def plan_options(*, page_size: int, pos_encoding_mode="NONE", window_left=NO_WINDOW, logits_soft_cap=None,
                 sm_scale=None, rope_scale=None, rope_theta=None, fixed_split_size=None,
                 disable_split_kv=False, block_tables=None, seq_lens=None) -> dict:
    """BatchDecode.plan()'s keywords (mask, window_left, sm_scale, chunk_tokens, disable_split_kv)
    for FlashInfer's plan() arguments."""
    if pos_encoding_mode not in POS_ENCODING_MODES:
        validation.fail("pos_encoding_mode", f"one of {POS_ENCODING_MODES}", repr(pos_encoding_mode))
    if pos_encoding_mode != "NONE":
        not_implemented("pos_encoding_mode", pos_encoding_mode, "apply RoPE/ALiBi before attention and pass 'NONE'")
    for name, value in (("rope_scale", rope_scale), ("rope_theta", rope_theta)):
        if value is not None:
            not_implemented(name, value, "it belongs to pos_encoding_mode='ROPE_LLAMA'; pass None")
    # FlashInfer caps the logits only for a cap > 0: None, 0 and below leave them alone.
    if logits_soft_cap is not None and _real(logits_soft_cap) and logits_soft_cap > 0:
        not_implemented("logits_soft_cap", logits_soft_cap, "flashjit has no soft-capping variant yet; pass None or 0")
    if logits_soft_cap is not None and not _real(logits_soft_cap):
        validation.fail("logits_soft_cap", "None or a float", repr(logits_soft_cap))
    if block_tables is not None:
        not_implemented("block_tables", "<tensor>", "trtllm-gen's page table; flashjit reads indptr and indices")
    if seq_lens is not None:
        not_implemented("seq_lens", "<tensor>", "flashjit derives the lengths from indptr and last_page_len")
    if not isinstance(disable_split_kv, bool):
        validation.fail("disable_split_kv", "True or False", repr(disable_split_kv))
    options = {"disable_split_kv": disable_split_kv, "sm_scale": sm_scale}
    options.update(window_options(window_left))
    options["chunk_tokens"] = None if disable_split_kv else chunk_tokens(fixed_split_size, page_size)
    return options


def window_options(window_left) -> dict:
    """The mask for FlashInfer's window_left: -1 reads every key, w >= 0 the keys at most w back."""
    if not isinstance(window_left, numbers.Integral) or isinstance(window_left, bool) or window_left < NO_WINDOW:
        validation.fail("window_left", f"{NO_WINDOW} (no window) or an int >= 0", repr(window_left))
    if window_left == NO_WINDOW:
        return {"mask": "none", "window_left": None}
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

def check_run_extras(args: tuple, *, sinks=None, q_len_per_req=1, skip_softmax_threshold_scale_factor=None) -> None:
    """run()'s arguments for FlashInfer's other kernels: refused unless they ask for nothing."""
    if args:
        not_implemented("*args", f"{len(args)} values", "they are a custom kernel's (jit_args) or fp8 queries' scales")
    if sinks is not None:
        not_implemented("sinks", "<tensor>", "learned sink logits are not served by flashjit's decode yet")
    if q_len_per_req not in (None, 1):
        not_implemented("q_len_per_req", q_len_per_req, "flashjit's multi-token decode is BatchDecode.plan(q_len=)")
    if skip_softmax_threshold_scale_factor is not None:
        not_implemented("skip_softmax_threshold_scale_factor", skip_softmax_threshold_scale_factor,
                        "flashjit computes exact attention")


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
