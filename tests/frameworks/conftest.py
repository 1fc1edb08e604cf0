"""The framework tests run in a venv of their own (the real vllm==0.33.0 and sglang==0.5.23
installed with --no-deps, plus each folder's requirements), never in the main suite's.

PyPI's torchvision wheels link CUDA builds of torch: over the CPU torch of a test venv their C
ops do not load, and `import torchvision` then fails while registering fake kernels for two ops
(torchvision::nms, torchvision::qnms) that only those C ops define. SGLang imports
torchvision.transforms on its way to the modules these tests use, and vLLM imports it through
transformers' image utilities; nothing here calls the two ops, so they are declared (schemas
without kernels) where the C ops are missing, for either folder run alone or both together.
"""

from __future__ import annotations

import sys

import torch


def _declare_torchvision_ops_if_missing():
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        return  # no torchvision: the tests skip where a framework fails to import
    except RuntimeError:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        _declare_torchvision_ops_if_missing.library = library  # a Library undoes its definitions when collected
        import torchvision  # noqa: F401


_declare_torchvision_ops_if_missing()
