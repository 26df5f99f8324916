"""The package's import graph has no cycle (function-level imports included, typing-only ones not), every
module says what it owns in its first line, and no module is over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"mmvsd": "mmvsd", "mmvsd.adapters": "adapters", "mmvsd.drafters": "drafters", "mmvsd.data": "data",
            "mmvsd.eval": "eval", "mmvsd.configs": "configs"}  # as pyproject's package-dir maps them


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def runtime_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its code, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
                   for stmt in block.body for node in ast.walk(stmt)}
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join(base[: len(base) - node.level + 1] + ([module] if module else []))
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return {m for m in found if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a module path (empty when there is none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    modules = package_modules()
    graph = {name: runtime_imports(name, path, set(modules)) for name, path in modules.items()}
    assert len(graph) > 50 and any(graph.values())
    assert find_cycle(graph) == []


@pytest.mark.parametrize("name", sorted(package_modules()))
def test_module_says_what_it_owns_and_stays_small(name):
    path = package_modules()[name]
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.splitlines()[0].strip(), f"{path} has no first-line docstring"
    assert len(path.read_text().splitlines()) <= 600, f"{path} is over 600 lines"
