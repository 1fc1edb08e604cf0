"""flashjit as a vLLM 0.33 attention backend: `pip install 'flashjit[vllm]'`, then
`vllm serve MODEL --attention-backend FLASHJIT`.

vLLM loads the `vllm.general_plugins` entry point `flashjit = flashjit.integrations.vllm:register`
in every process; register() adds FLASHJIT to vLLM's backend registry. This package imports vLLM
only inside register() and the modules that subclass its classes (backend, builder, impl), so the
checks below are importable without vLLM."""

from .checks import SUPPORTED_HEAD_SIZES, refusal_reasons
from .registration import BACKEND_NAME, VLLM_MINOR, UnsupportedVLLMVersion, check_vllm_version, register

__all__ = ["BACKEND_NAME", "SUPPORTED_HEAD_SIZES", "UnsupportedVLLMVersion", "VLLM_MINOR", "check_vllm_version",
           "refusal_reasons", "register"]
