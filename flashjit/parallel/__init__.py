"""Decode across GPUs: each rank attends its shard of the context; the partial states merge exactly.

ContextParallelDecode (one rank, over a torch.distributed group), SequentialContextParallelDecode
(every shard in one process), the shard layouts Contiguous and Interleaved, Shard, split_page_table
and ReferenceDecoder (the shard attention in torch, for CPUs). See docs/parallel.md.
"""

from .decode import ContextParallelDecode, SequentialContextParallelDecode, Shard
from .layout import Contiguous, Interleaved, split_page_table
from .reference_decoder import ReferenceDecoder

__all__ = ["ContextParallelDecode", "Contiguous", "Interleaved", "ReferenceDecoder", "SequentialContextParallelDecode",
           "Shard", "split_page_table"]
