"""Render a DecodeSpec to one self-contained CUDA source with Jinja2.

Headers are pasted verbatim by `{{ header(name) }}`, so the rendered text alone determines the compiled code
(and so the cache key). Templates render in a sandboxed environment with StrictUndefined: user
mask templates cannot reach Python internals, and a typo is an error naming file and line.

What a template may load (include, extends, import, header) is confined to the template roots:
relative names resolve under the package's templates/ only, and an absolute path loads only when it
is the template file of a registered mask or variant. Anything else would land, verbatim, in the kernel
source, the cache's source.cu and every exported bundle.
"""

from __future__ import annotations

import hashlib
import os
import traceback
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from .._version import __version__
from ..errors import TemplateError
from ..masks.registry import MaskDef, masks
from ..masks.variants import VariantDef, variants
from . import abi
from .merge_spec import MAX_LANES, MergeSpec
from .mla_spec import MLASpec
from .mla_tiling import MLATiling, mla_tiling
from .spec import DecodeSpec
from .tiling import DecodeTiling, decode_tiling

ENTRY_TEMPLATE = "decode/paged.cu.j2"
MLA_ENTRY_TEMPLATE = "mla/decode.cu.j2"
MERGE_STATES_TEMPLATE = "merge/merge_states.cu.j2"
MERGE_STATE_TYPES = {"float16": "fj::half_t", "bfloat16": "fj::bfloat16_t", "float32": "float"}
STORAGE_TYPES = {"float16": "half_t", "bfloat16": "bfloat16_t", "float8_e4m3fn": "e4m3_t", "float8_e5m2": "e5m2_t"}


def template_root() -> Path:
    """templates/ inside the installed package, else the source checkout's top-level folder."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / ENTRY_TEMPLATE).is_file():
            return candidate
    raise TemplateError(f"flashjit templates not found next to {package}; reinstall flashjit")


class OutsideTemplateRoots(jinja2.TemplateNotFound):
    """A template named a file outside the template roots."""


class _TemplateLoader(jinja2.BaseLoader):
    """Relative names from the package's templates/; absolute paths only for registered mask and variant templates."""

    def __init__(self, root: Path):
        self._package = jinja2.FileSystemLoader(str(root))  # refuses '..' and names that leave root

    def get_source(self, environment, name):
        if not isinstance(name, str):  # header(42), header(an_undefined_name)
            raise jinja2.TemplateNotFound(repr(name))
        if not os.path.isabs(name):
            return self._package.get_source(environment, name)
        if not masks.is_template_file(name) and not variants.is_template_file(name):
            raise OutsideTemplateRoots(name)
        path = Path(name)
        if not path.is_file():
            raise jinja2.TemplateNotFound(name)
        mtime = path.stat().st_mtime
        return path.read_text(), str(path), lambda: path.exists() and path.stat().st_mtime == mtime


@lru_cache(maxsize=1)
def environment() -> SandboxedEnvironment:
    loader = _TemplateLoader(template_root())
    env = SandboxedEnvironment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                               autoescape=False)
    # CUDA headers are pasted verbatim, not parsed: inline PTX such as "{%0, %1}" is not Jinja.
    env.globals["header"] = lambda name: loader.get_source(env, name)[0]
    return env


def _template_location(exc: BaseException) -> str:
    """'file:line' of the innermost template frame of a Jinja2 error."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"{exc.filename or exc.name}:{exc.lineno}"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.endswith((".j2", ".cuh", ".cu")):
            return f"{frame.filename}:{frame.lineno}"
    return "<unknown template>"


_file_digests: dict = {}


def _file_digest(path: Path) -> str:
    stat = path.stat()
    memo = (str(path), stat.st_mtime_ns, stat.st_size)
    if memo not in _file_digests:
        _file_digests[memo] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _file_digests[memo]


def templates_digest(mask: MaskDef | None, variant: VariantDef | None = None) -> str:
    """Digest of every template file a spec can render from (package templates + a user mask or
    variant file; mask None: a spec without a mask, such as MergeSpec).

    Lets the cache find a compiled kernel without rendering; any template edit changes it.
    """
    root = template_root()
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".j2", ".cuh", ".cu"):
            h.update(str(path.relative_to(root)).encode() + b"\0" + _file_digest(path).encode())
    if mask is not None and os.path.isabs(mask.template):
        h.update(b"mask\0" + _file_digest(Path(mask.template)).encode())
    if variant is not None and os.path.isabs(variant.template):
        h.update(b"variant\0" + _file_digest(Path(variant.template)).encode())
    return h.hexdigest()


def render(spec: DecodeSpec | MLASpec, mask: MaskDef | None = None,
           tiling: DecodeTiling | MLATiling | None = None, variant: VariantDef | None = None) -> str:
    """The CUDA source of one specialization, with its ABI checks (abi.source_checks), under
    decode_tiling(spec) (mla_tiling for an MLASpec) unless a tiling is given."""
    mask = mask or masks.get(spec.mask)
    variant = variant or variants.get(spec.variant)
    if isinstance(spec, MLASpec):  # always causal, no variant: its ABI is mla::Args and plan::Args
        entry, tiling = MLA_ENTRY_TEMPLATE, tiling or mla_tiling(spec)
        checks = abi.mla_source_checks()
    else:
        entry, tiling = ENTRY_TEMPLATE, tiling or decode_tiling(spec)
        checks = abi.source_checks(mask.params, merge=not tiling.fused_merge, variant_params=variant.params)
    context = dict(spec=spec, tiling=tiling, mask=mask, variant=variant, ctype=STORAGE_TYPES, version=__version__,
                   item_ints=abi.ITEM_INTS, merge_counts=abi.MERGE_COUNTS, merge_waits=abi.MERGE_WAITS,
                   split_candidates=abi.SPLIT_CANDIDATES, plan_smem_ints=abi.PLAN_SMEM_INTS, abi_checks=checks)
    try:
        return environment().get_template(entry).render(**context)
    except OutsideTemplateRoots as exc:
        raise TemplateError(f"template {exc.name!r} is outside the template roots: templates load package "
                            "templates by relative name and registered mask and variant templates by path "
                            f"(rendering {spec.name}; mask {mask.name!r} uses {mask.template!r}, variant "
                            f"{variant.name!r} uses {variant.template!r})") from exc
    except jinja2.TemplateNotFound as exc:
        raise TemplateError(f"template {exc.name!r} not found (rendering {spec.name}; mask {mask.name!r} "
                            f"uses {mask.template!r}, variant {variant.name!r} uses {variant.template!r})") from exc
    except jinja2.TemplateError as exc:
        raise TemplateError(f"{_template_location(exc)}: {exc.message or exc} (rendering {spec.name})") from exc
    except RecursionError:
        raise TemplateError(f"rendering {spec.name} recursed without end: a template includes or extends itself, or a "
                            f"macro calls itself without stopping (mask {mask.name!r}: {mask.template}; variant "
                            f"{variant.name!r}: {variant.template})") from None


def render_merge_states(spec: MergeSpec) -> str:
    """The CUDA source of the merge_states kernel of one state dtype, with its ABI checks."""
    context = dict(spec=spec, state_type=MERGE_STATE_TYPES[spec.dtype], max_threads=max(128, MAX_LANES),
                   version=__version__, abi_checks=abi.merge_states_checks())
    try:
        return environment().get_template(MERGE_STATES_TEMPLATE).render(**context)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"{_template_location(exc)}: {getattr(exc, 'message', None) or exc} "
                            f"(rendering {spec.name})") from exc
    except RecursionError:
        raise TemplateError(f"rendering {spec.name} from {MERGE_STATES_TEMPLATE} recursed without end") from None
