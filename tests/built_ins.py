"""The built-in masks and variants, read from flashjit's registries, for the CPU and GPU tests'
matrices: a mask or variant added to the package joins every matrix over them with no edit here.

A built-in's template is a name under the package's templates/, a user's an absolute path
(MaskDef.template, VariantDef.template). The subsets are named by what the masks declare.
"""

from __future__ import annotations

import os

from flashjit.masks.registry import masks
from flashjit.masks.variants import variants


def _built_in(registry) -> tuple[str, ...]:
    """The registry's built-ins, in the order the package registers them."""
    return tuple(name for name in registry.names() if not os.path.isabs(registry.get(name).template))


BUILT_IN_MASKS = _built_in(masks)
BUILT_IN_VARIANTS = _built_in(variants)

# The masks the GPU planner plans (no span, or one its span_begin hook computes): CUDA-graph mode
# plans them on the device; the others' spans the host computes from their parameters.
DEVICE_PLANNED_MASKS = tuple(name for name in BUILT_IN_MASKS if masks.get(name).plans_on_device)
HOST_SPAN_MASKS = tuple(name for name in BUILT_IN_MASKS if name not in DEVICE_PLANNED_MASKS)

# The masks whose parameters are all scalars: one value serves any batch, where a tensor parameter
# is laid out per request or per query token of the batch it was made for.
SCALAR_PARAM_MASKS = tuple(name for name in BUILT_IN_MASKS
                           if all(p.kind in ("int", "float") for p in masks.get(name).params))

# The variants that change the weights (every one but the identity, which has no parameters).
PARAMETRIZED_VARIANTS = tuple(name for name in BUILT_IN_VARIANTS if variants.get(name).params)
