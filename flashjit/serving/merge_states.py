"""merge_state and merge_states: the exact online-softmax merge of partial attention states.

A state is (o, lse) over some keys: o the softmax-normalized attention output, lse the natural-log
sum of exp(scores) (what BatchDecode.run(return_lse=True) returns). States over disjoint keys merge
into the state over their union:

    M = max_i lse_i,   w_i = exp(lse_i - M),   o = sum_i w_i o_i / sum_i w_i,   lse = M + ln(sum_i w_i)

A state with lse = -inf (no visible key: an empty shard, a fully masked part) is an identity: it
contributes nothing, whatever its o holds (NaN included). If every state of a row is such, the row
gives o = 0 and lse = -inf, never NaN. Cascades, split-KV and context parallelism are built from it.

On a CUDA device the merge runs in the merge_states kernel (templates/merge_states/entry.cu.j2,
compiled and cached by the engine like the decode kernels, one per state dtype and arch); on the CPU
in torch, in float32 (merge_states_torch, also the reference the kernel is tested against).
States are read in place through their strides; the kernel needs each row's head_dim values
contiguous and starting on 16 bytes, and copies the states first where they are not.
"""

from __future__ import annotations

import ctypes

from ..kernels.merge_states.args import MergeStatesArgs
from ..jit.engine import Engine, default_engine
from ..jit.launch import PreparedLaunch
from ..kernels.merge_states.spec import MergeSpec, head_dims_accepted
from ..validation import fail
from .streams import current_stream

STATE_DTYPES = ("float16", "bfloat16", "float32")  # torch dtype names; torch loads on the first merge
_ACCEPTED_DTYPES = "torch.float16, torch.bfloat16 or torch.float32"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def merge_states(o, lse, *, out=None, out_lse=None, engine: Engine | None = None):
    """Merge n states per row: o [n, tokens, heads, head_dim], lse [n, tokens, heads] (float32, natural
    log) -> (o [tokens, heads, head_dim] of o's dtype, lse [tokens, heads] float32).

    out, out_lse: tensors to write the result into (else new ones); given, nothing is allocated on
    the GPU path, which then is safe to capture in a CUDA graph (after a first call has loaded the
    kernel). engine: where the kernel is compiled and cached (default the process-wide engine).
    """
    import torch

    _check_states("o", o, "lse", lse, stacked=True)
    out, out_lse = _outputs(o, out, out_lse, o.shape[1:])
    if o.device.type != "cuda":
        merged, merged_lse = merge_states_torch(o, lse)
        return out.copy_(merged), out_lse.copy_(merged_lse)
    o = _aligned(o)
    _launch(engine, o, o.stride(0), lse, lse.stride(0), o.shape[0], out, out_lse)
    return out, out_lse


def merge_state(o_a, lse_a, o_b, lse_b, *, out=None, out_lse=None, engine: Engine | None = None):
    """Merge two states: o_a, o_b [tokens, heads, head_dim], lse_a, lse_b [tokens, heads] float32 ->
    (o, lse) of the same shapes. The same rules and keywords as merge_states."""
    import torch

    _check_states("o_a", o_a, "lse_a", lse_a, stacked=False)
    _check_states("o_b", o_b, "lse_b", lse_b, stacked=False)
    if o_b.dtype != o_a.dtype or o_b.shape != o_a.shape or o_b.device != o_a.device:
        fail("o_b", f"a tensor like o_a ({o_a.dtype}, shape {tuple(o_a.shape)}, {o_a.device})",
             f"{o_b.dtype}, shape {tuple(o_b.shape)}, {o_b.device}")
    out, out_lse = _outputs(o_a, out, out_lse, o_a.shape)
    if o_a.device.type != "cuda":
        merged, merged_lse = merge_states_torch(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))
        return out.copy_(merged), out_lse.copy_(merged_lse)
    o_a, o_b = _aligned(o_a), _aligned(o_b)
    if o_a.stride() != o_b.stride() or lse_a.stride() != lse_b.stride():  # one stride set serves both
        o_b, lse_b = o_b.clone(memory_format=torch.contiguous_format), lse_b.contiguous()
        o_a, lse_a = o_a.clone(memory_format=torch.contiguous_format), lse_a.contiguous()
    # The kernel steps from state 0 to state 1 by an element stride: the distance between the two.
    o_step = (o_b.data_ptr() - o_a.data_ptr()) // o_a.element_size()
    lse_step = (lse_b.data_ptr() - lse_a.data_ptr()) // 4
    _launch(engine, o_a.unsqueeze(0), o_step, lse_a.unsqueeze(0), lse_step, 2, out, out_lse)
    return out, out_lse


def merge_states_torch(o, lse):
    """The merge in torch, in float32: o [n, tokens, heads, d], lse [n, tokens, heads] ->
    (o [tokens, heads, d] of o's dtype, lse [tokens, heads] float32). No checks: the CPU path of
    merge_states and the reference of its kernel."""
    import torch

    lse = lse.float()
    m = lse.amax(0) if lse.shape[0] else torch.full(lse.shape[1:], float("-inf"), device=lse.device)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # all -inf: every weight is 0, not NaN
    weight = torch.exp(lse - m_ref)
    live = (weight > 0)[..., None]
    contribution = torch.where(live, o.float() * weight[..., None], torch.zeros((), device=o.device))
    total = weight.sum(0)
    merged = torch.where(total[..., None] > 0, contribution.sum(0) / total.clamp_min(1e-30)[..., None],
                         torch.zeros((), device=o.device))
    merged_lse = torch.where(total > 0, m_ref + torch.log(total.clamp_min(1e-30)),
                             torch.full_like(total, float("-inf")))
    return merged.to(o.dtype), merged_lse


# ---- checks -------------------------------------------------------------------------------------

def _check_states(o_name: str, o, lse_name: str, lse, *, stacked: bool):
    import torch

    o_dims, lse_dims = ("[n, tokens, heads, head_dim]", "[n, tokens, heads]") if stacked else (
        "[tokens, heads, head_dim]", "[tokens, heads]")
    if not isinstance(o, torch.Tensor) or o.dim() != len(o_dims.split(",")):
        fail(o_name, f"a {len(o_dims.split(','))}-d tensor {o_dims}", _describe(o))
    if _dtype_name(o.dtype) not in STATE_DTYPES:
        fail(o_name, f"dtype {_ACCEPTED_DTYPES}", o.dtype)
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(o.shape[:-1]):
        fail(lse_name, f"a tensor {lse_dims} = {tuple(o.shape[:-1])} (the shape of {o_name} without head_dim)",
             _describe(lse))
    if lse.dtype != torch.float32:
        fail(lse_name, "dtype torch.float32 (natural-log LSE, as BatchDecode.run returns it)", lse.dtype)
    if lse.device != o.device:
        fail(lse_name, f"a tensor on {o_name}'s device {o.device}", lse.device)
    if o.device.type == "cuda":
        accepted = head_dims_accepted(_dtype_name(o.dtype), int(o.shape[-1]))
        if accepted is not None:
            fail(f"{o_name} head_dim", f"{accepted} (the GPU kernel's vectors)", int(o.shape[-1]))


def _outputs(o, out, out_lse, shape):
    """(out, out_lse): the given ones, checked, or new ones of the merged shapes."""
    import torch

    if out is None:
        out = torch.empty(shape, dtype=o.dtype, device=o.device)
    elif not isinstance(out, torch.Tensor) or out.shape != shape or out.dtype != o.dtype or out.device != o.device:
        fail("out", f"a tensor {tuple(shape)} of {o.dtype} on {o.device}", _describe(out))
    elif o.device.type == "cuda" and not _rows_aligned(out):
        fail("out", "rows of contiguous head_dim values starting on 16 bytes (e.g. a contiguous tensor)",
             f"strides {out.stride()} at address {out.data_ptr():#x}")
    if out_lse is None:
        out_lse = torch.empty(shape[:-1], dtype=torch.float32, device=o.device)
    elif (not isinstance(out_lse, torch.Tensor) or out_lse.shape != shape[:-1] or out_lse.dtype != torch.float32
          or out_lse.device != o.device):
        fail("out_lse", f"a float32 tensor {tuple(shape[:-1])} on {o.device}", _describe(out_lse))
    return out, out_lse


def _describe(value) -> str:
    if hasattr(value, "dtype") and hasattr(value, "device"):
        return f"a tensor of shape {tuple(value.shape)}, {value.dtype}, on {value.device}"
    return repr(value) if not hasattr(value, "shape") else f"{type(value).__name__} of shape {value.shape}"


def _rows_aligned(t) -> bool:
    """Whether every head_dim row of t is contiguous and starts on 16 bytes (the kernel's vector loads)."""
    size = t.element_size()
    return (t.stride(-1) == 1 or t.shape[-1] == 1) and t.data_ptr() % 16 == 0 and all(
        (s * size) % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def _aligned(o):
    import torch

    return o if _rows_aligned(o) else o.clone(memory_format=torch.contiguous_format)


# ---- the kernel -----------------------------------------------------------------------------------

def _launch(engine, o, o_state: int, lse, lse_state: int, num_states: int, out, out_lse):
    """Launch merge_states over o/lse (their dims 1..: tokens, heads[, head_dim]) stepping o_state and
    lse_state elements from one state to the next, on torch's current stream."""
    import torch

    _, tokens, heads, head_dim = o.shape
    if tokens == 0 or heads == 0:
        return
    if engine is None:
        engine = default_engine()
    device = o.device.index if o.device.index is not None else torch.cuda.current_device()
    spec = MergeSpec(_dtype_name(o.dtype), "sm_%d%d" % torch.cuda.get_device_capability(device))
    kernel = engine.get_kernel(spec)
    threads, rows_per_block = kernel.block_shape(head_dim)
    args = MergeStatesArgs(
        o=o.data_ptr(), lse=lse.data_ptr(), out=out.data_ptr(), out_lse=out_lse.data_ptr(),
        o_state=o_state, o_token=o.stride(1), o_head=o.stride(2),
        lse_state=lse_state, lse_token=lse.stride(1), lse_head=lse.stride(2),
        out_token=out.stride(0), out_head=out.stride(1),
        out_lse_token=out_lse.stride(0), out_lse_head=out_lse.stride(1),
        num_states=num_states, num_tokens=tokens, num_heads=heads, head_dim=head_dim)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    blocks = -(-tokens * heads // rows_per_block)
    PreparedLaunch(kernel.function(device), (blocks, 1, 1), (threads, 1, 1), params,
                   programmatic=kernel.programmatic_launch)(current_stream(device))
