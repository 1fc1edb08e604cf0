"""The package's layers import downward only: foundation < masks, worklist < jit < kernels < serving
< parallel, compat < integrations < deploy.

Read from each module's source (ast), so a function-local import counts as much as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashjit"
# Rank of each layer; a module may import its own layer and any of lower rank.
LAYERS = {"foundation": 0, "masks": 1, "worklist": 1, "jit": 2, "kernels": 3, "serving": 4, "parallel": 5, "compat": 5,
          "integrations": 6, "deploy": 7, "top": 8}
TOP_MODULES = {"__init__", "__main__"}


def layer_of(module: str) -> str:
    """The layer of a dotted module name under flashjit ("flashjit.jit.engine" -> "jit")."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in TOP_MODULES:
        return "top"
    return parts[0] if parts[0] in LAYERS and len(parts) > 1 else "foundation"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts)


def imported_modules(source: str, name: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every flashjit module that the source of module `name` imports,
    relative imports resolved."""
    package = name[: -len(".__init__")] if name.endswith(".__init__") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "flashjit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flashjit":
                continue
            if node.module is None or target.count(".") == 0 or layer_of(target) == "top":
                # `from . import x` / `from .. import x`: each name is a module of that package
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_known_layer():
    for path in MODULES:
        parts = path.relative_to(PACKAGE).parts
        assert len(parts) == 1 or parts[0] in LAYERS, f"{path}: folder {parts[0]!r} is not a layer in {LAYERS}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = LAYERS[layer_of(module_name(path))]
    upward = [f"line {line}: {target} ({layer_of(target)})" for line, target in imported_modules(path.read_text(), module_name(path))
              if LAYERS[layer_of(target)] > own]
    assert not upward, f"{path.relative_to(PACKAGE)} ({layer_of(module_name(path))}) imports a higher layer: {upward}"


def test_the_checker_resolves_every_import_form():
    source = ("from .cache import KernelCache\nfrom ..errors import SpecError\nfrom .. import validation\n"
              "def f():\n    from ..serving.batch_decode import BatchDecode\n    import flashjit.deploy.cli\n")
    imports = [target for _, target in imported_modules(source, "flashjit.jit.engine")]
    assert imports == ["flashjit.jit.cache", "flashjit.errors", "flashjit.validation",
                       "flashjit.serving.batch_decode", "flashjit.deploy.cli"]
    assert [layer_of(t) for t in imports] == ["jit", "foundation", "foundation", "serving", "deploy"]
