"""The C host planner (worklist/native/host_plan.c) as a loaded library: built for a kernel cache by
jit/host_library.py with the work list's defines, checked for the functions worklist/host.py calls,
or None where it cannot be had (the numpy planner serves instead)."""

from __future__ import annotations

from ..jit import host_library
from ..worklist.record import HOST_PLAN_DEFINES, HOST_PLAN_SOURCE, HOST_PLAN_SYMBOLS


def load_host_plan(cache=None, build: bool = True):
    """host_plan.c built and loaded for cache (a KernelCache; None: a private folder), or None.
    build=False (an engine that may not compile) only loads the library the cache holds."""
    return host_library.load(HOST_PLAN_SOURCE, cache, HOST_PLAN_DEFINES, HOST_PLAN_SYMBOLS, build=build)
