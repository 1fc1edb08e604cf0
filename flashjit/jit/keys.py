"""Every cache key flashjit computes, and each of its ingredients with the reason it is there.

Keys are part of the cache format: an entry written by one flashjit release is found by the next
only while the same ingredients hash to the same bytes. So each function below fixes the order and
the spelling of its ingredients; changing either misses every existing cache (bump cache.SCHEMA
instead, which moves the whole cache to a new folder). No key holds an absolute path, an mtime or a
host name: a cache built on one host serves another with the same compiler.

portable_key(source, arch, options, flashjit_version): a cubin, whichever NVRTC built it.
  * cache.SCHEMA: the entry layout and meta.json fields; a new schema never reads old entries.
  * flashjit_version: the launch code (argument order, grid, shared memory) must match the cubin.
  * arch: a cubin runs on one SM architecture.
  * options: NVRTC flags change the code (``--use_fast_math``, ``--std``).
  * source: the rendered CUDA source, which inlines every template, header and mask hook, so no
    template file needs hashing separately.
  Each part ends with a NUL so that no two ingredient lists spell the same bytes. Strict serving
  (FLASHJIT_NO_COMPILE) looks entries up by it: a bundle built with another CUDA is still valid.

cache_key(source, arch, options, nvrtc_version, flashjit_version): a cache entry (the entry key).
  * the portable key (above), as hex;
  * nvrtc_version: another NVRTC may emit other (faster, or fixed) code for the same source, so a
    host that may compile builds its own.

index_key(spec, mask, templates_digest, flashjit_version, options, compiler_fingerprint, variant, tiling):
the spec -> entry key shortcut, which finds an entry without rendering or loading NVRTC.
  * spec (its repr): every field shapes the source; the class name in the repr keeps the specs of
    two families apart.
  * mask.name, mask.template, mask.params: which template renders the hooks and with which
    runtime parameters; a mask registered anew under the same name differs here. A spec without
    a mask (merge_states, mask None) has no such ingredients.
  * variant.name, variant.template, variant.params: the same for the variant's hooks (a variant
    registered anew under the same name differs here; merge_states has no variant either).
  * templates_digest: the contents of every template file the source is rendered from, standing in
    for the source itself, so an edited template misses.
  * flashjit_version and options: as for the portable key.
  * compiler_fingerprint: the installed CuPy/NVRTC versions, standing in for nvrtc_version, so a
    compiler upgrade misses and falls back to the entry key.
  * tiling (its repr): the launch shape and tuned constants the family computes in Python from its
    tables (kernels/*/tiling.py), which the templates digest does not see and the launch reads
    beside the cubin: a retuned table (or one of its settings) misses rather than pairing an old
    cubin with a new grid, block or shared-memory size.
  A miss costs only a render and a lookup by entry key: the index may err towards missing.

library_key(source, cc, cflags): a host helper library (``<cache>/v1/host/<name>-<key>.so``).
  * source: the C file's bytes.
  * cflags: flags that change the code (rounding, optimisation).
  * the compiler program's file name (not its folder: the same gcc installed elsewhere builds the
    same library) and the rest of the compiler command (a wrapper, ``-m32``).
  * platform.system() and platform.machine(): a shared library runs on one OS and instruction set.
  Its first 32 hex digits name the file.
"""

from __future__ import annotations

import hashlib
import os
import platform

from .cache import SCHEMA


def portable_key(source: str, arch: str, options, flashjit_version: str) -> str:
    h = hashlib.sha256()
    for part in (f"schema={SCHEMA}", f"flashjit={flashjit_version}", f"arch={arch}", "options=" + " ".join(options)):
        h.update(part.encode() + b"\0")
    h.update(source.encode())
    return h.hexdigest()


def cache_key(source: str, arch: str, options, nvrtc_version, flashjit_version: str) -> str:
    h = hashlib.sha256(portable_key(source, arch, options, flashjit_version).encode())
    h.update(f"\0nvrtc={tuple(nvrtc_version)}".encode())
    return h.hexdigest()


def index_key(spec, mask, templates_digest: str, flashjit_version: str, options, compiler_fingerprint: str,
              variant, tiling) -> str:
    mask_parts = () if mask is None else (mask.name, mask.template, mask.params)
    variant_parts = () if variant is None else (variant.name, variant.template, variant.params)
    text = repr((spec, *mask_parts, templates_digest, flashjit_version, tuple(options), compiler_fingerprint,
                 *variant_parts, tiling))
    return hashlib.sha256(text.encode()).hexdigest()


def library_key(source: bytes, cc: list[str], cflags) -> str:
    h = hashlib.sha256(source)
    build = (tuple(cflags), os.path.basename(cc[0]), list(cc[1:]), platform.system(), platform.machine())
    h.update(repr(build).encode())
    return h.hexdigest()[:32]
