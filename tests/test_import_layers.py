"""The package imports only downward (docs/architecture.md, "Import layers").

Every module under ``fastdeploy_kvcache/`` is parsed (``ast``, no import runs) and each of
its imports, at module level or inside a function, is mapped to the top-level unit it
names (``core``, ``storage``, ``envs``...).  An import from a unit on a higher layer than
the importer's is a violation, and so is any cycle between units.  Imports under ``if
TYPE_CHECKING:`` are annotations only and never run, so they are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

PACKAGE = "fastdeploy_kvcache"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Lower number = lower layer.  A unit may import units of its own layer's number or below
# (units sharing a number must not import each other in a cycle: checked separately).
LAYERS: dict[str, int] = {
    "__init__": 0,
    "config": 0,
    "envs": 0,
    "libpaths": 0,
    "processes": 0,
    "cli_flags": 0,
    "core": 1,
    "ops": 2,
    "storage": 3,
    "worker": 4,
    "engine": 5,
    "entrypoints": 6,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(imported module, line) of every import that can run, at any depth."""
    package = module if is_package else module.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base: Optional[str] = node.module
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base == PACKAGE:  # from fastdeploy_kvcache import ops, envs
                for alias in node.names:
                    yield f"{PACKAGE}.{alias.name}", node.lineno
            elif base:
                yield base, node.lineno
        stack.extend(ast.iter_child_nodes(node))


def _edges() -> list[tuple[str, str, str, int]]:
    """(importer unit, imported unit, file, line) for every import across units."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for name, line in _imports(tree, module, path.name == "__init__.py"):
            if name.split(".")[0] != PACKAGE:
                continue
            src, dst = _unit(module), _unit(name)
            if src != dst:
                edges.append((src, dst, str(path.relative_to(ROOT.parent)), line))
    return edges


def _cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> Optional[list[str]]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_every_unit_has_a_layer() -> None:
    """A new top-level module or package must be placed in LAYERS (and in the doc)."""
    units = {_unit(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert units - set(LAYERS) == set(), "place these in LAYERS and docs/architecture.md"


def test_no_import_goes_up_a_layer() -> None:
    upward = [f"{file}:{line}: {src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]})"
              for src, dst, file, line in _edges() if LAYERS[dst] > LAYERS[src]]
    assert upward == []


def test_no_cycle_between_units() -> None:
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in _edges():
        graph.setdefault(src, set()).add(dst)
    assert _cycle(graph) is None


@pytest.mark.parametrize("graph, want", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}}, None),
])
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], want: Optional[list[str]]) -> None:
    assert _cycle(graph) == want


def test_the_parser_sees_function_level_and_relative_imports_and_skips_type_checking() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..storage import base\n"
        "if TYPE_CHECKING:\n"
        "    from fastdeploy_kvcache.engine import args\n"
        "def f():\n"
        "    import fastdeploy_kvcache.entrypoints.cli\n"
        "    from fastdeploy_kvcache import envs\n"
    )
    found = {name for name, _ in _imports(ast.parse(source), f"{PACKAGE}.core.x", False)}
    # "from . import sibling" names the package it comes from, which is all the unit needs.
    assert found == {"typing", f"{PACKAGE}.core", f"{PACKAGE}.storage", f"{PACKAGE}.entrypoints.cli",
                     f"{PACKAGE}.envs"}


def _module_edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth, TYPE_CHECKING left out).

    ``from package import name`` counts as an import of ``package.name`` when that is a module.
    """
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets = graph.setdefault(module, set())
        for name, _ in _imports(tree, module, is_package):
            if name in paths and name != module:
                targets.add(name)
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):  # the submodules named by "from package import name"
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in paths and sub != module:
                        targets.add(sub)
    return graph


def test_no_import_cycle_between_the_server_modules() -> None:
    """Within entrypoints/openai no module imports one that imports it back (at any depth):
    shared bases live in a module of their own (``section_collector.py``)."""
    prefix = f"{PACKAGE}.entrypoints.openai."
    graph = {m: {d for d in deps if d.startswith(prefix)} for m, deps in _module_edges().items()
             if m.startswith(prefix)}
    assert _cycle(graph) is None


# Inside engine/ each runner package owns its libraries: Paddle's may be imported at module
# level only under paddleformers_runner/, torch's only under transformers_runner/ (anywhere
# else, inside the function that needs them), and neither runner package imports the other.
RUNNER_LIBRARIES: dict[str, tuple[str, ...]] = {
    f"{PACKAGE}.engine.paddleformers_runner": ("paddle", "paddleformers"),
    f"{PACKAGE}.engine.transformers_runner": ("torch", "transformers", "triton"),
}


def _module_level_imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(top-level name, line) of every absolute import that runs when the module is imported:
    function bodies and ``if TYPE_CHECKING:`` blocks are left out."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0], node.lineno
        stack.extend(ast.iter_child_nodes(node))


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_model_libraries_are_imported_at_module_level_only_by_their_runner_package() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for name, line in _module_level_imports(tree):
            for owner, libraries in RUNNER_LIBRARIES.items():
                if name in libraries and not _in_package(module, owner):
                    wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: imports {name} (owned by {owner})")
    assert wrong == []


def test_the_runner_packages_do_not_import_each_other() -> None:
    crossing = []
    for src, dst in [tuple(RUNNER_LIBRARIES), tuple(reversed(list(RUNNER_LIBRARIES)))]:
        for module, deps in _module_edges().items():
            if _in_package(module, src):
                crossing += [f"{module} imports {d}" for d in deps if _in_package(d, dst)]
    assert crossing == []


def test_module_level_imports_leave_out_function_bodies_and_type_checking() -> None:
    source = (
        "import torch.nn\n"
        "from paddle import nn\n"
        "from . import sibling\n"
        "try:\n"
        "    import triton\n"
        "except ImportError:\n"
        "    pass\n"
        "if TYPE_CHECKING:\n"
        "    import transformers\n"
        "class A:\n"
        "    import numpy\n"
        "    def f(self):\n"
        "        import paddleformers\n"
    )
    assert {name for name, _ in _module_level_imports(ast.parse(source))} == {"torch", "paddle", "triton", "numpy"}
