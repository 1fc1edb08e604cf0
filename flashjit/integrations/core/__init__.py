"""The framework-free adapter core: a serving framework's step metadata (query offsets, key counts,
block tables, slot mappings) and per-layer caches turned into flashjit's page tables, plans and
launches. It imports torch and flashjit only, so tests drive it with tensors shaped exactly as a
framework builds them; the framework packages (flashjit.integrations.vllm) only translate."""

from .decoders import FormDecoders
from .forms import DecodeForm
from .kv_cache import FP8_CACHE_DTYPES, KVPair, separate_kv_cache, split_kv_cache, write_kv
from .layer import LayerAttention
from .page_tables import DevicePageTable, HostPageTable, device_page_table, host_page_table, shared_leading_blocks
from .prefill import Fa3KVCachePrefill, ReferencePrefill, default_prefill
from .rows import RowSplit, split_rows
from .step import PrefillRows, StepPlan, StepPlanner, prefill_rows

__all__ = ["DecodeForm", "DevicePageTable", "FP8_CACHE_DTYPES", "Fa3KVCachePrefill", "FormDecoders", "HostPageTable",
           "KVPair", "LayerAttention", "PrefillRows", "ReferencePrefill", "RowSplit", "StepPlan", "StepPlanner",
           "default_prefill", "device_page_table", "host_page_table", "prefill_rows", "separate_kv_cache",
           "shared_leading_blocks",
           "split_kv_cache", "split_rows", "write_kv"]
