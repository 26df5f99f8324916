"""The package's import graph has no cycle (function-level imports included, typing-only ones not), every
module says what it owns in its first line, no module is over 600 lines, every function-level import
says on its line why it is not at module level, and no Python line is over pyproject's line length."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# the folders inside mmvsd/ that form layers above the core: the design card's, engines/ and targets/ (issue 65)
PACKAGE_FOLDERS = ("adapters", "configs", "data", "drafters", "eval", "training", "engines", "targets")


def package_modules() -> dict[str, Path]:
    """Every module of the package by its dotted name, at the one path that name says (mmvsd/drafters/eagle3.py)."""
    modules = {}
    for path in sorted((ROOT / "mmvsd").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` blocks."""
    return {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
            and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
            for stmt in block.body for node in ast.walk(stmt)}


def function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside function bodies, except under `if TYPE_CHECKING:`, in line order."""
    skip = typing_only(tree)
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = {id(node): node for function in functions for node in ast.walk(function)
             if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip}
    return sorted(found.values(), key=lambda node: node.lineno)


def runtime_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its code, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = typing_only(tree)
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
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


def studies_modules() -> dict[str, Path]:
    """The studies plugin's modules (studies/mmvsd_studies), held to the same docstring, size and import rules."""
    folder = ROOT / "studies"
    return {".".join(path.relative_to(folder).with_suffix("").parts).removesuffix(".__init__"): path
            for path in sorted((folder / "mmvsd_studies").rglob("*.py"))}


@pytest.mark.parametrize("name", sorted({**package_modules(), **studies_modules()}))
def test_module_says_what_it_owns_and_stays_small(name):
    path = {**package_modules(), **studies_modules()}[name]
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.splitlines()[0].strip(), f"{path} has no first-line docstring"
    assert len(path.read_text().splitlines()) <= 600, f"{path} is over 600 lines"


def test_no_line_is_over_the_line_length():
    limit = PYPROJECT["tool"]["ruff"]["line-length"]
    files = [*package_modules().values(), *sorted((ROOT / "tests").glob("*.py")), ROOT / "conftest.py",
             *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "studies").rglob("*.py"))]
    long = [f"{path.relative_to(ROOT)}:{number}" for path in files
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]
    assert not long, f"lines over {limit} characters: {', '.join(long)}"


def test_function_imports_finds_only_function_level_ones():
    tree = ast.parse("import os\n"
                     "def f():\n    import json  # why\n    if TYPE_CHECKING:\n        import typing\n"
                     "    def g():\n        from a import (  # why\n            b,\n        )\n"
                     "class C:\n    async def h(self):\n        import csv\n")
    assert [node.lineno for node in function_imports(tree)] == [3, 7, 12]


@pytest.mark.parametrize("name", sorted({**package_modules(), **studies_modules()}))
def test_function_level_imports_say_why(name):
    """An import inside a function (a heavy or optional package, the CLI's start-up time) says why in a trailing
    comment on its line (the first line of a multi-line import); anything else belongs at module level."""
    path = {**package_modules(), **studies_modules()}[name]
    lines = path.read_text().splitlines()
    silent = [f"{path.name}:{node.lineno}: {lines[node.lineno - 1].strip()}"
              for node in function_imports(ast.parse(path.read_text())) if "#" not in lines[node.lineno - 1]]
    assert not silent, f"function-level imports without a reason (move them up or say why): {silent}"


def test_the_command_line_starts_without_torch():
    """`mmvsd --help` and argument errors answer at once: the CLI module loads no model code."""
    import subprocess
    import sys

    code = ("import sys, mmvsd.cli; mmvsd.cli.build_parser(); "  # plugins' commands (the studies' `lab`) included
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent)
    assert out.stdout.strip() == "[]"
