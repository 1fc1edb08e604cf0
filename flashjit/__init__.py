"""flashjit: JIT-generated paged-KV decode attention kernels (Jinja2 templates, NVRTC, disk cache)."""

from ._version import __version__  # noqa: F401 (flashjit.__version__)

from .serving.batch_decode import BatchDecode, decode
from .serving.batch_mla import BatchDecodeMLA
from .jit.engine import Engine, PrewarmResult, default_engine
from .serving.quantize import dequantize_kv, quantize_kv, quantize_latent
from .serving.merge_states import merge_state, merge_states
from .kernels.merge_states.spec import MergeSpec
from .errors import CacheError, CompileError, FlashJITError, KernelNotPrewarmed, SpecError, TemplateError
from .masks.registry import register_mask
from .masks.sink_window import sink_window_params
from .kernels.decode.spec import DecodeSpec
from .kernels.mla.spec import MLASpec
from .masks.tree import pack_tree_mask
from .masks.variants import register_variant


def get_kernel(spec: "DecodeSpec | MergeSpec | MLASpec"):
    """engine.get_kernel on the process-wide default engine."""
    return default_engine().get_kernel(spec)


__all__ = [
    "BatchDecode", "BatchDecodeMLA", "CacheError", "CompileError", "DecodeSpec", "Engine", "FlashJITError", "KernelNotPrewarmed",
    "MLASpec", "PrewarmResult", "SpecError", "TemplateError", "decode", "default_engine", "get_kernel", "pack_tree_mask",
    "quantize_kv", "quantize_latent", "dequantize_kv", "register_mask", "sink_window_params",
    "MergeSpec", "merge_state", "merge_states", "register_variant",
]
