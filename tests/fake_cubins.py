"""What the fake NVRTC of the `fake_nvrtc` fixture (tests/conftest.py) 'compiles' a source to, for
tests that build a cache without real compiles."""

from __future__ import annotations

import hashlib


def fake_cubin(source: str, arch: str) -> bytes:
    """What fake_nvrtc 'compiles' a source to: deterministic, distinct per source and arch."""
    return b"\x7fELF fake cubin " + hashlib.sha256(f"{arch}\0{source}".encode()).digest()

