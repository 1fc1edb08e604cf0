"""SGLang's plugin entry point (group `sglang.srt.plugins`): register() adds the "flashjit"
attention backend and the name to the choices of --attention-backend, --decode-attention-backend
and --prefill-attention-backend. SGLang runs it in every process it starts, before parsing the
arguments, and may run it more than once in a process: a second call changes nothing.

The backend reads SGLang internals whose form changes between releases (0.5.23 replaced the
CUDA-graph hooks of AttentionBackend), so register() refuses any other release than the one it is
written for, naming both; SGLang's loader logs the refusal and serves without flashjit.
"""

from __future__ import annotations

import importlib.metadata
import re

from .settings import NAME

SUPPORTED_SGLANG = "0.5.23"


def check_sglang_version(installed: str | None = None) -> str:
    """The installed SGLang version (or `installed`) if it is SUPPORTED_SGLANG (a .postN of it
    too), else ImportError naming both."""
    if installed is None:
        try:
            installed = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"flashjit's SGLang backend needs sglang=={SUPPORTED_SGLANG}, and no sglang is "
                              "installed (pip install 'flashjit[sglang]')") from None
    if _release(installed) != _release(SUPPORTED_SGLANG):
        raise ImportError(f"flashjit's SGLang backend is written for SGLang {SUPPORTED_SGLANG} (its attention-backend "
                          f"and CUDA-graph interfaces change between releases); installed: SGLang {installed}. "
                          f"Install sglang=={SUPPORTED_SGLANG}, or a flashjit written for {installed}.")
    return installed


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: '0.5.23.post1' -> (0, 5, 23); None for a malformed one."""
    match = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?\s*$", version)
    return None if match is None else tuple(int(part) for part in match.groups())


def register() -> None:
    """The entry point: "flashjit" among SGLang's attention backends and its flags' choices."""
    check_sglang_version()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])


def create_backend(model_runner):
    """SGLang's factory for the name: the backend for a model runner (imported only when chosen)."""
    from .backend import FlashJITAttnBackend

    return FlashJITAttnBackend(model_runner)
