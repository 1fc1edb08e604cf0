"""Mask registry: name -> MaskDef (template, runtime parameters, KV span, torch predicate).

A mask is a Jinja2 template that extends ``masks/base.cuh.j2`` and overrides its hooks
(see docs/masks.md). Built-ins live in ``templates/masks``; users add masks with
``register_mask``, through folders on ``FLASHJIT_TEMPLATE_PATH`` or ``Engine(template_dirs=...)``.
Registering a mask never needs a change to the engine.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from pathlib import Path
from typing import Callable, Iterable

from .errors import SpecError

PARAM_CTYPES = {"int": "int", "float": "float", "int_tensor": "const int* __restrict__"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER = re.compile(r"\{#-?\s*params:(?P<params>[^#]*?)-?#\}")  # lazy: '-#}' is not a param


@dataclasses.dataclass(frozen=True)
class MaskParam:
    name: str
    kind: str  # one of PARAM_CTYPES

    @property
    def ctype(self) -> str:
        return PARAM_CTYPES[self.kind]


@dataclasses.dataclass(frozen=True)
class MaskDef:
    """What the engine and planner need to know about one mask.

    template: the Jinja2 name the loader resolves (built-ins) or an absolute file path (user masks).
    kv_span: (kv_lens, q_lens, params) -> (begin, end) numpy arrays of the positions worth reading
        per request; the planner cuts only that span into chunks. None means [0, kv_len).
    reference: (q_pos, kv_pos, request, params) -> bool tensor, the torch predicate used by
        flashjit.reference and the tests. None means every key below kv_len is visible.
    """

    name: str
    template: str
    params: tuple[MaskParam, ...] = ()
    kv_span: Callable | None = None
    reference: Callable | None = None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def _parse_params(params) -> tuple[MaskParam, ...]:
    if params is None:
        return ()
    items = params.items() if isinstance(params, dict) else ((p, "int") for p in params)
    parsed = []
    for name, kind in items:
        if not _NAME.fullmatch(name):
            raise SpecError("mask params", name, "C identifiers")
        if kind not in PARAM_CTYPES:
            raise SpecError(f"mask param {name!r} kind", kind, ", ".join(PARAM_CTYPES))
        parsed.append(MaskParam(name, kind))
    return tuple(parsed)


class MaskRegistry:
    """Thread-safe name -> MaskDef map. Template folders are scanned lazily."""

    def __init__(self):
        self._masks: dict[str, MaskDef] = {}
        self._lock = threading.Lock()
        self._scanned_env: str | None = None

    def register(self, name: str, template, params=None, *, kv_span=None, reference=None,
                 replace: bool = False) -> MaskDef:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise SpecError("mask", name, "a C identifier such as 'my_mask'")
        template = str(template)
        if os.path.isabs(template) and not os.path.isfile(template):
            raise SpecError("mask template", template, "an existing template file")
        mask = MaskDef(name, template, _parse_params(params), kv_span, reference)
        with self._lock:
            if name in self._masks and not replace and self._masks[name] != mask:
                raise SpecError("mask", name, "a name not registered yet (pass replace=True to override)")
            self._masks[name] = mask
        return mask

    def add_template_dir(self, folder) -> list[MaskDef]:
        """Register every ``NAME.cuh.j2`` in ``folder`` (or its ``masks/`` subfolder) as mask NAME.

        Runtime parameters are declared on the template's first line:
        ``{# params: window_left:int block_indices:int_tensor #}``.
        """
        folder = Path(folder).expanduser().resolve()
        if not folder.is_dir():
            raise SpecError("template_dirs", str(folder), "existing folders")
        found = []
        for path in sorted(list(folder.glob("*.cuh.j2")) + list(folder.glob("masks/*.cuh.j2"))):
            name = path.name.removesuffix(".cuh.j2")
            if name == "base" or not _NAME.fullmatch(name):
                continue
            found.append(self.register(name, path, _params_from_header(path), replace=True))
        return found

    def _scan_env(self):
        value = os.environ.get("FLASHJIT_TEMPLATE_PATH", "")
        if value == self._scanned_env:
            return
        self._scanned_env = value
        for folder in filter(None, value.split(os.pathsep)):
            self.add_template_dir(folder)

    def get(self, name: str) -> MaskDef:
        self._scan_env()
        try:
            return self._masks[name]
        except KeyError:
            raise SpecError("mask", name, ", ".join(sorted(self._masks))) from None

    def names(self) -> Iterable[str]:
        self._scan_env()
        return list(self._masks)

    def __contains__(self, name) -> bool:
        self._scan_env()
        return name in self._masks


def _params_from_header(path: Path) -> dict[str, str]:
    match = _HEADER.search(path.read_text()[:2000])
    if not match:
        return {}
    params = {}
    for item in match.group("params").split():
        name, _, kind = item.partition(":")
        params[name] = kind or "int"
    return params


# ---- built-in masks -------------------------------------------------------------------------

def _window_span(kv_lens, q_lens, params):
    import numpy as np

    begin = np.maximum(kv_lens - q_lens - int(params["window_left"]), 0)
    return begin, kv_lens


def _block_sparse_span(kv_lens, q_lens, params):
    import numpy as np

    indptr = params["block_indptr"]
    indptr = indptr.cpu().numpy() if hasattr(indptr, "cpu") else np.asarray(indptr)
    return np.zeros_like(kv_lens), np.diff(indptr).astype(kv_lens.dtype) * int(params["block_size"])


def _causal_ref(q_pos, kv_pos, request, params):
    return kv_pos <= q_pos


def _window_ref(q_pos, kv_pos, request, params):
    return (kv_pos <= q_pos) & (kv_pos >= q_pos - int(params["window_left"]))


def _block_sparse_ref(q_pos, kv_pos, request, params):
    import torch

    indptr, indices = params["block_indptr"], params["block_indices"]
    blocks = indices[int(indptr[request]):int(indptr[request + 1])].to(kv_pos.device).long()
    listed = torch.isin(torch.div(kv_pos, int(params["block_size"]), rounding_mode="floor"), blocks)
    return listed & (kv_pos <= q_pos)


masks = MaskRegistry()
masks.register("none", "masks/none.cuh.j2")
masks.register("causal", "masks/causal.cuh.j2", reference=_causal_ref)
masks.register("sliding_window", "masks/sliding_window.cuh.j2", {"window_left": "int"},
               kv_span=_window_span, reference=_window_ref)
masks.register("block_sparse", "masks/block_sparse.cuh.j2",
               {"block_size": "int", "block_indptr": "int_tensor", "block_indices": "int_tensor"},
               kv_span=_block_sparse_span, reference=_block_sparse_ref)


def register_mask(name: str, template_path, params=None, *, kv_span=None, reference=None,
                  replace: bool = False) -> MaskDef:
    """Add a mask type: a template file extending masks/base.cuh.j2, plus its runtime params.

    ``params`` maps parameter names to kinds ('int', 'float', 'int_tensor'), or lists int names.
    """
    path = Path(template_path).expanduser().resolve()
    if not path.is_file():
        raise SpecError("template_path", str(template_path), "an existing .cuh.j2 file")
    return masks.register(name, path, params, kv_span=kv_span, reference=reference, replace=replace)
