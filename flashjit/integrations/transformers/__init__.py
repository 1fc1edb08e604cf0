"""flashjit inside HuggingFace transformers' continuous batching (transformers 5.17 through 5.23;
extra `flashjit[transformers]`).

    from flashjit.integrations.transformers import register
    model.set_attn_implementation(register())        # "paged|fjit" (5.17, 5.18) or "fjit" (5.19 on)
    outputs = model.generate_batch(prompts, generation_config=config)

Decode steps and short multi-token steps (up to 16 query tokens per request) run on a BatchDecode,
planned once per step and layer group; longer prefill chunks run on torch SDPA over their gathered
keys. register(cuda_graphs=True) with ContinuousBatchingConfig(use_cuda_graph=True) serves every
step on the GPU alone (page table computed on the device, prefill cut into pieces the kernel
takes), so transformers captures and replays it. See docs/integrations.md.
"""

from .attention import PagedAttention
from .features import UnsupportedAttention
from .reference_backend import ReferenceDecode
from .registration import SUPPORTED_TRANSFORMERS, check_transformers_api, paged_name, register

__all__ = ["PagedAttention", "ReferenceDecode", "SUPPORTED_TRANSFORMERS", "UnsupportedAttention",
           "check_transformers_api", "paged_name", "register"]
