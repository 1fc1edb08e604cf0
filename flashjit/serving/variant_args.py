"""plan()'s variant arguments: an attention variant by name with its parameters
(variant="sinks", variant_params={"sinks": t}), or FlashInfer's names for the built-ins
(logits_soft_cap=50.0, sinks=t), resolved to one variant name and its parameters."""

from __future__ import annotations

from .. import validation
from ..masks.params import TENSOR_KINDS


def resolve(variant, variant_params, logits_soft_cap, sinks) -> tuple[str, dict | None]:
    """(variant name, its parameters or None). logits_soft_cap selects soft_cap (0.0 or None: no
    capping, as in FlashInfer), sinks selects sinks, both select soft_cap_sinks; they do not mix with
    variant= or variant_params=."""
    capped = logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float))
                                                  and not isinstance(logits_soft_cap, bool) and logits_soft_cap == 0)
    if not capped and sinks is None:
        if variant is None:
            if variant_params:
                validation.fail("variant_params", "None unless variant= names a variant", variant_params)
            return "none", None
        if not isinstance(variant, str):
            validation.fail("variant", "a variant name such as 'sinks' or 'soft_cap'", variant)
        return variant, variant_params
    if variant is not None or variant_params is not None:
        validation.fail("logits_soft_cap/sinks", "not combined with variant= or variant_params= (pass the "
                        "parameters in variant_params instead)", f"variant={variant!r}")
    params = {}
    if capped:
        params["logits_soft_cap"] = logits_soft_cap
    if sinks is not None:
        params["sinks"] = sinks
    name = "soft_cap_sinks" if capped and sinks is not None else "soft_cap" if capped else "sinks"
    return name, params


def memo_key(params: dict | None):
    """What identifies variant parameters in plan()'s setup memo: () for none, their items when all
    are numbers, None (no memo) when a tensor is among them."""
    if not params:
        return ()
    if all(type(value) in (int, float) for value in params.values()):
        return tuple(sorted((name, type(value), value) for name, value in params.items()))
    return None


def repoint_tensor(plan, name: str, tensor) -> None:
    """Point the plan's tensor variant parameter `name` at tensor, of the planned one's dtype, shape
    and device: the next launch reads it, with no new plan (layers with their own sinks share one)."""
    import torch

    if plan is None:
        raise RuntimeError(f"no plan yet: {name} is re-pointed after plan()")
    kernel = plan.setup.kernel
    tensors = [p.name for p in kernel.variant.params if p.kind in TENSOR_KINDS]
    if name not in tensors:
        validation.fail("name", f"a tensor parameter of the planned variant {kernel.variant.name!r}: {tensors}", name)
    planned = plan.setup.variant_params[name]
    if not (isinstance(tensor, torch.Tensor) and tensor.dtype == planned.dtype and tensor.shape == planned.shape
            and tensor.device == planned.device and tensor.is_contiguous()):
        got = f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}" if isinstance(tensor, torch.Tensor) else tensor
        validation.fail(name, f"a contiguous {planned.dtype} tensor {tuple(planned.shape)} on {planned.device}, "
                        "as planned", got)
    index = len(kernel.mask.params) + [p.name for p in kernel.variant.params].index(name)
    plan.buffers.set_param_value(index, tensor.data_ptr())
