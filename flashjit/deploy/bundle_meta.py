"""What a sound cache entry inside a bundle is, decided from its three files before anything is written.

A malformed meta.json (not an object, a field flashjit reads missing or of the wrong type, a key
that is not 64 hex digits) refuses the whole bundle: no flashjit wrote it. A damaged entry (its
cubin does not match cubin_sha256, it names another key or schema, its keys are not the hashes of
its source) is rejected alone, with the reason.
"""

from __future__ import annotations

import json
import math
import re

from ..jit.cache import ENTRY_FILES, KEY_PATTERN, SCHEMA
from ..jit.keys import cache_key, portable_key
from .bundle_stream import BundleFile, Refusal, quoted


def _text(pattern: re.Pattern):
    return lambda value: isinstance(value, str) and pattern.fullmatch(value) is not None


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _version_numbers(value) -> bool:
    return isinstance(value, list) and 1 <= len(value) <= 4 and all(type(n) is int and 0 <= n < 10**6 for n in value)


def _strings(value) -> bool:
    return isinstance(value, list) and len(value) <= 64 and all(isinstance(s, str) and len(s) <= 1024 for s in value)


# Every meta.json field flashjit reads: (is it well formed, what it should be). The entry key, the
# schema and the checksum are compared, not only typed: a mismatch there is damage, not malformation.
_REQUIRED = {
    "name": (_text(re.compile(r"[A-Za-z0-9_]{1,200}")), "a spec name"),
    "arch": (_text(re.compile(r"sm_\d{2,3}a?")), "an arch such as 'sm_90'"),
    "flashjit": (_text(re.compile(r"[A-Za-z0-9_.+!-]{1,64}")), "a version such as '0.1.0'"),
    "cubin_sha256": (_text(KEY_PATTERN), "64 hex digits"),
    "nvrtc": (_version_numbers, "a list of integers such as [12, 9]"),
    "options": (_strings, "a list of strings"),
}
_OPTIONAL = {
    "portable_key": (_text(KEY_PATTERN), "64 hex digits"),
    "compile_seconds": (_seconds, "a number of seconds"),
    "created": (_seconds, "a time stamp"),
    "cubin_bytes": (lambda v: type(v) is int and v >= 0, "a byte count"),
    "nvrtc_log": (lambda v: isinstance(v, str), "a string"),
    "spec": (lambda v: isinstance(v, dict), "an object"),
}


def _check_fields(member: str, meta: dict):
    for field, (valid, what) in (_REQUIRED | _OPTIONAL).items():
        if field not in meta:
            if field in _REQUIRED:
                raise Refusal(f"member {quoted(member)} has no field {field!r} ({what})")
        elif not valid(meta[field]):
            raise Refusal(f"member {quoted(member)} field {field!r} is {quoted(meta[field], 60)}, not {what}")


def check_entry(key: str, files: dict[str, BundleFile]):
    """An entry's meta.json if it is sound, else why it is rejected; raises Refusal if malformed."""
    missing = [name for name in ENTRY_FILES if name not in files]
    if missing:
        return f"incomplete: no {', '.join(missing)}"
    try:
        meta = json.loads(files["meta.json"].data)
        source = files["source.cu"].data.decode()
    except (ValueError, RecursionError) as exc:
        return f"unreadable meta.json or source.cu ({type(exc).__name__}: {str(exc)[:200]})"
    if not isinstance(meta, dict):
        raise Refusal(f"member {quoted(files['meta.json'].name)} is not a JSON object")
    if meta.get("key") != key:
        return "meta.json names another key"
    if meta.get("schema") != SCHEMA:
        return f"meta.json says schema {quoted(meta.get('schema'), 20)}, not {SCHEMA}"
    _check_fields(files["meta.json"].name, meta)
    if not files["kernel.cubin"].data.startswith(b"\x7fELF"):
        return "kernel.cubin is not an ELF file, so not a cubin"
    if meta["cubin_sha256"] != files["kernel.cubin"].sha256:
        return "kernel.cubin does not match meta.json's cubin_sha256 (damaged in transit?)"
    arch, options, made_by = meta["arch"], meta["options"], meta["flashjit"]
    portable = portable_key(source, arch, options, made_by)
    if meta.get("portable_key", portable) != portable:
        return "meta.json's portable_key is not the hash of its source.cu, arch, options and flashjit version"
    if cache_key(source, arch, options, meta["nvrtc"], made_by) != key:
        return "the entry's key is not the hash of its source.cu, arch, options, NVRTC and flashjit versions"
    return meta
