"""Engine: the one place that composes spec -> render -> compile -> cache -> Kernel.

Every kernel family (jit/family.py, flashjit/kernels/) shares the lifecycle; the family's mask,
variant, source and kernel object are where they differ, and the engine asks the family for each.

get_kernel looks in memory, then in the cache index (no render, no NVRTC), then renders the source
and obtains its cubin through the artifact lifecycle (artifact.obtain: disk, else compile under a
per-key file lock so concurrent processes compile once). Every compile logs one INFO line on the
'flashjit' logger.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import shlex
import threading
import time
from pathlib import Path

from .. import env
from .._version import __version__
from ..errors import KernelNotPrewarmed, SpecError
from ..masks.registry import masks
from ..masks.variants import variants
from .artifact import obtain
from .cache import KernelCache
from .compile import CompiledKernel, compile_options, compile_source, compiler_fingerprint, nvrtc_version
from .family import make_kernel, mask_of, source_of, tiling_of, variant_of
from .keys import cache_key, index_key, portable_key
from .render import templates_digest

log = logging.getLogger("flashjit")


@dataclasses.dataclass(frozen=True)
class PrewarmResult:
    spec: object     # a spec of any kernel family
    source: str      # "memory", "disk" or "compiled"
    seconds: float


def _capturing() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Engine:
    """Compiles, caches and hands out kernels of every registered family (jit/family.py).

    cache_dir: where compiled kernels live (else FLASHJIT_CACHE_DIR, else the user cache dir).
    template_dirs: folders of extra mask templates (NAME.cuh.j2), registered on construction.
    allow_compile: False makes a cache miss raise KernelNotPrewarmed (else FLASHJIT_NO_COMPILE).
    """

    def __init__(self, cache_dir=None, template_dirs=(), allow_compile: bool | None = None):
        self.cache = KernelCache(cache_dir)
        for folder in template_dirs:
            masks.add_template_dir(folder)
        self.allow_compile = (not env.no_compile()) if allow_compile is None else allow_compile
        self._kernels: dict = {}  # spec -> its family's kernel object
        self._mask_generation = masks.generation  # the registrations _kernels was made under
        self._key_locks: dict = {}  # spec -> the lock its first build holds
        self._lock = threading.Lock()

    def get_kernel(self, spec):
        """The kernel object of a spec of any family (KernelFamily.kernel)."""
        if self._mask_generation != masks.generation:
            self._forget_replaced_masks()
        kernel = self._kernels.get(spec)
        if kernel is not None:
            return kernel
        return self._resolve(spec)[0]

    def _forget_replaced_masks(self):
        """Drop the kernels of masks or variants registered anew (replace=True, a template folder) since they were made."""
        with self._lock:
            generation = masks.generation
            for spec, kernel in list(self._kernels.items()):
                if kernel.mask is None:  # a kernel without a mask (merge_states) is never replaced
                    continue
                try:
                    current = (masks.get(spec.mask), variants.get(spec.variant))
                except SpecError:  # no longer registered: drop it too
                    current = None
                if current != (kernel.mask, kernel.variant):
                    del self._kernels[spec]
            self._mask_generation = generation

    def source(self, spec) -> str:
        """The rendered CUDA source of a spec (what `flashjit show` prints)."""
        return source_of(spec, mask_of(spec), variant_of(spec))

    def _resolve(self, spec) -> tuple[object, str]:
        with self._lock:
            key_lock = self._key_locks.setdefault(spec, threading.Lock())
        with key_lock:
            kernel = self._kernels.get(spec)
            if kernel is not None:
                return kernel, "memory"
            mask, variant = mask_of(spec), variant_of(spec)
            spec_key = _spec_key(spec, mask, variant)
            key, hit = self._indexed(spec, spec_key)
            if hit is not None:
                cubin, origin = hit[0], "disk"
                self.cache.touch(key)  # last use, for `flashjit cache prune`; memory hits never get here
            else:
                wanted = _Cubin(self.cache, self.allow_compile, spec, source_of(spec, mask, variant))
                (key, cubin), built = obtain(wanted)
                origin = "compiled" if built else "disk"
                if key == wanted.key:  # another NVRTC's cubin is served but not indexed: a compiling host rebuilds it
                    self.cache.store_index(spec_key, key)
                    if not built:
                        self.cache.touch(key)
            kernel = make_kernel(spec, mask, variant, cubin, key)
            self._kernels[spec] = kernel
            return kernel, origin

    def _indexed(self, spec, spec_key: str):
        """(key, (cubin, meta)) through the index, or (None, None). An entry made for another spec
        (a damaged or foreign index file) is a miss, not a wrong kernel."""
        key = self.cache.lookup_index(spec_key)
        hit = self.cache.load(key) if key else None
        if hit is None or hit[1].get("name") != spec.name:
            return None, None
        return key, hit

    def cached_entry(self, spec) -> tuple[str, str] | None:
        """(index key, entry key) of the spec's verified entry in this engine's cache, or None.

        Never compiles; renders (and loads NVRTC) only when the index does not know the spec.
        `flashjit cache export --manifest` uses it to pick a manifest's entries.
        """
        mask, variant = mask_of(spec), variant_of(spec)
        spec_key = _spec_key(spec, mask, variant)
        key, hit = self._indexed(spec, spec_key)
        if hit is None:
            key = _entry_key(spec, source_of(spec, mask, variant))
            if self.cache.load(key) is None:
                return None
        return spec_key, key

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


def _spec_key(spec, mask, variant=None) -> str:
    """Index key (keys.index_key) of a spec: its ingredients, gathered without rendering or loading NVRTC.
    variant: the spec's VariantDef (default: the one registered under spec.variant)."""
    variant = variant_of(spec) if variant is None else variant
    return index_key(spec, mask, templates_digest(mask, variant), __version__, compile_options(spec.compile_arch),
                     compiler_fingerprint(), variant, tiling_of(spec))


def _entry_key(spec, source: str) -> str:
    """Entry key (keys.cache_key) of a rendered source, for this process's NVRTC."""
    return cache_key(source, spec.arch, compile_options(spec.compile_arch), nvrtc_version(), __version__)


@dataclasses.dataclass
class _Cubin:
    """The cubin of one rendered source as an artifact (see artifact.py); loads give (entry key, cubin).

    With compiling disallowed, a load also takes a cubin of the same source built by another NVRTC
    (a bundle from a build box with another CUDA): it is as valid for the arch, and its entry key
    is that entry's own.
    """

    cache: KernelCache
    allow_compile: bool
    spec: object
    source: str
    key: str = dataclasses.field(init=False)

    def __post_init__(self):
        self.key = _entry_key(self.spec, self.source)

    def _portable_key(self) -> str:
        return portable_key(self.source, self.spec.arch, compile_options(self.spec.compile_arch), __version__)

    def load(self) -> tuple[str, bytes] | None:
        hit = self.cache.load(self.key)
        if hit is not None:
            return self.key, hit[0]
        if not self.allow_compile:
            found = self.cache.load_portable(self._portable_key())
            if found is not None:
                return found[0], found[1]
        return None

    def lock(self):
        """The cache's compile lock; none in strict mode, which cannot compile and so has nothing
        to wait for (a peer that holds the lock, hung or stopped, does not delay the error)."""
        return self.cache.compile_lock(self.key) if self.allow_compile else contextlib.nullcontext()

    def build(self) -> tuple[CompiledKernel, float]:
        """(NVRTC's output, seconds it took). Raises KernelNotPrewarmed where compiling is not
        allowed (strict mode, CUDA-graph capture) and CompileError when NVRTC rejects the source."""
        spec = self.spec
        if not self.allow_compile:
            refused = self.cache.why_refused(self.key, self._portable_key())
            raise KernelNotPrewarmed(
                f"{spec.name} is not in the kernel cache at {self.cache.root} and compiling is disabled "
                f"(FLASHJIT_NO_COMPILE or allow_compile=False); build it with: {prewarm_command(spec, self.cache.root)}"
                + _registered_in_python(spec) + (f" (its cache files were not used: {refused})" if refused else ""))
        if _capturing():
            raise KernelNotPrewarmed(
                f"{spec.name} would be compiled during CUDA-graph capture; prewarm first "
                f"(engine.get_kernel(spec) before capture, or: {prewarm_command(spec, self.cache.root)})")
        log.info("compiling %s for %s (cache miss)", spec.name, spec.compile_arch)
        start = time.perf_counter()
        compiled = compile_source(self.source, spec.compile_arch, spec.name,
                                  failed_source_dir=self.cache.failed_source_folder())
        return compiled, time.perf_counter() - start

    def store(self, built: tuple[CompiledKernel, float]):
        """Write the entry; a cache that cannot take it warns once and the kernel lives in memory."""
        (compiled, seconds), spec = built, self.spec
        self.cache.store(self.key, compiled.cubin, self.source, {
            "spec": spec.to_dict(), "name": spec.name, "arch": spec.arch, "nvrtc": list(nvrtc_version()),
            "flashjit": __version__, "options": list(compile_options(spec.compile_arch)),
            "compile_seconds": round(seconds, 4),
            "created": time.time(), "nvrtc_log": compiled.log, "portable_key": self._portable_key(),
        })

    def load_built(self, built: tuple[CompiledKernel, float]) -> tuple[str, bytes]:
        return self.key, built[0].cubin


def _registered_in_python(spec) -> str:
    mask = mask_of(spec)
    if mask is None:
        return ""
    template = Path(mask.template)
    if template.is_absolute() and template.name != f"{spec.mask}.cuh.j2":
        return (f" (mask {spec.mask!r} is registered from Python with {template}: run the prewarm where it is "
                "registered too, e.g. engine.prewarm([spec]) in a process that registers it)")
    return ""


def prewarm_command(spec, cache_dir) -> str:
    """A shell line that builds the spec into cache_dir: quoted, so it can be pasted verbatim.

    A mask loaded from a template folder (FLASHJIT_TEMPLATE_PATH, template_dirs) needs that folder
    in the command's environment too; a built-in mask needs nothing.
    """
    command = f"flashjit prewarm --spec {shlex.quote(spec.name)} --cache-dir {shlex.quote(str(cache_dir))}"
    mask = mask_of(spec)
    if mask is None:
        return command
    template = Path(mask.template)
    if template.is_absolute() and template.name == f"{spec.mask}.cuh.j2":  # what a template-folder scan finds
        command = f"FLASHJIT_TEMPLATE_PATH={shlex.quote(str(template.parent))} {command}"
    return command


_default_engine: Engine | None = None
_default_engine_lock = threading.Lock()


def default_engine() -> Engine:
    """The process-wide engine (FLASHJIT_CACHE_DIR, FLASHJIT_NO_COMPILE) every API uses by default."""
    global _default_engine
    with _default_engine_lock:
        if _default_engine is None:
            _default_engine = Engine()
        return _default_engine
