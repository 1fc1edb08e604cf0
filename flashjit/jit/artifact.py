"""The one lifecycle of everything flashjit builds once and keeps on disk (cubins, host libraries):

    key -> try-load -> on a miss: lock -> try-load again -> build -> atomic store -> load

The key (see keys.py) names the artifact before anything is built. An Artifact supplies the
steps and obtain() runs them in that order. The steps, and what each may raise:

  load()            The stored artifact, or None for a miss: absent, partial, damaged, failing
                    verification or failing the cache's trust rule (cache.py). Never raises for
                    anything a killed writer, a bad disk or another user leaves behind; such a
                    copy is a miss and is built again, and never loaded.
  lock()            A context manager held across the second load, the build and the store, so
                    that concurrent processes build a key once. It only saves work: correctness
                    rests on the atomic store. KernelCache.compile_lock waits FLASHJIT_LOCK_TIMEOUT
                    for a hung holder, then lets the caller build anyway (a duplicate build is
                    harmless, a hang is not); without a writable cache it holds nothing. A caller
                    with a fallback may wait less and take LockBusy instead (host libraries, which
                    fall back to numpy); one that cannot build at all (strict mode) takes no lock.
  build()           Makes the artifact. Raises what makes that impossible (CompileError,
                    KernelNotPrewarmed, OSError, the builder's RuntimeError); obtain() lets it
                    through with the lock released and nothing stored.
  store(built)      Writes it whole or not at all (cache.atomic_file: temp file, fsync,
                    os.replace), so a reader never loads half an artifact. It may raise OSError, or
                    handle a failed write itself: the kernel cache then serves from memory and warns
                    once.
  load_built(built) The artifact from the build just made (and stored, where the store could).

The second load, after the lock is taken, finds what another process built while this one waited.
"""

from __future__ import annotations

from typing import ContextManager, Protocol, TypeVar

Built = TypeVar("Built")
Loaded = TypeVar("Loaded")


class Artifact(Protocol[Built, Loaded]):
    def load(self) -> Loaded | None: ...

    def lock(self) -> ContextManager: ...

    def build(self) -> Built: ...

    def store(self, built: Built) -> None: ...

    def load_built(self, built: Built) -> Loaded: ...


def obtain(artifact: Artifact[Built, Loaded]) -> tuple[Loaded, bool]:
    """(the artifact, whether this call built it): loaded when stored, else built, stored and loaded."""
    loaded = artifact.load()
    if loaded is not None:
        return loaded, False
    with artifact.lock():
        loaded = artifact.load()  # another process may have built it while this one waited
        if loaded is not None:
            return loaded, False
        built = artifact.build()
        artifact.store(built)
    return artifact.load_built(built), True
