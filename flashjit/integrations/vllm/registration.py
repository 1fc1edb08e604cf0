"""The `vllm.general_plugins` entry point: FLASHJIT in vLLM's attention-backend registry.

vLLM may call it more than once in a process (and calls it in every process it starts), so it
registers once and does nothing after. vLLM's backend interface changes between minor releases:
the plugin is written for VLLM_MINOR and refuses another with a message naming both versions,
without registering (vLLM itself keeps working; selecting FLASHJIT then fails as an unknown name)."""

from __future__ import annotations

import logging

BACKEND_NAME = "FLASHJIT"
BACKEND_CLASS = "flashjit.integrations.vllm.backend.FlashJITBackend"
MLA_BACKEND_NAME = "FLASHJIT_MLA"
MLA_BACKEND_CLASS = "flashjit.integrations.vllm.mla.FlashJITMLABackend"
VLLM_MINOR = "0.33"

logger = logging.getLogger("flashjit")


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the minor release flashjit's plugin is written for."""


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version if its minor release is VLLM_MINOR, else UnsupportedVLLMVersion naming both."""
    if version is None:
        import vllm

        version = vllm.__version__
    minor = ".".join(str(version).split(".")[:2])
    if minor != VLLM_MINOR:
        raise UnsupportedVLLMVersion(
            f"flashjit's vLLM attention backend is written for vLLM {VLLM_MINOR}.x, and vLLM {version} is installed; "
            f"install vllm=={VLLM_MINOR}.* (pip install 'flashjit[vllm]') or a flashjit release written for "
            f"vLLM {minor}")
    return str(version)


def register(version: str | None = None) -> bool:
    """Register FLASHJIT and FLASHJIT_MLA with vLLM (idempotent). True when they are registered on return; False
    when the installed vLLM is another minor release (logged with both versions)."""
    try:
        check_vllm_version(version)
    except UnsupportedVLLMVersion as refusal:
        logger.error("%s", refusal)
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in ((BACKEND_NAME, BACKEND_CLASS), (MLA_BACKEND_NAME, MLA_BACKEND_CLASS)):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
    return True
