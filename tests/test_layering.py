"""The package's layers import downward only: foundation < masks, worklist < jit < kernels < serving
< parallel, compat < integrations < deploy. Beyond the order: jit/ names no kernel family, the
work-list floor stands on the foundation alone, and no function-local import closes a cycle.

Read from each module's source (ast), so a function-local import counts as much as a top-level one;
imports under `if TYPE_CHECKING:` run only in type checkers, and count for none of these rules.
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


def _type_checking_only(tree) -> set[int]:
    """The ids of the import nodes under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped |= {id(inner) for inner in ast.walk(node)}
    return skipped


def imported_modules(source: str, name: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every flashjit module that the source of module `name` imports,
    relative imports resolved."""
    package = name[: -len(".__init__")] if name.endswith(".__init__") else name.rpartition(".")[0]
    found = []
    tree = ast.parse(source)
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


FOUNDATION_MODULES = {"flashjit." + p.stem for p in PACKAGE.glob("*.py")} - {"flashjit.__init__", "flashjit.__main__"}
FAMILY_SPECS = ("DecodeSpec", "MLASpec", "MergeSpec")


def _imports(folder: str):
    """(module, line, imported module) of every import in the modules of one folder of flashjit."""
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        name = module_name(path)
        for line, target in imported_modules(path.read_text(), name):
            yield name, line, target


def test_jit_is_family_blind():
    """jit/ imports no kernel family and nothing that serves them, and names no family's spec:
    families reach the engine through jit/family.py's registry."""
    wrong = [f"{name}:{line} imports {target}" for name, line, target in _imports("jit")
             if layer_of(target) in ("kernels", "serving")]
    assert not wrong
    named = [f"{path.name}: {spec}" for path in sorted((PACKAGE / "jit").glob("*.py"))
             for spec in FAMILY_SPECS if spec in path.read_text()]
    assert not named


def test_the_work_list_floor_stands_on_the_foundation_alone():
    wrong = [f"{name}:{line} imports {target}" for name, line, target in _imports("worklist")
             if layer_of(target) != "worklist" and target not in FOUNDATION_MODULES]
    assert not wrong


def _module_of(target: str, names: set[str]) -> str | None:
    """The module an import names: itself, its package's __init__, or (from a module import a name) that module."""
    while target:
        for candidate in (target, target + ".__init__"):
            if candidate in names:
                return candidate
        target = target.rpartition(".")[0]
    return None


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(module -> the modules it imports, the function-local imports as (module, line, imported))."""
    names = {module_name(path) for path in MODULES}
    graph: dict[str, set[str]] = {}
    local = []
    for path in MODULES:
        name, tree = module_name(path), ast.parse(path.read_text())
        top_level = {node.lineno for statement in tree.body for node in ast.walk(statement)
                     if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and isinstance(node, (ast.Import, ast.ImportFrom))}
        for line, target in imported_modules(path.read_text(), name):
            module = _module_of(target, names)
            if module is None or module == name:
                continue
            graph.setdefault(name, set()).add(module)
            if line not in top_level:
                local.append((name, line, module))
    return graph, local


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        module = stack.pop()
        if module == goal:
            return True
        if module not in seen:
            seen.add(module)
            stack.extend(graph.get(module, ()))
    return False


def test_no_function_local_import_closes_a_cycle():
    """A late import that the imported module's own imports lead back from hides a cycle: the
    layers would still be a tangle, only one the import system does not see at start-up."""
    graph, local = import_graph()
    assert local  # the checker sees them (the CLI imports its commands late)
    cycles = [f"{name}:{line} imports {module}, which imports {name} back" for name, line, module in local
              if _reaches(graph, module, name)]
    assert not cycles


def test_the_cycle_check_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert not _reaches(graph, "c", "a")
    graph["c"].add("a")
    assert _reaches(graph, "c", "a")
