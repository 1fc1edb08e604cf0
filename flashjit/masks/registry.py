"""Mask registry: name -> MaskDef (template, runtime parameters, KV span, torch predicate).

A mask is a Jinja2 template that extends ``masks/base.cuh.j2`` and overrides its hooks
(see docs/masks.md). Built-ins live in ``templates/masks``; users add masks with
``register_mask``, through folders on ``FLASHJIT_TEMPLATE_PATH`` or ``Engine(template_dirs=...)``,
or from installed packages through the ``flashjit.masks`` entry-point group.
Registering a mask never needs a change to the engine.

Discovery is lazy: FLASHJIT_TEMPLATE_PATH is re-scanned whenever its value changed, and the entry
points load once per process, on the first lookup of a name not registered yet (or on names()),
so a process that only uses built-ins never imports importlib.metadata. A folder mask replaces
an earlier user mask of the same name but never a built-in; register_mask and plugins never
replace silently.

A template folder that cannot be used (missing, not a folder, a file with a bad params header, a
link out of the folder, a file named after a built-in) registers none of its masks. Engine's
template_dirs raise at once; a FLASHJIT_TEMPLATE_PATH folder is reported by every names() and by
every lookup of a name not registered, while the built-ins keep working.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from pathlib import Path
from typing import Callable, Iterable

from .. import env
from ..errors import SpecError
from ..validation import did_you_mean
from .params import PARAM_CTYPES

log = logging.getLogger("flashjit")

ENTRY_POINT_GROUP = "flashjit.masks"
TEMPLATE_PATH_ENV = "FLASHJIT_TEMPLATE_PATH"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER = re.compile(r"\{#-?\s*params:(?P<params>[^#]*?)-?#\}")  # lazy: '-#}' is not a param
_HEADER_CHARS = 2000  # the params header is the first comment: a huge file is not read whole


class TemplateFolderError(SpecError):
    """A template folder, or a file in it, cannot be used. field: 'template_dirs' or
    'FLASHJIT_TEMPLATE_PATH'; value: the folder (or the variable's value); accepted: what is wrong,
    naming the folder or file."""

    def __init__(self, field: str, value, problem: str):
        self.field, self.value, self.accepted = field, str(value), problem
        Exception.__init__(self, f"{field}={value}: {problem}")


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
        A template loads other files by relative name from the package's templates/ only, and by
        absolute path only the template files of registered masks (flashjit.jit.render).
    kv_span: (kv_lens, q_lens, params) -> (begin, end) numpy arrays of the positions worth reading
        per request; the planner cuts only that span into chunks. None means [0, kv_len).
    device_span: the template's span_begin hook computes kv_span's begin on the GPU, and its end
        is kv_len: CUDA-graph mode can then plan on the GPU (as it does for kv_span None).
    reference: (q_pos, kv_pos, request, params) -> bool tensor, the torch predicate used by
        flashjit.serving.reference and the tests; q_pos is the request's [q_len, 1] column of query
        positions (kv_len - q_len + i), kv_pos the [1, kv_len] row of keys. None means every key
        below kv_len is visible.
    sample_params: (rng, kv_lens, q_lens, page_size, device) -> mask_params for a random batch
        (rng a random.Random); used by `flashjit check-mask` and the GPU tests. None: int and
        float params get small defaults, and a mask with tensor params cannot be checked.
    """

    name: str
    template: str
    params: tuple[MaskParam, ...] = ()
    kv_span: Callable | None = None
    reference: Callable | None = None
    sample_params: Callable | None = None
    device_span: bool = False

    @property
    def plans_on_device(self) -> bool:
        """Whether the GPU planner computes this mask's spans (see device_span)."""
        return self.kv_span is None or self.device_span

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def _parse_params(params) -> tuple[MaskParam, ...]:
    if params is None:
        return ()
    if isinstance(params, dict):
        items = params.items()
    else:  # names of int params, or MaskParams (a MaskDef's own, from a plugin)
        items = ((p.name, p.kind) if isinstance(p, MaskParam) else (p, "int") for p in params)
    parsed = []
    for name, kind in items:
        if not _NAME.fullmatch(name):
            raise SpecError("mask params", name, "C identifiers")
        if kind not in PARAM_CTYPES:
            raise SpecError(f"mask param {name!r} kind", kind, ", ".join(PARAM_CTYPES))
        parsed.append(MaskParam(name, kind))
    return tuple(parsed)


class MaskRegistry:
    """Thread-safe name -> MaskDef map. Plugins and template folders are discovered lazily."""

    def __init__(self):
        self._masks: dict[str, MaskDef] = {}
        self._lock = threading.Lock()
        self._scanned_env: list[Path] | None = None
        self._scan_lock = threading.Lock()
        self._env_problems: tuple[list[Path] | None, tuple[str, ...]] = (None, ())  # (scanned folders, problems)
        self._plugins_loaded = self._plugins_loading = False
        self._plugin_lock = threading.RLock()  # re-entrant: a plugin may look masks up while loading
        self.plugin_errors: dict[str, str] = {}  # entry-point name -> why it did not load
        self.generation = 0  # counts registrations: what was looked up before may have changed since

    def register(self, name: str, template, params=None, *, kv_span=None, reference=None,
                 sample_params=None, device_span: bool = False, replace: bool = False) -> MaskDef:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise SpecError("mask", name, "a C identifier such as 'my_mask'")
        template = str(template)
        if os.path.isabs(template) and not os.path.isfile(template):
            raise SpecError("mask template", template, "an existing template file")
        mask = MaskDef(name, template, _parse_params(params), kv_span, reference, sample_params, device_span)
        with self._lock:
            if name in self._masks and not replace and self._masks[name] != mask:
                raise SpecError("mask", name, "a name not registered yet (pass replace=True to override)")
            self._masks[name] = mask
            self.generation += 1
        return mask

    def add_template_dir(self, folder) -> list[MaskDef]:
        """Register every ``NAME.cuh.j2`` in ``folder`` (or its ``masks/`` subfolder) as mask NAME.

        Runtime parameters are declared on the template's first line:
        ``{# params: window_left:int block_indices:int_tensor #}``. A folder that cannot be used
        raises TemplateFolderError naming the folder or file, and registers none of its masks.
        """
        return self._add_folder(folder, "template_dirs")

    def _add_folder(self, folder, field: str) -> list[MaskDef]:
        found = _folder_masks(folder, field)
        with self._lock:
            for name, path, _ in found:
                current = self._masks.get(name)
                if current is not None and _is_package_template(current.template):
                    raise TemplateFolderError(field, folder, (
                        f"{path} would replace the built-in mask {name!r}; rename the file, or replace the "
                        f"built-in on purpose with register_mask({name!r}, template=PATH, replace=True)"))
        return [self.register(name, path, params, replace=True) for name, path, params in found]

    def _scan_env(self):
        folders = env.template_path()
        if folders == self._scanned_env:
            return
        with self._scan_lock:  # one scan per value: the others wait for its masks
            if folders == self._scanned_env:
                return
            problems = []
            for folder in folders:
                try:
                    self._add_folder(folder, TEMPLATE_PATH_ENV)
                except TemplateFolderError as exc:  # the other folders and the built-ins still load
                    problems.append(exc.accepted)
                    log.warning("%s: %s", TEMPLATE_PATH_ENV, exc.accepted)
            self._env_problems = (folders, tuple(problems))
            self._scanned_env = folders

    def template_folder_error(self) -> TemplateFolderError | None:
        """What is wrong with the FLASHJIT_TEMPLATE_PATH folders as last scanned, or None."""
        folders, problems = self._env_problems
        if folders != self._scanned_env or not problems:
            return None
        return TemplateFolderError(TEMPLATE_PATH_ENV, os.pathsep.join(map(str, folders)), "; ".join(problems))

    def load_plugins(self) -> None:
        """Register the masks of every ``flashjit.masks`` entry point, once per process.

        An entry point names an object (``pkg.module:attr``). A callable is called with no
        arguments: it may call flashjit.register_mask itself, and whatever it returns is
        registered too. A returned (or non-callable) value may be None, a MaskDef, a dict of
        register_mask keywords (name, template, params, kv_span, reference, sample_params), or a
        list of those. A plugin that fails (raising, or calling sys.exit) is skipped with a warning;
        the error is kept in ``plugin_errors`` and named when an unknown mask is looked up.
        """
        if self._plugins_loaded:
            return
        with self._plugin_lock:  # other threads wait here until every plugin is in
            if self._plugins_loaded or self._plugins_loading:  # loading: a plugin's own lookup re-entered
                return
            self._plugins_loading = True
            try:
                from importlib.metadata import entry_points

                for ep in entry_points(group=ENTRY_POINT_GROUP):
                    try:
                        loaded = ep.load()
                        _register_plugin_result(loaded() if callable(loaded) else loaded)
                    except (Exception, SystemExit) as exc:  # one broken plugin must not take the others (or the process) down
                        self.plugin_errors[ep.name] = f"{ep.value}: {type(exc).__name__}: {exc}"
                        log.warning("mask plugin %r (%s) failed to load: %s: %s", ep.name, ep.value,
                                    type(exc).__name__, exc)
            finally:
                self._plugins_loading = False
                self._plugins_loaded = True

    def get(self, name: str) -> MaskDef:
        self._scan_env()
        mask = self._masks.get(name)
        if mask is None:  # plugins load on the first miss: looking up a built-in never imports them
            self.load_plugins()
            mask = self._masks.get(name)
        if mask is None:
            accepted = ", ".join(sorted(self._masks)) + " (or a mask added with register_mask)"
            if self.plugin_errors:
                accepted += " (mask plugins that failed to load: " + "; ".join(
                    f"{k}: {v}" for k, v in self.plugin_errors.items()) + ")"
            folder_error = self.template_folder_error()
            if folder_error is not None:
                accepted += f" (template folders that failed to load: {folder_error})"
            raise SpecError("mask", name, accepted + did_you_mean(name, self._masks))
        return mask

    def names(self) -> Iterable[str]:
        """Every registered name; raises TemplateFolderError while a FLASHJIT_TEMPLATE_PATH folder is bad
        (a listing without that folder's masks would be wrong)."""
        self.load_plugins()
        self._scan_env()
        folder_error = self.template_folder_error()
        if folder_error is not None:
            raise folder_error
        return list(self._masks)

    def is_template_file(self, path) -> bool:
        """Whether ``path`` (links resolved) is the template file of a registered mask."""
        real = os.path.realpath(path)
        with self._lock:
            files = [m.template for m in self._masks.values() if os.path.isabs(m.template)]
        return any(os.path.realpath(file) == real for file in files)

    def __contains__(self, name) -> bool:
        try:
            self.get(name)
        except SpecError:
            return False
        return True


def _register_plugin_result(result) -> None:
    """Register what a flashjit.masks entry point returned (see MaskRegistry.load_plugins)."""
    if result is None:
        return
    if isinstance(result, (MaskDef, dict)):
        result = [result]
    for item in result:
        if isinstance(item, MaskDef):
            item = {f.name: getattr(item, f.name) for f in dataclasses.fields(MaskDef)}
        if not isinstance(item, dict):
            raise SpecError("mask plugin result", item, "None, a MaskDef, a dict of register_mask keywords, "
                                                        "or a list of those")
        item = dict(item)
        register_mask(item.pop("name"), template=item.pop("template"), **item)


def _is_package_template(template: str) -> bool:
    """A built-in's template is a name under the package's templates/; a user mask's is an absolute path."""
    return not os.path.isabs(template)


def _params_from_header(text: str) -> dict[str, str]:
    match = _HEADER.search(text[:_HEADER_CHARS])
    if not match:
        return {}
    params = {}
    for item in match.group("params").split():
        name, _, kind = item.partition(":")
        if name in params:
            raise SpecError("mask params", name, "each name once")
        params[name] = kind or "int"
    return params


def _folder_masks(folder, field: str) -> list[tuple[str, Path, tuple[MaskParam, ...]]]:
    """(name, path, params) of each mask template in a folder; TemplateFolderError names what is wrong.

    Only regular files inside the folder count: a link out of it could paste any readable file into
    the kernel source, the cache and exported bundles, and a FIFO would block the reader.
    """
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise TemplateFolderError(field, folder, f"{folder} is not an existing folder")
    for listed in (folder, folder / "masks"):  # glob() takes a folder it cannot list for an empty one
        try:
            os.listdir(listed)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise TemplateFolderError(field, folder, f"{listed} cannot be listed ({exc.strerror or exc}): its masks "
                                                     "would be missing; give this user read access to it") from None
    found = []
    for path in sorted(list(folder.glob("*.cuh.j2")) + list(folder.glob("masks/*.cuh.j2"))):
        name = path.name.removesuffix(".cuh.j2")
        if name == "base" or not _NAME.fullmatch(name):
            continue
        real = path.resolve()
        if not real.is_relative_to(folder):
            raise TemplateFolderError(field, folder, f"{path} links to {real}, outside the folder")
        if not real.is_file():
            raise TemplateFolderError(field, folder, f"{path} is not a regular file")
        try:
            with open(real, encoding="utf-8") as file:
                params = _parse_params(_params_from_header(file.read(_HEADER_CHARS)))
        except (OSError, UnicodeDecodeError) as exc:
            raise TemplateFolderError(field, folder, f"{path} cannot be read: {type(exc).__name__}: {exc}") from exc
        except SpecError as exc:
            raise TemplateFolderError(field, folder, f"{path}: bad params header: {exc}") from exc
        found.append((name, path, params))
    return found


# ---- built-in masks -------------------------------------------------------------------------

masks = MaskRegistry()
masks.register("none", "masks/none.cuh.j2")


def _register_mask_modules():
    """The other built-ins, each a module of its own: MASK, PARAMS, and the hooks it has (kv_span,
    reference, sample_params; DEVICE_SPAN where the GPU planner computes its spans)."""
    from . import block_sparse, causal, key_range, sink_window, sliding_window, tree

    for module in (causal, sliding_window, block_sparse, tree, sink_window, key_range):
        masks.register(module.MASK, f"masks/{module.MASK}.cuh.j2", module.PARAMS or None,
                       kv_span=getattr(module, "kv_span", None), reference=module.reference,
                       sample_params=getattr(module, "sample_params", None),
                       device_span=getattr(module, "DEVICE_SPAN", False))


_register_mask_modules()


def register_mask(name: str, template_path=None, params=None, *, template=None, kv_span=None, reference=None,
                  sample_params=None, device_span: bool = False, replace: bool = False) -> MaskDef:
    """Add a mask type: a template file extending masks/base.cuh.j2, plus its runtime params.

    The template file is ``template=`` (or the second positional argument).
    ``params`` maps parameter names to kinds ('int', 'float', 'int_tensor'), or lists int names.
    kv_span, reference, sample_params and device_span are described on MaskDef and in docs/masks.md.
    """
    if template is not None and template_path is not None and Path(template) != Path(template_path):
        raise SpecError("template", str(template), f"one template (template_path={str(template_path)!r} differs)")
    given, field = (template, "template") if template is not None else (template_path, "template_path")
    if given is None:
        raise SpecError("template", None, "the path of a .cuh.j2 file (register_mask(name, template=PATH))")
    path = Path(given).expanduser().resolve()
    if not path.is_file():
        raise SpecError(field, str(given), "an existing .cuh.j2 file")
    return masks.register(name, path, params, kv_span=kv_span, reference=reference, sample_params=sample_params,
                          device_span=device_span, replace=replace)
