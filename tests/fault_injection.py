"""Deliberately broken kernels, for showing that the GPU tests are sharp. Test-only: the package has
no switch for them, so no production kernel can carry one.

A fault is a textual edit of a rendered kernel source at anchors the templates hold (inject):

  skip_item        work item 1 reads an empty span (a CTA that skipped its work: its keys are
                   missing from the output, or its request's output is 0)
  drop_partial     every merge leaves out partial 1 of each row it combines (flashjit_merge, the
                   merge in the decode kernel, the shared-prefix merge, MLA's)
  page_off_by_one  page 1 of every request's page list is read from slot 0's id

Each is applied to the kernels of one path (path_of: cuda_cores, tensor_cores, fp8, mla,
shared_prefix). faulted_engine() patches the engine so that every kernel of that path it builds
is compiled from the faulted source, under another index key (and, the source differing, another
entry key): a cache it writes to never serves a faulted cubin to an engine without the patch.
`pytest --inject-fault FAULT:PATH` (tests/conftest.py) runs a whole session so.
"""

from __future__ import annotations

import contextlib
import hashlib
import re

import flashjit.jit.engine as engine_module
from flashjit.kernels.merge_states.spec import MergeSpec
from flashjit.kernels.mla.spec import MLASpec

PATHS = ("cuda_cores", "tensor_cores", "fp8", "mla", "shared_prefix")

_WORK_ITEM_END = "    tile_begin = v_begin - v_begin % cfg::PAGE_SIZE;\n  }\n  FJ_INLINE bool padding() const"
_PAGE_READ = re.compile(r"__ldg\(a\.page_indices \+ page_begin \+ ([^()]+?)\)")
# (pattern, replacement, regex?) edits of each fault; every fault must match at least once in a source it applies to.
FAULTS = {
    "skip_item": [(_WORK_ITEM_END, "    tile_begin = v_begin - v_begin % cfg::PAGE_SIZE;\n"
                                   "    if (w == 1) v_end = v_begin;  // test fault: skip_item\n"
                                   "  }\n  FJ_INLINE bool padding() const", False)],
    "drop_partial": [
        ("part_lse[j] = real ? __ldcg(lse_0 + (i0 + j) * item_stride) : FJ_NEG_INF;",
         "part_lse[j] = real && i0 + j != 1 ? __ldcg(lse_0 + (i0 + j) * item_stride) : FJ_NEG_INF;  // test fault", False),
        ("lse[b] = at < w1 ? __ldg(a.tmp_lse + slot(at)) : FJ_NEG_INF;",
         "lse[b] = at < w1 && at != w0 + 1 ? __ldg(a.tmp_lse + slot(at)) : FJ_NEG_INF;  // test fault", False)],
    "page_off_by_one": [(_PAGE_READ, r"__ldg(a.page_indices + page_begin + fj_test_fault_page(\1))", True)],
}
_PREAMBLE = {"page_off_by_one": "static __device__ __forceinline__ int fj_test_fault_page(int p) { return p == 1 ? 0 : p; }\n"}


class AnchorMissing(AssertionError):
    """A fault found none of its anchors: the templates changed under it."""


def path_of(spec) -> str | None:
    """The kernel path a spec's kernel takes (PATHS), None for a merge_states kernel."""
    if isinstance(spec, MergeSpec):
        return None
    if isinstance(spec, MLASpec):
        return "mla"
    if spec.shared_prefix:
        return "shared_prefix"
    if spec.kv_is_fp8:
        return "fp8"
    return "tensor_cores" if spec.tensor_cores else "cuda_cores"


def inject(source: str, fault: str) -> str:
    """source with `fault` applied at every anchor; AnchorMissing if it matches none."""
    if fault not in FAULTS:
        raise ValueError(f"fault: expected one of {sorted(FAULTS)}, got {fault!r}")
    hits = 0
    for pattern, replacement, regex in FAULTS[fault]:
        if regex:
            source, n = pattern.subn(replacement, source)
        else:
            n = source.count(pattern)
            source = source.replace(pattern, replacement)
        hits += n
    if not hits:
        raise AnchorMissing(f"fault {fault!r}: none of its anchors is in the source (tests/fault_injection.py FAULTS)")
    return f"// test fault: {fault}\n" + _PREAMBLE.get(fault, "") + source


def parse(text: str) -> tuple[str, str]:
    """'FAULT:PATH' -> (fault, path), naming the accepted values when either is unknown."""
    fault, _, path = text.partition(":")
    if fault not in FAULTS or path not in PATHS:
        raise ValueError(f"--inject-fault: expected FAULT:PATH with FAULT one of {sorted(FAULTS)} and PATH one of "
                         f"{list(PATHS)}, got {text!r}")
    return fault, path


@contextlib.contextmanager
def faulted_engine(fault: str, path: str):
    """While active, every engine compiles the kernels of `path` from sources with `fault` injected,
    each indexed under a key of its own."""
    parse(f"{fault}:{path}")
    source_of, spec_key = engine_module.source_of, engine_module._spec_key

    def faulted_source(spec, mask, variant):
        source = source_of(spec, mask, variant)
        return inject(source, fault) if path_of(spec) == path else source

    def faulted_key(spec, mask, variant=None):
        key = spec_key(spec, mask, variant)
        if path_of(spec) != path:
            return key
        return hashlib.sha256(f"{key}\0test fault {fault}".encode()).hexdigest()

    engine_module.source_of, engine_module._spec_key = faulted_source, faulted_key
    try:
        yield
    finally:
        engine_module.source_of, engine_module._spec_key = source_of, spec_key
