"""Engine: the one place that composes spec -> render -> compile -> cache -> Kernel.

get_kernel looks in memory, then on disk, then renders and compiles (under a per-key file lock so
concurrent processes compile once). Every compile logs one INFO line on the 'flashjit' logger.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shlex
import threading
import time
from pathlib import Path

from .. import env
from .._version import __version__
from .cache import KernelCache
from .compile import compile_options, compile_source, compiler_fingerprint, nvrtc_version
from ..errors import KernelNotPrewarmed, SpecError
from .keys import cache_key, index_key, portable_key
from .kernel import Kernel
from ..masks.registry import masks
from .render import render, templates_digest
from .spec import DecodeSpec
from .tiling import decode_tiling

log = logging.getLogger("flashjit")


@dataclasses.dataclass(frozen=True)
class PrewarmResult:
    spec: DecodeSpec
    source: str      # "memory", "disk" or "compiled"
    seconds: float


def _capturing() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Engine:
    """Compiles, caches and hands out decode kernels.

    cache_dir: where compiled kernels live (else FLASHJIT_CACHE_DIR, else the user cache dir).
    template_dirs: folders of extra mask templates (NAME.cuh.j2), registered on construction.
    allow_compile: False makes a cache miss raise KernelNotPrewarmed (else FLASHJIT_NO_COMPILE).
    """

    def __init__(self, cache_dir=None, template_dirs=(), allow_compile: bool | None = None):
        self.cache = KernelCache(cache_dir)
        for folder in template_dirs:
            masks.add_template_dir(folder)
        self.allow_compile = (not env.no_compile()) if allow_compile is None else allow_compile
        self._kernels: dict[DecodeSpec, Kernel] = {}
        self._mask_generation = masks.generation  # the registrations _kernels was made under
        self._sources: dict[DecodeSpec, str] = {}
        self._key_locks: dict[DecodeSpec, threading.Lock] = {}
        self._lock = threading.Lock()

    def get_kernel(self, spec: DecodeSpec) -> Kernel:
        if self._mask_generation != masks.generation:
            self._forget_replaced_masks()
        kernel = self._kernels.get(spec)
        if kernel is not None:
            return kernel
        return self._resolve(spec)[0]

    def _forget_replaced_masks(self):
        """Drop the kernels of masks registered anew (replace=True, a template folder) since they were made."""
        with self._lock:
            generation = masks.generation
            for spec, kernel in list(self._kernels.items()):
                try:
                    current = masks.get(spec.mask)
                except SpecError:  # no longer registered: drop it too
                    current = None
                if current != kernel.mask:
                    del self._kernels[spec]
            self._mask_generation = generation

    def source(self, spec: DecodeSpec) -> str:
        """The rendered CUDA source of a spec (what `flashjit show` prints)."""
        return render(spec)

    def _resolve(self, spec: DecodeSpec) -> tuple[Kernel, str]:
        with self._lock:
            key_lock = self._key_locks.setdefault(spec, threading.Lock())
        with key_lock:
            kernel = self._kernels.get(spec)
            if kernel is not None:
                return kernel, "memory"
            mask = masks.get(spec.mask)
            spec_key = _spec_key(spec, mask)
            key, hit = self._indexed(spec, spec_key)
            origin = "disk"
            if hit is None:
                source = render(spec, mask)
                key = cache_key(source, spec.arch, compile_options(spec.arch), nvrtc_version(), __version__)
                hit = self.cache.load(key)
                if hit is None and not self.allow_compile:
                    # Strict serving: a cubin of the same source built by another NVRTC (a bundle
                    # from a build box with another CUDA) is as valid for this arch.
                    found = self.cache.load_portable(portable_key(source, spec.arch, compile_options(spec.arch), __version__))
                    if found is not None:  # not indexed: a host that may compile rebuilds it natively
                        kernel = Kernel(spec, decode_tiling(spec), mask, found[1], found[0])
                        self._kernels[spec] = kernel
                        return kernel, "disk"
                if hit is None:
                    with self.cache.compile_lock(key):
                        hit = self.cache.load(key)  # another process may have compiled it meanwhile
                        if hit is None:
                            hit = (self._compile(spec, source, key), None)
                            origin = "compiled"
                self.cache.store_index(spec_key, key)
            if origin == "disk":
                self.cache.touch(key)  # last use, for `flashjit cache prune`; memory hits never get here
            kernel = Kernel(spec, decode_tiling(spec), mask, hit[0], key)
            self._kernels[spec] = kernel
            return kernel, origin

    def _indexed(self, spec: DecodeSpec, spec_key: str):
        """(key, (cubin, meta)) through the index, or (None, None). An entry made for another spec
        (a damaged or foreign index file) is a miss, not a wrong kernel."""
        key = self.cache.lookup_index(spec_key)
        hit = self.cache.load(key) if key else None
        if hit is None or hit[1].get("name") != spec.name:
            return None, None
        return key, hit

    def cached_entry(self, spec: DecodeSpec) -> tuple[str, str] | None:
        """(index key, entry key) of the spec's verified entry in this engine's cache, or None.

        Never compiles; renders (and loads NVRTC) only when the index does not know the spec.
        `flashjit cache export --manifest` uses it to pick a manifest's entries.
        """
        mask = masks.get(spec.mask)
        spec_key = _spec_key(spec, mask)
        key, hit = self._indexed(spec, spec_key)
        if hit is None:
            key = cache_key(render(spec, mask), spec.arch, compile_options(spec.arch), nvrtc_version(), __version__)
            if self.cache.load(key) is None:
                return None
        return spec_key, key

    def _compile(self, spec: DecodeSpec, source: str, key: str) -> bytes:
        if not self.allow_compile:
            raise KernelNotPrewarmed(
                f"{spec.name} is not in the kernel cache at {self.cache.root} and compiling is disabled "
                f"(FLASHJIT_NO_COMPILE or allow_compile=False); build it with: {prewarm_command(spec, self.cache.root)}"
                + _registered_in_python(spec))
        if _capturing():
            raise KernelNotPrewarmed(
                f"{spec.name} would be compiled during CUDA-graph capture; prewarm first "
                f"(engine.get_kernel(spec) before capture, or: {prewarm_command(spec, self.cache.root)})")
        log.info("compiling %s for %s (cache miss)", spec.name, spec.arch)
        start = time.perf_counter()
        compiled = compile_source(source, spec.arch, spec.name, failed_source_dir=self.cache.base / "failed")
        seconds = time.perf_counter() - start
        self.cache.store(key, compiled.cubin, source, {
            "spec": spec.to_dict(), "name": spec.name, "arch": spec.arch, "nvrtc": list(nvrtc_version()),
            "flashjit": __version__, "options": list(compile_options(spec.arch)), "compile_seconds": round(seconds, 4),
            "created": time.time(), "nvrtc_log": compiled.log,
            "portable_key": portable_key(source, spec.arch, compile_options(spec.arch), __version__),
        })
        return compiled.cubin

    def prewarm(self, specs, jobs: int | None = None, on_done=None) -> list[PrewarmResult]:
        """Compile (or load from disk) every spec in parallel; NVRTC releases the GIL.

        on_done(result) is called as each spec finishes (the CLI's progress bar).
        """
        specs = list(dict.fromkeys(specs))
        jobs = max(1, jobs or os.cpu_count() or 1)

        def one(spec):
            start = time.perf_counter()
            _, origin = self._resolve(spec)
            result = PrewarmResult(spec, origin, time.perf_counter() - start)
            if on_done:
                on_done(result)
            return result

        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, specs))


def _spec_key(spec: DecodeSpec, mask) -> str:
    """Index key (keys.index_key) of a spec: its ingredients, gathered without rendering or loading NVRTC."""
    return index_key(spec, mask, templates_digest(mask), __version__, compile_options(spec.arch),
                     compiler_fingerprint())


def _registered_in_python(spec: DecodeSpec) -> str:
    template = Path(masks.get(spec.mask).template)
    if template.is_absolute() and template.name != f"{spec.mask}.cuh.j2":
        return (f" (mask {spec.mask!r} is registered from Python with {template}: run the prewarm where it is "
                "registered too, e.g. engine.prewarm([spec]) in a process that registers it)")
    return ""


def prewarm_command(spec: DecodeSpec, cache_dir) -> str:
    """A shell line that builds the spec into cache_dir: quoted, so it can be pasted verbatim.

    A mask loaded from a template folder (FLASHJIT_TEMPLATE_PATH, template_dirs) needs that folder
    in the command's environment too; a built-in mask needs nothing.
    """
    command = f"flashjit prewarm --spec {shlex.quote(spec.name)} --cache-dir {shlex.quote(str(cache_dir))}"
    template = Path(masks.get(spec.mask).template)
    if template.is_absolute() and template.name == f"{spec.mask}.cuh.j2":  # what a template-folder scan finds
        command = f"FLASHJIT_TEMPLATE_PATH={shlex.quote(str(template.parent))} {command}"
    return command
