"""flashjit: JIT-generated paged-KV decode attention kernels (Jinja2 templates, NVRTC, disk cache)."""

__version__ = "0.1.0"

from .batch_decode import BatchDecode, decode, default_engine  # noqa: E402
from .engine import Engine, PrewarmResult  # noqa: E402
from .quantize import dequantize_kv, quantize_kv  # noqa: E402
from .errors import CacheError, CompileError, FlashJITError, KernelNotPrewarmed, SpecError, TemplateError  # noqa: E402
from .registry import register_mask  # noqa: E402
from .sink_window import sink_window_params  # noqa: E402
from .spec import DecodeSpec  # noqa: E402
from .tree import pack_tree_mask  # noqa: E402


def get_kernel(spec: DecodeSpec):
    """engine.get_kernel on the process-wide default engine."""
    return default_engine().get_kernel(spec)


__all__ = [
    "BatchDecode", "CacheError", "CompileError", "DecodeSpec", "Engine", "FlashJITError", "KernelNotPrewarmed",
    "PrewarmResult", "SpecError", "TemplateError", "decode", "default_engine", "get_kernel", "pack_tree_mask",
    "quantize_kv", "dequantize_kv", "register_mask", "sink_window_params",
]
