"""Imports run one way, as docs/architecture.md's layer map says: the core (mmvsd/'s own modules, decoding/ and
layouts/, its command line's dispatch included) imports none of the folders `adapters/ data/ drafters/ training/
eval/` inside mmvsd/; the first three import the core alone; `training/` sits above them and `eval/` on top; the
studies (studies/) sit above the package, which never imports them, nor `benchmarks/` or `tests/`, nor edits
`sys.path`. Every runtime import counts, function-level ones included (typing-only ones do not). On disk the
same: the folders' import graph has no circle, and every module has one path, the one its name says, that git,
setuptools and pyright all see (no links)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_imports import PACKAGE_FOLDERS, PYPROJECT, ROOT, find_cycle, package_modules, runtime_imports

# (layer, rank, what belongs to it); a module may import its own layer's modules and lower ranks' only. The
# plugin folders may each import the core and themselves, not one another.
LAYERS = [
    ("core", 0, re.compile(r"mmvsd(\.(?!eval\b|engines\b|training\b|drafters\b|adapters\b|targets\b|data\b)\w+.*)?$")),
    ("drafters", 1, re.compile(r"mmvsd\.drafters\b")),
    ("adapters", 1, re.compile(r"mmvsd\.adapters\b")),
    ("targets", 1, re.compile(r"mmvsd\.targets\b")),
    ("data", 1, re.compile(r"mmvsd\.data\b")),
    ("training", 2, re.compile(r"mmvsd\.training\b")),
    ("top", 3, re.compile(r"mmvsd\.eval\b")),
    ("engines", 4, re.compile(r"mmvsd\.engines\b")),  # found by name through the core's registry, never imported
]


def layer_of(module: str) -> tuple[str, int]:
    for name, rank, pattern in LAYERS:
        if pattern.match(module):
            return name, rank
    raise AssertionError(f"{module} is in no layer of the map")


def allowed(importer: str, imported: str) -> bool:
    (layer, rank), (other, other_rank) = layer_of(importer), layer_of(imported)
    return layer == other or other_rank < rank


def test_the_map_places_each_folder():
    assert layer_of("mmvsd") == ("core", 0) and layer_of("mmvsd.decoding.decode") == ("core", 0)
    assert layer_of("mmvsd.layouts.registry") == ("core", 0) and layer_of("mmvsd.configs") == ("core", 0)
    assert layer_of("mmvsd.drafters.eagle3")[0] == "drafters" and layer_of("mmvsd.data.images")[0] == "data"
    assert layer_of("mmvsd.training.trainer") == ("training", 2) and layer_of("mmvsd.cli") == ("core", 0)
    assert layer_of("mmvsd.eval.bench") == ("top", 3) and layer_of("mmvsd.plugins") == ("core", 0)
    assert not allowed("mmvsd.decoding.decode", "mmvsd.drafters.ngram")
    assert not allowed("mmvsd.drafters.eagle3", "mmvsd.data.images")
    assert not allowed("mmvsd.training.trainer", "mmvsd.eval.suites")
    assert allowed("mmvsd.training.trainer", "mmvsd.drafters.eagle3")
    assert allowed("mmvsd.eval.bench", "mmvsd.training.prepare_cli")
    assert allowed("mmvsd.eval.train_cli", "mmvsd.training.trainer")
    assert not allowed("mmvsd.training.trainer", "mmvsd.eval.acceptance")
    assert allowed("mmvsd.engines.llamacpp", "mmvsd.eval.bench_method")
    assert not allowed("mmvsd.eval.bench", "mmvsd.engines")
    assert layer_of("mmvsd.decoding.engines") == ("core", 0)
    assert not allowed("mmvsd.cli", "mmvsd.training.trainer") and not allowed("mmvsd.__main__", "mmvsd.eval.bench")


@pytest.mark.parametrize("name", sorted(package_modules()))
def test_imports_run_one_way(name):
    modules = package_modules()
    wrong = sorted(m for m in runtime_imports(name, modules[name], set(modules)) if not allowed(name, m))
    assert not wrong, f"{name} ({layer_of(name)[0]}) imports a higher layer: {wrong} (docs/architecture.md)"


def test_the_architecture_doc_shows_the_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for folder in ("mmvsd/decoding/", "mmvsd/layouts/", "mmvsd/training/", "mmvsd/drafters/", "mmvsd/adapters/",
                   "mmvsd/data/", "mmvsd/eval/", "mmvsd/engines/", "mmvsd/targets/", "studies/"):
        assert f"`{folder}`" in text, f"docs/architecture.md's layer map does not place {folder}"


def test_the_core_stays_small_at_its_top_level():
    top = [path for path in (ROOT / "mmvsd").glob("*.py") if path.name != "__init__.py"]
    assert len(top) <= 15, sorted(p.name for p in top)  # issue 55: at most 15 top-level modules


def folder_of(path: Path) -> str:
    """The folder of the layer map that a module's file lies in: mmvsd (the core), or one of the card's folders
    inside it (drafters, training, eval, ...)."""
    parts = path.relative_to(ROOT / "mmvsd").parts
    return parts[0] if len(parts) > 1 and parts[0] in PACKAGE_FOLDERS else "mmvsd"


def test_the_folders_on_disk_import_one_way():
    """What a reader sees agrees with the layer map: the core imports no other folder, and no folder imports one
    that imports it back (issue 55: the mapping let mmvsd/training and mmvsd/cli.py import the folders above)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = {folder_of(modules[m]) for m in runtime_imports(name, path, set(modules))}
        graph.setdefault(folder_of(path), set()).update(imported - {folder_of(path)})
    assert set(graph) == {"mmvsd", *PACKAGE_FOLDERS}
    assert not graph["mmvsd"], f"the core imports the folders {sorted(graph['mmvsd'])}"
    assert not find_cycle(graph), f"the folders import in a circle: {find_cycle(graph)}"


def test_every_module_has_one_path_that_git_and_setuptools_see():
    """mmvsd.drafters.eagle3 is the file mmvsd/drafters/eagle3.py and no other (issue 65: links gave every file two
    paths and hid the package from tools that read git's file list); setuptools installs every package folder."""
    links = [path for path in (ROOT / "mmvsd").rglob("*") if path.is_symlink()]
    assert not links, f"links in the package: {links}"
    for name, path in package_modules().items():
        assert path.resolve() == path and name.split(".")[0] == "mmvsd", f"{name} is not at {path}"
    folders = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "mmvsd").rglob("__init__.py")}
    assert folders == set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert "package-dir" not in PYPROJECT["tool"]["setuptools"]
    assert not [folder for folder in PACKAGE_FOLDERS if list((ROOT / folder).rglob("*.py"))], "a second copy at the top"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-s", "mmvsd"], cwd=ROOT, capture_output=True, text=True, check=True)
    modes = {line.split("\t")[1]: line.split()[0] for line in listed.stdout.splitlines()}
    assert not [path for path, mode in modes.items() if mode == "120000"], "git tracks links in mmvsd/"
    untracked = [path.relative_to(ROOT).as_posix() for path in package_modules().values()
                 if path.relative_to(ROOT).as_posix() not in modes]
    assert not untracked, f"modules git does not track (git add them): {untracked}"


@pytest.mark.skipif(shutil.which("pyright") is None, reason="pyright is not installed (npm install -g pyright)")
def test_pyright_resolves_every_import():
    """The IDE's view (pylance is pyright): every import of the package resolves, at pyproject's [tool.pyright]."""
    run = subprocess.run(["pyright", "--outputjson"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = json.loads(run.stdout)
    assert report["summary"]["filesAnalyzed"] == len(package_modules())
    missing = [f"{d['file']}: {d['message']}" for d in report["generalDiagnostics"]
               if d.get("rule") in ("reportMissingImports", "reportMissingModuleSource")]
    assert not missing, missing


# what only a checkout has, never an install: the studies plugin, the scripts of benchmarks/ and the tests
OUTSIDE_THE_PACKAGE = {"studies", "mmvsd_studies", "benchmarks", "tests", "conftest",
                       *(path.stem for path in (ROOT / "benchmarks").glob("*.py")),
                       *(path.stem for path in (ROOT / "tests").glob("*.py"))}


def imports_from_outside_or_sys_path(path: Path, own: str = "") -> list[str]:
    """Where `path` imports a module of OUTSIDE_THE_PACKAGE (or a `test_*` module) other than its own package
    `own`, or touches `sys.path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else []
            if node.module == "sys":
                names += [f"sys.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
            names = ["sys.path"]
        else:
            continue
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found += [f"{where}:{node.lineno}: {name}" for name in names
                  if name == "sys.path" or (name.split(".")[0] in OUTSIDE_THE_PACKAGE - {own})
                  or name.startswith("test_")]
    return found


def test_the_check_finds_imports_from_outside_and_sys_path(tmp_path):
    (tmp_path / "m.py").write_text("import sys\nimport os.path\nfrom tests.conftest import x\n"
                                   "import mmvsd_studies.lab\nfrom sys import path\nfrom . import studies\n"
                                   "from gpu_smoke import run\nsys.path.insert(0, 'x')\nimport test_train\n")
    found = [line.split(": ", 1)[1] for line in imports_from_outside_or_sys_path(tmp_path / "m.py")]
    assert sorted(found) == ["gpu_smoke", "mmvsd_studies.lab", "sys.path", "sys.path", "test_train", "tests.conftest"]
    assert "mmvsd_studies.lab" not in str(imports_from_outside_or_sys_path(tmp_path / "m.py", own="mmvsd_studies"))


def test_the_package_imports_nothing_of_the_checkout_and_leaves_sys_path_alone():
    """No module of the package (mmvsd/ and its folders) imports the studies, benchmarks/ or tests/, or edits
    `sys.path`; the studies (a plugin on the public API) import no script of benchmarks/ or tests/ and leave
    `sys.path` alone too."""
    studies = sorted((ROOT / "studies" / "mmvsd_studies").rglob("*.py"))
    assert studies, "studies/mmvsd_studies is missing"
    found = [*(hit for path in package_modules().values() for hit in imports_from_outside_or_sys_path(path)),
             *(hit for path in studies for hit in imports_from_outside_or_sys_path(path, own="mmvsd_studies"))]
    assert not found, f"imports from outside the package, or sys.path edits: {found}"
