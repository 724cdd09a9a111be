"""The switch registry (``envs/``) is the only reader of ``CONVEYOR_*`` variables, and every such name the repository
mentions (tests, benchmarks, docs, code) is a switch it holds.

Read from the sources with ``ast`` and a regular expression; nothing is imported but ``envs``. A read is
``os.environ.get / pop / setdefault``, ``os.getenv``, ``os.environ[...]`` in a load, or ``... in os.environ``, on a
``CONVEYOR_`` name (a literal, or a module's name bound to one). Product code (every package but the registry) holds
no ``CONVEYOR_`` literal at all outside its docstrings, so no read there can hide behind a constant either. Setting
a switch, for a child process or in a test, is no read.
"""
from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path

import envs

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pipeline", "kernels", "ext", "web", "cli")
SKIPPED = {"results", "__pycache__", "build", "node_modules"}  # bench/results: records of earlier code, kept as run
MENTIONING = {".py", ".pyx", ".sh", ".md", ".toml", ".jinja"}
MENTIONING_NAMES = frozenset({"Makefile"})
NAME = re.compile(re.escape(envs.PREFIX) + r"[A-Z0-9_]+")
# names in the repository that are no switch of Conveyor's
NOT_SWITCHES = {
    envs.PREFIX + "API_KEY": "the variable a Codex configuration names for the key it sends (docs/agents.md); the "
                             "server takes its key from --api-key",
}
READING_METHODS = {"get", "pop", "setdefault"}


def _sources(root: Path, suffixes: set[str], names: frozenset[str] = frozenset()) -> Iterator[Path]:
    """The repository's files of those suffixes or names, hidden and build folders left out."""
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in SKIPPED
                               and not d.endswith(".egg-info"))
        for name in sorted(files):
            if Path(name).suffix in suffixes or name in names:
                yield Path(folder) / name


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _is_getenv(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv") or (
        isinstance(node, ast.Name) and node.id == "getenv")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of a module and of its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _switch_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(envs.PREFIX)


def environment_reads(tree: ast.AST) -> list[int]:
    """The lines of ``tree`` that read a ``CONVEYOR_`` variable from the environment."""
    bound = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and _switch_literal(node.value)
             for target in node.targets if isinstance(target, ast.Name)}

    def names_a_switch(key: ast.AST) -> bool:
        return _switch_literal(key) or (isinstance(key, ast.Name) and key.id in bound)

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and names_a_switch(node.args[0]):
            func = node.func
            if _is_getenv(func) or (isinstance(func, ast.Attribute) and func.attr in READING_METHODS
                                    and _is_environ(func.value)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value) \
                and names_a_switch(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and names_a_switch(node.left) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(map(_is_environ, node.comparators)):
            lines.append(node.lineno)
    return sorted(lines)


def switch_literals(tree: ast.AST) -> list[int]:
    """The lines of ``CONVEYOR_`` string literals that are no docstring."""
    docstrings = _docstrings(tree)
    return sorted(node.lineno for node in ast.walk(tree) if _switch_literal(node) and id(node) not in docstrings)


def readers(root: Path = ROOT) -> list[str]:
    """Each read of a ``CONVEYOR_`` variable outside the registry, and each such literal in product code."""
    problems = []
    for path in _sources(root, {".py"}):
        relative = path.relative_to(root)
        if relative.parts[0] == "envs":
            continue
        text = path.read_text(encoding="utf-8")
        if envs.PREFIX not in text:  # no literal to read by, nor to bind a name to
            continue
        tree = ast.parse(text, filename=str(relative))
        problems += [f"{relative}:{line} reads a switch from the environment (use envs)"
                     for line in environment_reads(tree)]
        if relative.parts[0] in PRODUCT:
            problems += [f"{relative}:{line} holds a switch's name (use the envs entry's .name)"
                         for line in switch_literals(tree)]
    return sorted(set(problems))


def unknown_names(root: Path = ROOT) -> list[str]:
    """Each ``CONVEYOR_`` name the repository mentions that is no switch of the registry."""
    problems = []
    for path in _sources(root, MENTIONING, MENTIONING_NAMES):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            problems += [f"{path.relative_to(root)}:{number} names {name}, no switch of envs"
                         for name in NAME.findall(line) if name not in envs.SWITCHES and name not in NOT_SWITCHES]
    return problems


def test_the_registry_is_the_only_reader() -> None:
    problems = readers()
    assert not problems, "CONVEYOR_ variables read outside envs/:\n" + "\n".join(problems)


def test_every_named_switch_is_in_the_registry() -> None:
    problems = unknown_names()
    assert not problems, "names of switches that do not exist (remove them, or add the switch to envs/):\n" + (
        "\n".join(problems))


def test_the_checks_find_each_kind_of_read_and_unknown_name(tmp_path: Path) -> None:
    """The checks on a small tree that breaks each rule, in each way a read can be written."""
    switch, gone = envs.PDL.name, envs.PREFIX + "GONE"
    files = {
        "kernels/get.py": f"import os\nON = os.environ.get({switch!r}, '1')\n",
        "kernels/getenv.py": f"from os import getenv\nON = getenv({switch!r})\n",
        "kernels/item.py": f"import os\nON = os.environ[{switch!r}]\n",
        "kernels/held.py": f'"""Docstrings may say {switch}."""\nNAME = {switch!r}\n',
        "tests/test_in.py": f"import os\nNAME = {switch!r}\nON = NAME in os.environ\n",
        "tests/test_bound.py": f"import os\nNAME = {switch!r}\nON = os.environ.pop(NAME)\n",
        "tests/test_sets.py": f"import os\nos.environ[{switch!r}] = '0'\nenv = dict(os.environ, {switch}='0')\n",
        "envs/__init__.py": f"import os\nON = os.environ.get({switch!r})\n",
        "bench/run.sh": f"{gone}=1 python3 bench/gpu.py\n",
        "bench/results/old.md": f"{gone}=1\n",
        "docs/notes.md": f"{switch}=0 turns it off\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert readers(tmp_path) == sorted([
        "kernels/get.py:2 reads a switch from the environment (use envs)",
        "kernels/get.py:2 holds a switch's name (use the envs entry's .name)",
        "kernels/getenv.py:2 reads a switch from the environment (use envs)",
        "kernels/getenv.py:2 holds a switch's name (use the envs entry's .name)",
        "kernels/item.py:2 reads a switch from the environment (use envs)",
        "kernels/item.py:2 holds a switch's name (use the envs entry's .name)",
        "kernels/held.py:2 holds a switch's name (use the envs entry's .name)",
        "tests/test_in.py:3 reads a switch from the environment (use envs)",
        "tests/test_bound.py:3 reads a switch from the environment (use envs)",
    ])
    assert unknown_names(tmp_path) == [f"bench/run.sh:1 names {gone}, no switch of envs"]


def test_the_names_that_are_no_switch_are_still_named() -> None:
    """An entry of NOT_SWITCHES whose name left the repository goes with it."""
    mentioned = {found for path in _sources(ROOT, MENTIONING, MENTIONING_NAMES)
                 for found in NAME.findall(path.read_text(encoding="utf-8", errors="replace"))}
    assert set(NOT_SWITCHES) <= mentioned
