"""What a kernel cache entry is on disk: the schema, the names, the caps and meta.json's fields.

Everything here is part of the cache format (see cache.py for the layout and keys.py for the
keys); changing a name or a field's type misses every existing cache unless SCHEMA moves too.
"""

from __future__ import annotations

import re

from ..errors import CacheError

SCHEMA = 1
ENTRY_FILES = ("kernel.cubin", "source.cu", "meta.json")
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
# Caps on what is read (and stored): far above a real cubin, which is well under a few MiB.
MAX_BYTES = {"kernel.cubin": 256 << 20, "source.cu": 64 << 20, "meta.json": 16 << 20, "index": 1024, "portable": 1024}
# Types of the meta.json fields that readers use; a field of another type makes the entry damaged.
META_TYPES = {"key": str, "schema": int, "cubin_sha256": str, "cubin_bytes": int, "name": str, "arch": str,
              "created": (int, float), "compile_seconds": (int, float), "flashjit": str, "nvrtc": list,
              "options": list, "spec": dict, "portable_key": str, "nvrtc_log": str}
REQUIRED_META = ("key", "schema", "cubin_sha256")


def is_key(text) -> bool:
    """Whether text can be a cache key, and so a file name in the cache: 64 lowercase hex digits."""
    return isinstance(text, str) and KEY_PATTERN.fullmatch(text) is not None


def require_key(what: str, text):
    """CacheError unless text is a key: checked before any value from outside names a file."""
    if not is_key(text):
        raise CacheError(f"{what} {text!r} is not a cache key (64 lowercase hex digits); nothing was written")


def meta_problem(meta) -> str | None:
    """Why a decoded meta.json cannot describe an entry (wrong shape or field types), or None."""
    if not isinstance(meta, dict):
        return f"meta.json holds a {type(meta).__name__}, not an object"
    for field in REQUIRED_META:
        if field not in meta:
            return f"meta.json has no {field}"
    for field, types in META_TYPES.items():
        if field in meta and not isinstance(meta[field], types):
            return f"meta.json's {field} is a {type(meta[field]).__name__}"
    if "portable_key" in meta and not is_key(meta["portable_key"]):
        return "meta.json's portable_key is not a key"
    return None
