"""Render a kernel spec to one self-contained CUDA source with Jinja2.

Headers are pasted verbatim by `{{ header(name) }}`, so the rendered text alone determines the
compiled code (and so the cache key). A header's first line names the headers it needs pasted
before it (`//! needs: common/prelude.cuh ...`): header() checks them and leaves that line out of
the source. Templates render in a sandboxed environment with StrictUndefined: user mask templates
cannot reach Python internals, and a typo is an error naming file and line.

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

from ..errors import TemplateError
from ..masks.registry import MaskDef, masks
from ..masks.variants import VariantDef, variants
from .family import family_of

ROOT_MARKER = "masks/base.cuh.j2"  # a file every template root has


def template_root() -> Path:
    """templates/ inside the installed package, else the source checkout's top-level folder."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / ROOT_MARKER).is_file():
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


NEEDS = "//! needs:"  # a header's first line: the headers it needs pasted before it in the source
PASTED = "pasted_headers"  # the render context's list of the headers pasted so far (render_template)


def header_needs(text: str) -> tuple[list[str], str]:
    """(the headers a header's text needs pasted before it, the text it pastes: without that line)."""
    first, newline, rest = text.partition("\n")
    if not first.startswith(NEEDS):
        return [], text
    return first[len(NEEDS):].split(), rest


@lru_cache(maxsize=1)
def environment() -> SandboxedEnvironment:
    loader = _TemplateLoader(template_root())
    env = SandboxedEnvironment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                               autoescape=False)

    @jinja2.pass_context
    def header(context, name):
        """A CUDA header's text, pasted verbatim (not parsed: inline PTX such as "{%0, %1}" is not
        Jinja), after checking that the headers its first line needs were pasted before it."""
        needs, text = header_needs(loader.get_source(env, name)[0])
        pasted = context.get(PASTED)
        if pasted is not None:
            missing = [need for need in needs if need not in pasted]
            if missing:
                raise jinja2.TemplateRuntimeError(f"header {name!r} needs {', '.join(missing)} pasted before it")
            pasted.append(name)
        return text

    env.globals["header"] = header
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
    variant file; mask None: a spec of a family without masks).

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


def render(spec, mask: MaskDef | None = None, tiling=None, variant: VariantDef | None = None) -> str:
    """The CUDA source of one specialization of any family, with its ABI checks, under the family's
    tiling of the spec unless a tiling is given (mask and variant: the spec's where None)."""
    return family_of(spec).render(spec, mask, variant, tiling)


def render_template(entry: str, context: dict, spec, mask: MaskDef | None = None,
                    variant: VariantDef | None = None) -> str:
    """The family's entry template rendered with context; every failure a TemplateError that names
    the template file and line, the spec, and the mask and variant templates it rendered with."""
    using = "" if mask is None else (f"; mask {mask.name!r} uses {mask.template!r}, variant {variant.name!r} uses "
                                     f"{variant.template!r}")
    try:
        return environment().get_template(entry).render(**context, **{PASTED: []})
    except OutsideTemplateRoots as exc:
        raise TemplateError(f"template {exc.name!r} is outside the template roots: templates load package "
                            "templates by relative name and registered mask and variant templates by path "
                            f"(rendering {spec.name}{using})") from exc
    except jinja2.TemplateNotFound as exc:
        raise TemplateError(f"template {exc.name!r} not found (rendering {spec.name}{using})") from exc
    except jinja2.TemplateError as exc:
        raise TemplateError(f"{_template_location(exc)}: {getattr(exc, 'message', None) or exc} "
                            f"(rendering {spec.name})") from exc
    except RecursionError:  # a template that includes or extends itself; the traceback would be thousands of lines
        raise TemplateError(f"rendering {spec.name} from {entry} recursed without end: a template includes or extends "
                            f"itself, or a macro calls itself without stopping{using}") from None
