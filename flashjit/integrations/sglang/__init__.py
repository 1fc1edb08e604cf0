"""flashjit inside SGLang 0.5.23 (extra `flashjit[sglang]`): a decode attention backend.

    pip install 'flashjit[sglang]'
    python -m sglang.launch_server --model-path MODEL \\
        --decode-attention-backend flashjit --prefill-attention-backend fa3

SGLang's plugin loader runs plugin.register (entry point group `sglang.srt.plugins`), which adds
"flashjit" to SGLang's attention backends and to the choices of its --*-attention-backend flags.
The backend (backend.FlashJITAttnBackend) serves decode batches, eager and in SGLang's CUDA
graphs, reading the token pool in place; prefill stays with the backend named for it.

tables and decoder hold what turns SGLang's metadata into flashjit page tables and plans; they
import torch and flashjit only, so this package imports no SGLang until plugin or backend is used.
See docs/integrations.md.
"""

from .decoder import AttentionShape, LayerForm, PoolDecoder, Step, pages_per_request
from .tables import HostTable, host_table, page_ids, paged_kv, write_kv

__all__ = ["AttentionShape", "HostTable", "LayerForm", "PoolDecoder", "Step", "host_table", "page_ids",
           "pages_per_request", "paged_kv", "write_kv"]
