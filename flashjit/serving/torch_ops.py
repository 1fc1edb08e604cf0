"""torch.ops.flashjit: run() as operators that torch.compile keeps inside its graph.

Dynamo cannot trace run(): it reads data pointers and launches through ctypes. Under torch.compile,
BatchDecode.run and BatchDecodeMLA.run therefore call an operator instead, whose kernel is the eager
run() itself. Outside torch.compile run() launches directly, so the dispatcher's microseconds stay
off the eager path.

The plan crosses the operator boundary as an integer. Each decoder takes a handle from this
module's registry when it is built; the operator looks the decoder up and runs its current plan.
The handle is a constant of the traced graph, not a tensor input: plan() stays host work outside
the compiled region, and a compiled step runs whatever plan is current when it runs, as an eager
run() does.

The operators are defined with Library.define and one kernel per device type (CPU, CUDA) rather
than torch.library.custom_op, whose Python wrapper costs ~20 us a call against ~2 us.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_handles = itertools.count(1)
_decoders: dict[int, weakref.ref] = {}  # handle -> the decoder, held weakly


def register(decoder) -> int:
    """A new handle for decoder (an object with run()'s keywords); freed when the decoder is."""
    handle = next(_handles)
    _decoders[handle] = weakref.ref(decoder, lambda _, handle=handle: _decoders.pop(handle, None))
    return handle


def decoder_of(handle: int):
    """The decoder behind handle; a clear error for one that no longer exists."""
    ref = _decoders.get(handle)
    decoder = None if ref is None else ref()
    if decoder is None:
        raise RuntimeError(f"flashjit decoder handle {handle} refers to no live decoder: the decoder a compiled "
                           "graph was traced with has been freed (keep it alive as long as the compiled function)")
    return decoder


# ---- the operators -------------------------------------------------------------------------

# A scale is a tensor or a float: each is two arguments, the tensor (or None) and the float (or None).
DECODE_SCHEMA = ("decode(Tensor q, Tensor[] kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor? k_scale, "
                 "float? k_scale_value, Tensor? v_scale, float? v_scale_value, int decoder) -> ()")
MLA_SCHEMA = ("mla_decode(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor? kpe_cache, Tensor(a!) out, "
              "Tensor(b!)? lse, Tensor? ckv_scale, float? ckv_scale_value, Tensor? kpe_scale, "
              "float? kpe_scale_value, int decoder) -> ()")


def _decode_kernel(q, kv_cache, out, lse, k_scale, k_scale_value, v_scale, v_scale_value, decoder):
    cache = kv_cache[0] if len(kv_cache) == 1 else tuple(kv_cache)
    _untraced(decoder).run(q, cache, out=out, lse=lse, k_scale=_scale(k_scale, k_scale_value),
                           v_scale=_scale(v_scale, v_scale_value))


def _mla_kernel(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, ckv_scale, ckv_scale_value, kpe_scale,
                kpe_scale_value, decoder):
    _untraced(decoder).run(q_nope, q_pe, ckv_cache, kpe_cache, out=out, lse=lse,
                           ckv_scale=_scale(ckv_scale, ckv_scale_value), kpe_scale=_scale(kpe_scale, kpe_scale_value))


def _untraced(handle: int):
    """The decoder, for a kernel: run() launches directly only outside tracing (else it calls the operator)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("torch.ops.flashjit kernels run real tensors, never while torch.compile traces")
    return decoder_of(handle)


def _decode_fake(q, kv_cache, out, lse, k_scale, k_scale_value, v_scale, v_scale_value, decoder):
    """Checks at trace time what the kernel would refuse at run time, on shapes and dtypes alone."""
    _check_outputs("flashjit.decode", decoder_of(decoder), q, out, lse, q.shape)


def _mla_fake(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, ckv_scale, ckv_scale_value, kpe_scale,
              kpe_scale_value, decoder):
    _check_outputs("flashjit.mla_decode", decoder_of(decoder), q_nope, out, lse, q_nope.shape)


def _check_outputs(op: str, decoder, q, out, lse, out_shape):
    form = decoder.query_form()  # (q dtype or None for any, qo heads, head_dim, out dtype) of the plan; None before one
    if form is not None and (q.dim() != 3 or form[0] not in (None, q.dtype) or tuple(q.shape[1:]) != form[1:3]):
        raise ValueError(f"{op}: q must be [tokens, {form[1]}, {form[2]}] {form[0] or ''} as planned, "
                         f"got {tuple(q.shape)} {q.dtype}")
    out_dtype = _out_dtype(form, q)
    if tuple(out.shape) != tuple(out_shape) or out.dtype != out_dtype:
        raise ValueError(f"{op}: out must be {tuple(out_shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    if lse is not None and (tuple(lse.shape) != tuple(out_shape[:2]) or lse.dtype != torch.float32):
        raise ValueError(f"{op}: lse must be {tuple(out_shape[:2])} torch.float32, got {tuple(lse.shape)} {lse.dtype}")


def _out_dtype(form, q):
    """The output's dtype under a decoder's query_form(): q's where the plan names none (or before one)."""
    return q.dtype if form is None or form[3] is None else form[3]


def _scale(tensor, value):
    return tensor if tensor is not None else value


def _split_scale(scale):
    """A scale argument as the operator takes it: (tensor or None, float or None)."""
    return (scale, None) if isinstance(scale, torch.Tensor) else (None, None if scale is None else float(scale))


_library = torch.library.Library("flashjit", "FRAGMENT")  # alive as long as this module: the ops live with it
for _schema, _kernel, _fake in ((DECODE_SCHEMA, _decode_kernel, _decode_fake), (MLA_SCHEMA, _mla_kernel, _mla_fake)):
    _name = _schema.partition("(")[0]
    _library.define(_schema)
    for _device in ("CPU", "CUDA"):
        _library.impl(_name, _kernel, _device)
    torch.library.register_fake(f"flashjit::{_name}", _fake, lib=_library)


# ---- what run() calls under torch.compile ----------------------------------------------------

def decode(handle: int, q, kv_cache, out, lse, return_lse: bool, k_scale, v_scale):
    """BatchDecode.run() as traced: out (and lse) allocated in the graph, then the operator."""
    if out is None:
        out = q.new_empty(q.shape, dtype=_out_dtype(decoder_of(handle).query_form(), q))
    if return_lse and lse is None:
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    caches = list(kv_cache) if isinstance(kv_cache, (tuple, list)) else [kv_cache]
    torch.ops.flashjit.decode(q, caches, out, lse, *_split_scale(k_scale), *_split_scale(v_scale), handle)
    return (out, lse) if return_lse else out


def mla_decode(handle: int, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse: bool, ckv_scale, kpe_scale):
    """BatchDecodeMLA.run() as traced (out is [tokens, heads, 512], q_nope's shape)."""
    if out is None:
        out = q_nope.new_empty(q_nope.shape)
    if return_lse and lse is None:
        lse = q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32)
    torch.ops.flashjit.mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, *_split_scale(ckv_scale),
                                  *_split_scale(kpe_scale), handle)
    return (out, lse) if return_lse else out
