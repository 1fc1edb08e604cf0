"""FlashInfer's paged decode API (0.6 and 0.7) over flashjit: `import flashjit.compat.flashinfer as flashinfer`.

BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper and
fast_decode_plan take FlashInfer's arguments and return FlashInfer's results (LSE in base 2); what
flashjit does not implement raises NotImplementedError naming the argument. See decode.py.
"""

from .decode import BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper, fast_decode_plan

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan"]
