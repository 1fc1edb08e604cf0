"""What plan()'s scalar arguments decide (Setup): validated, the spec's kernel built or found, and
loaded on the device. A serving loop plans one configuration every step, so BatchDecode keeps the
setups it made and makes one only for a configuration it has not seen."""

from __future__ import annotations

import math
import typing

from .. import validation
from ..kernels.worklist_kernel import Kernel, LoadedKernel
from ..jit.dtypes import QUERY_DTYPES, normalize_dtype
from ..kernels.decode.spec import FP8_QUERY_DTYPE, DecodeSpec
from ..masks.params import TENSOR_KINDS
from ..masks.registry import masks

LOG2E = 1.4426950408889634
MAX_SETUPS = 64  # distinct plan() configurations remembered per BatchDecode (then forgotten at once)


class Setup(typing.NamedTuple):
    """What plan()'s scalar arguments decide, worked out once per configuration (make_setup)."""

    spec: DecodeSpec
    kernel: Kernel
    loaded: LoadedKernel
    params: dict           # the mask's parameters, validated (its tensors are held alive here)
    sm_scale_log2: float
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: object        # torch dtypes of q, of the cache and of out
    kv_dtype: object
    out_dtype: object
    kv_shape: tuple        # a cache page's shape (NHD or HND)
    mask_generation: int   # masks.generation when made: a later registration (of a mask or variant) may change the kernel
    variant_params: dict = {}  # the variant's parameters, validated (its tensors are held alive here)


class PlanScalars(typing.NamedTuple):
    """plan()'s scalar arguments as given: what its setup is made from. A NamedTuple (immutable,
    fields by name) built every plan() in a fraction of a frozen dataclass's time; as a tuple it is
    the setup memo's key, beside its fields' types (128.0 == 128, yet only the int is valid)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    mask: str
    window_left: int | None
    q_dtype: object
    kv_dtype: object
    kv_layout: str
    sm_scale: float | None
    tensor_cores: bool | None
    variant: str = "none"
    out_dtype: object = None  # None: q_dtype's (16-bit queries)

    def types(self) -> tuple:
        return tuple(map(type, self))

    def on_tensor_cores(self) -> "PlanScalars":
        """These scalars with tensor_cores=True (the shared-prefix kernel's)."""
        return self._replace(tensor_cores=True)


def make_setup(scalars: PlanScalars, mask_params, kernel_q_len: int, *, engine, arch: str, device,
               load_kernel, variant_params=None, shared_prefix: bool = False) -> Setup:
    """A plan's scalars validated, the spec compiled (or found) and loaded with load_kernel(kernel, device index)."""
    (num_qo_heads, num_kv_heads, head_dim, page_size, mask, window_left, q_dtype, kv_dtype, kv_layout, sm_scale,
     tensor_cores, variant, out_dtype) = scalars
    validation.head_counts(num_qo_heads, num_kv_heads, page_size)
    generation = masks.generation  # before the lookups: a mask registered meanwhile makes a new setup
    out_dtype, query_fp8 = output_dtype(q_dtype, out_dtype)
    spec = DecodeSpec.cached(head_dim, out_dtype, kv_dtype, mask, page_size, num_qo_heads // num_kv_heads,
                             kernel_q_len, kv_layout, arch, tensor_cores, variant, shared_prefix, query_fp8)
    kernel = engine.get_kernel(spec)
    loaded = load_kernel(kernel, device.index)
    params = checked_mask_params(kernel.mask, window_left, mask_params, device)
    checked_variant = checked_variant_params(kernel.variant, variant_params, num_qo_heads, device)
    kv_shape = ((page_size, num_kv_heads, head_dim) if spec.kv_layout == "NHD"
                else (num_kv_heads, page_size, head_dim))
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else validation.positive_float32("sm_scale", sm_scale, LOG2E)
    return Setup(spec, kernel, loaded, params, scale * LOG2E, num_qo_heads, num_kv_heads, head_dim, page_size,
                 _torch_dtype(spec.q_dtype), _torch_dtype(spec.kv_dtype), _torch_dtype(spec.dtype), kv_shape, generation,
                 checked_variant)


def output_dtype(q_dtype, out_dtype) -> tuple:
    """(the output's dtype, whether the queries are e4m3) of plan()'s q_dtype and out_dtype. e4m3
    queries (quantized by a framework for an fp8 cache) need a 16-bit out_dtype; 16-bit ones give
    the output their dtype, and out_dtype may only repeat it."""
    q_name = normalize_dtype(q_dtype, "q_dtype", QUERY_DTYPES + (FP8_QUERY_DTYPE,))
    if q_name == FP8_QUERY_DTYPE:
        if out_dtype is None:
            validation.fail("out_dtype", "float16 or bfloat16 with e4m3 queries", None)
        return normalize_dtype(out_dtype, "out_dtype"), True
    if out_dtype is not None and normalize_dtype(out_dtype, "out_dtype") != q_name:
        validation.fail("out_dtype", f"None or q_dtype ({q_name}) with 16-bit queries", out_dtype)
    return q_name, False


def checked_mask_params(mask, window_left, mask_params, device) -> dict:
    """The mask's runtime parameters (window_left among them), each checked against its kind: ints
    in 0..2**31-1 and finite float32 floats (as Python numbers), int32 tensors on the device. What
    a value must be for the batch (a tensor's length, say) is the mask's kv_span to check."""
    if not mask.params and not mask_params and window_left is None:
        return {}  # the common case, a mask without parameters given none, in one test
    params = dict(mask_params or {})
    if window_left is not None:
        if "window_left" in params:
            validation.fail("window_left= and mask_params['window_left']", "one of them (both name the same "
                            "parameter)", f"both (window_left={window_left!r}, mask_params['window_left']="
                            f"{params['window_left']!r})")
        params["window_left"] = window_left
    return _checked_params("mask", mask, params, device)


def checked_variant_params(variant, variant_params, num_qo_heads: int, device) -> dict:
    """The variant's runtime parameters, each checked against its kind (as checked_mask_params),
    then against the batch by the variant's own check (a sinks tensor of num_qo_heads values)."""
    if not variant.params and not variant_params:
        return {}
    params = _checked_params("variant", variant, dict(variant_params or {}), device)
    if variant.check is not None:
        try:
            variant.check(params, num_qo_heads)
        except ValueError as exc:
            validation.fail(f"variant_params for variant {variant.name!r}", "values the variant accepts", str(exc))
    return params


def _checked_params(what: str, definition, params: dict, device) -> dict:
    """params (a copy) holding exactly definition's parameters, each of its kind."""
    missing = [p for p in definition.param_names if p not in params]
    unknown = [p for p in params if p not in definition.param_names]
    if missing or unknown:
        validation.fail(f"{what}_params for {what} {definition.name!r}", f"exactly {list(definition.param_names)}",
                        f"missing {missing}, unknown {unknown}")
    for p in definition.params:
        value = params[p.name]
        if p.kind == "int":
            params[p.name] = validation.int32_param(f"{what} param {p.name}", value)
        elif p.kind == "float":
            params[p.name] = validation.float32_param(f"{what} param {p.name}", value)
        elif p.kind in TENSOR_KINDS:
            import torch

            dtype = torch.int32 if p.kind == "int_tensor" else torch.float32
            validation.tensor(f"{what} param {p.name}", value, dtype=dtype, device=device, ndim=1)
            if value.numel() > 1 and value.stride(0) != 1:
                validation.fail(f"{what} param {p.name}", "a contiguous tensor (stride 1)", f"stride {value.stride(0)}")
    return params


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)  # the spec's dtype names are torch's
