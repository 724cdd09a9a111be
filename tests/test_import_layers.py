"""Imports go one way: cli -> web -> pipeline -> kernels/ext -> envs, and no module imports itself in a circle.

The command line (``cli/``) sits above the HTTP server (``web/``) and the engine (``pipeline/``); the engine sits above
the Triton kernels (``kernels/``) and the Cython loops (``ext/``); ``envs/``, the environment switches, is a leaf every
layer may read. A module may import its own layer and the layers below it, never one above, whether the import runs at
load, inside a function or only under ``TYPE_CHECKING`` (each is a dependency a reader and a type checker follow).

The graph is read from the source with ``ast`` (``.pyx`` files by their import lines): nothing is imported, so the
check is a parse of each file and runs without torch.
"""
from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a top-level package's layer: it may import packages of its own layer or of a lower one
LAYERS = {"cli": 4, "web": 3, "pipeline": 2, "kernels": 1, "ext": 1, "envs": 0}
AT_LOAD, TYPE_CHECKING, DEFERRED = "at load", "under TYPE_CHECKING", "inside a function"
# Cython's import statements at the start of a line (indented ones run inside a function)
PYX_IMPORT = re.compile(r"^(?P<indent>\s*)(?:from\s+(?P<source>[\w.]+)\s+c?import\s+(?P<names>[\w\s,()*]+)"
                        r"|c?import\s+(?P<modules>[\w.]+(?:\s*,\s*[\w.]+)*))")


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # dotted module names
    imported: str
    path: str  # the importer's file, relative to the root
    line: int
    kind: str  # AT_LOAD, TYPE_CHECKING or DEFERRED

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def package_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the layered packages: dotted name -> (file, is a package's __init__)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for package in LAYERS:
        if (root / f"{package}.py").is_file():
            modules[package] = (root / f"{package}.py", False)
        if not (root / package).is_dir():
            continue
        for path in sorted((root / package).rglob("*")):
            if path.suffix not in (".py", ".pyx") or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement of a module and when it runs."""
    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, DEFERRED)
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and kind == AT_LOAD:
                for statement in child.body:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), TYPE_CHECKING)
                for statement in child.orelse:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)
    yield from walk(tree, AT_LOAD)


def _pyx_statements(text: str) -> Iterator[tuple[int, str | None, list[str], str]]:
    """(line, the ``from`` module or None, the names imported, when it runs) of each import line of a .pyx file."""
    for number, line in enumerate(text.splitlines(), start=1):
        match = PYX_IMPORT.match(line)
        if match is None:
            continue
        kind = DEFERRED if match["indent"] else AT_LOAD
        if match["source"] is not None:
            names = [name.strip() for name in match["names"].strip("() \t").split(",")]
            yield number, match["source"], [name.split()[0] for name in names if name], kind
        else:
            yield number, None, [name.strip() for name in match["modules"].split(",")], kind


def _targets(modules: dict, importer: str, is_init: bool, source: str | None, names: Iterable[str],
             level: int = 0) -> Iterator[str]:
    """The package modules one statement names: the module itself or, for ``from m import name``, the submodule
    ``m.name`` where there is one."""
    if level:
        base = importer.split(".") if is_init else importer.split(".")[:-1]
        base = base[:len(base) - (level - 1)]
        source = ".".join(base + ([source] if source else []))
    for name in names:
        full = f"{source}.{name}" if source else name
        parts = (full if full in modules or source is None else source).split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts and ".".join(parts) != importer:
            yield ".".join(parts)


def _loaded_packages(importer: str, imported: str) -> Iterator[str]:
    """The module an import names and the packages above it that loading it runs (those the importer is not in)."""
    parts = imported.split(".")
    for depth in range(len(parts), 0, -1):
        target = ".".join(parts[:depth])
        if not (importer == target or importer.startswith(target + ".")):
            yield target


def module_imports(root: Path = ROOT) -> list[Import]:
    """Every import from one layered module of ``root`` to another."""
    modules = package_modules(root)
    found: set[Import] = set()
    for importer, (path, is_init) in modules.items():
        relative = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".pyx":
            for line, source, names, kind in _pyx_statements(text):
                found.update(Import(importer, target, relative, line, kind)
                             for target in _targets(modules, importer, is_init, source, names))
            continue
        for statement, kind in _statements(ast.parse(text, filename=relative)):
            if isinstance(statement, ast.Import):
                targets = _targets(modules, importer, is_init, None, [alias.name for alias in statement.names])
            else:
                targets = _targets(modules, importer, is_init, statement.module,
                                   [alias.name for alias in statement.names], statement.level)
            found.update(Import(importer, target, relative, statement.lineno, kind) for target in targets)
    return sorted(found, key=lambda edge: (edge.path, edge.line, edge.imported))


def upward_imports(imports: Iterable[Import]) -> list[str]:
    """Each import of a higher layer, in words."""
    problems = []
    for edge in imports:
        source, target = edge.importer.split(".")[0], edge.imported.split(".")[0]
        if LAYERS[target] > LAYERS[source]:
            allowed = ", ".join(name for name, layer in LAYERS.items() if layer <= LAYERS[source])
            problems.append(f"{edge.where()} imports {edge.imported} {edge.kind}: {source} may import only "
                            f"{allowed}")
    return problems


def import_cycles(imports: Iterable[Import]) -> list[str]:
    """Each circle of module-level imports (at load or under TYPE_CHECKING), as one path around it.

    An import inside a function does not count: it runs when the function is first called, after both modules have
    finished loading, so it can never meet a half-initialised module, and the kernels use it to load a Triton
    implementation only on the path that runs it. A type-checking import counts: it never runs, but it is a
    dependency all the same, and a circle through it is two modules that each need the other to be understood."""
    graph: dict[str, dict[str, Import]] = {}
    for edge in imports:
        if edge.kind != DEFERRED:
            for target in _loaded_packages(edge.importer, edge.imported):
                graph.setdefault(edge.importer, {}).setdefault(target, edge)
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            cycles.append(_one_cycle(graph, component))
    return cycles


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's components, iteratively (a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, {})))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def _one_cycle(graph: dict[str, dict[str, Import]], component: set[str]) -> str:
    """The shortest path from the component's first module back to itself, each step with its import's line."""
    start = min(component)
    previous: dict[str, Import] = {}  # module -> the import that reached it first
    frontier = [start]
    while frontier and start not in previous:
        following = []
        for node in frontier:
            for target, edge in sorted(graph.get(node, {}).items()):
                if target in component and target not in previous:
                    previous[target] = edge
                    following.append(target)
        frontier = following
    steps = []
    node = start
    while True:
        edge = previous[node]
        steps.append(f"{edge.importer} ({edge.where()}, {edge.kind}) -> {node}")
        node = edge.importer
        if node == start:
            return "; ".join(reversed(steps))


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return module_imports()


def test_every_packaged_top_level_package_has_a_layer() -> None:
    """A new package is placed in a layer before it ships, so nothing it imports goes unchecked."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packaged = {pattern.rstrip("*") for pattern in find["include"]}
    assert packaged == {name for name in LAYERS if (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()}


def test_the_graph_is_read(imports: list[Import]) -> None:
    edges = {(edge.importer, edge.imported, edge.kind) for edge in imports}
    assert ("pipeline.engine", "pipeline.config", AT_LOAD) in edges
    assert ("web.serve", "pipeline.engine", AT_LOAD) in edges
    assert {edge.importer.split(".")[0] for edge in imports} >= {"cli", "web", "pipeline", "kernels"}


def test_no_module_imports_a_higher_layer(imports: list[Import]) -> None:
    problems = upward_imports(imports)
    assert not problems, "imports against the layers (cli -> web -> pipeline -> kernels/ext -> envs):\n" + "\n".join(
        problems)


def test_no_import_cycles(imports: list[Import]) -> None:
    cycles = import_cycles(imports)
    assert not cycles, "module-level import cycles (move the shared names to a module both sides import):\n" + (
        "\n".join(cycles))


def test_the_checks_find_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks on a small tree that breaks each rule, in each way an import can be written."""
    files = {
        "kernels/__init__.py": "",
        "kernels/ops.py": "import web\n",
        "kernels/lazy.py": "def f():\n    from pipeline.engine import Engine\n",
        "kernels/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline import engine\n",
        "ext/__init__.py": "",
        "ext/loop.pyx": "cimport numpy as cnp\nfrom web.app cimport thing\n",
        "web/__init__.py": "",
        "web/app.py": "from . import routes\n",
        "web/routes.py": "from web.app import STATE\n",
        "pipeline/__init__.py": "",
        "pipeline/engine.py": "from pipeline import stages\nimport kernels.ops\n",
        "pipeline/stages.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.engine\n"
                              "def later():\n    import pipeline.deferred\n",
        "pipeline/deferred.py": "import pipeline.stages\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = module_imports(tmp_path)
    upward = upward_imports(found)
    assert [problem.split(":")[0] for problem in upward] == ["ext/loop.pyx", "kernels/lazy.py", "kernels/ops.py",
                                                              "kernels/typed.py"]
    assert "imports web.app at load" in upward[0] and "imports web at load" in upward[2]
    assert "inside a function" in upward[1] and "under TYPE_CHECKING" in upward[3]
    cycles = import_cycles(found)
    assert len(cycles) == 2, cycles
    assert any("pipeline.engine (pipeline/engine.py:1, at load) -> pipeline.stages" in cycle
               and "under TYPE_CHECKING" in cycle for cycle in cycles)
    assert any("web/app.py:1" in cycle and "web/routes.py:1" in cycle for cycle in cycles)
    assert not any("pipeline.deferred" in cycle for cycle in cycles)  # its circle closes inside a function


# ---- pipeline/models: families compose shared layers, never each other ----
MODELS = "pipeline.models"
FAMILIES = "pipeline.models.families"  # one module per model family (pipeline/models/registry.py lists them)
REGISTRY = "pipeline.models.registry"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_family(module: str) -> bool:
    return _within(module, FAMILIES) and module != FAMILIES


def family_imports(imports: Iterable[Import]) -> list[str]:
    """Each import of a family module by another family, or by a shared module of pipeline/models (everything
    there but the families and the registry that lists them), in words."""
    problems = []
    for edge in imports:
        if not _is_family(edge.imported):
            continue
        if _is_family(edge.importer):
            problems.append(f"{edge.where()}: family {edge.importer} imports family {edge.imported} {edge.kind}; "
                            "move what both need into a shared layer of pipeline/models")
        elif _within(edge.importer, MODELS) and not _within(edge.importer, FAMILIES) and edge.importer != REGISTRY:
            problems.append(f"{edge.where()}: shared module {edge.importer} imports family {edge.imported} "
                            f"{edge.kind}; a shared layer knows no family")
    return problems


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_names_across_modules(root: Path = ROOT, package: str = MODELS) -> list[str]:
    """Each ``_private`` name a module of ``package`` takes from another module of the layered packages: imported
    by name (``from m import _name``) or read off an imported module or class (``m._name``, ``Cls._name``)."""
    modules = package_modules(root)
    problems = []
    for importer, (path, is_init) in modules.items():
        if not _within(importer, package) or path.suffix != ".py":
            continue
        relative = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=relative)
        bound: dict[str, str] = {}  # a local name -> the module it came from
        for statement, _ in _statements(tree):
            if isinstance(statement, ast.ImportFrom):
                base = importer.split(".") if is_init else importer.split(".")[:-1]
                source = (".".join(base[:len(base) - (statement.level - 1)] +
                                   ([statement.module] if statement.module else []))
                          if statement.level else statement.module or "")
                if source.split(".")[0] not in LAYERS or source == importer:
                    continue
                for alias in statement.names:
                    if _is_private(alias.name):
                        problems.append(f"{relative}:{statement.lineno} imports {source}.{alias.name}")
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
            else:
                for alias in statement.names:
                    if alias.name.split(".")[0] in LAYERS and alias.name != importer:
                        bound[alias.asname or alias.name] = alias.name
                        if alias.asname is None:  # ``import a.b`` binds ``a``, read as ``a.b.name``
                            bound[alias.name] = alias.name
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            owner = _dotted(node.value)
            if owner is not None and owner in bound:
                problems.append(f"{relative}:{node.lineno} reads {bound[owner]}.{node.attr}")
    return sorted(problems)


def test_no_family_imports_another(imports: list[Import]) -> None:
    problems = family_imports(imports)
    assert not problems, "a model family composes shared layers and imports no other family:\n" + "\n".join(
        problems)


def test_no_private_name_crosses_the_model_modules() -> None:
    problems = private_names_across_modules()
    assert not problems, "private names taken from another module (make them public or move them):\n" + (
        "\n".join(problems))


def test_the_family_checks_find_each_breach(tmp_path: Path) -> None:
    """The checks on a small tree: a family importing a family, a shared layer importing one, private names
    taken by import and by attribute; the registry importing families and a module's own private names pass."""
    files = {
        "pipeline/__init__.py": "",
        "pipeline/models/__init__.py": "",
        "pipeline/models/layers.py": "_SCALE = 2\nclass Norm:\n    _eps = 1\n",
        "pipeline/models/shared.py": "from pipeline.models.families import dense\n",
        "pipeline/models/registry.py": "from pipeline.models.families.dense import Dense\n",
        "pipeline/models/families/__init__.py": "",
        "pipeline/models/families/dense.py": "from pipeline.models.layers import Norm\n_OWN = 1\n"
                                             "class Dense:\n    eps = Norm._eps\n    own = _OWN\n",
        "pipeline/models/families/sparse.py": "from ..layers import _SCALE\nfrom . import dense\n"
                                              "import pipeline.models.layers\n"
                                              "def f():\n    return pipeline.models.layers._SCALE\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = family_imports(module_imports(tmp_path))
    assert [problem.split(":")[0] for problem in found] == ["pipeline/models/families/sparse.py",
                                                            "pipeline/models/shared.py"], found
    assert "family pipeline.models.families.sparse imports family pipeline.models.families.dense" in found[0]
    assert "shared module pipeline.models.shared imports family" in found[1]
    private = private_names_across_modules(tmp_path)
    assert private == ["pipeline/models/families/dense.py:4 reads pipeline.models.layers.Norm._eps",
                       "pipeline/models/families/sparse.py:1 imports pipeline.models.layers._SCALE",
                       "pipeline/models/families/sparse.py:5 reads pipeline.models.layers._SCALE"], private
