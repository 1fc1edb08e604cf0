"""Typed errors. Each carries the offending value and says what to do next."""

from __future__ import annotations


class FlashJITError(Exception):
    """Base class of every error flashjit raises on purpose."""


class SpecError(FlashJITError, ValueError):
    """A spec field (DecodeSpec's unless owner names another) holds a value flashjit cannot generate code for."""

    def __init__(self, field: str, value, accepted: str, owner: str = "DecodeSpec"):
        self.field, self.value, self.accepted = field, value, accepted
        super().__init__(f"{owner}.{field}={value!r} is not supported; accepted: {accepted}")


class TemplateError(FlashJITError):
    """A Jinja2 template failed to render; names the template file and line."""


class CompileError(FlashJITError):
    """NVRTC rejected a rendered kernel. Carries the compiler log and the saved source."""

    def __init__(self, spec_name: str, log: str, source_path):
        self.spec_name, self.log, self.source_path = spec_name, log, source_path
        super().__init__(
            f"NVRTC failed to compile {spec_name}; rendered source saved at {source_path}\n"
            f"--- NVRTC log ---\n{log.strip()}"
        )


class CacheError(FlashJITError):
    """The kernel cache directory cannot be used as configured."""


class KernelNotPrewarmed(FlashJITError):
    """A kernel was needed but compiling is not allowed here (strict mode or CUDA-graph capture)."""
