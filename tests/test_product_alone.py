"""The product stands without its studies (issue 65): with the studies plugin (mmvsd-studies) made uninstallable in
the process, the README's image demo, `mmvsd bench --suite mllm` on its default target smol-llava with its shipped
drafter, and `mmvsd drafters` work from the product alone, and `mmvsd lab` says how to install the plugin.

"Not installed" is simulated in each command's own process: `import mmvsd_studies` fails there, so its entry points
(listed by the checkout's install) fail to load, as a missing distribution's would not be listed at all; mmvsd
logs and skips a plugin that fails, so what runs is the product's code only."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WITHOUT_STUDIES = ("import sys; sys.modules['mmvsd_studies'] = None; sys.argv[0] = 'mmvsd'; "
                   "from mmvsd.cli import main; sys.exit(main())")


def mmvsd_alone(*args: str) -> subprocess.CompletedProcess:
    """`mmvsd ARGS` in a process where the studies plugin cannot be imported."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", WITHOUT_STUDIES, *args], capture_output=True, text=True, check=False,
                          env=env, cwd=ROOT, timeout=1800)


def test_the_studies_are_really_out_of_reach_there():
    blocked = "import sys; sys.modules['mmvsd_studies'] = None; import mmvsd_studies"
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "ModuleNotFoundError" in done.stderr
    lab = mmvsd_alone("lab", "build-target", "smol-llava")
    assert lab.returncode == 2 and "pip install -e ./studies" in lab.stderr


@pytest.mark.smollm2
def test_the_readme_image_demo_and_the_shipped_image_drafters_run_from_the_product_alone():
    readme = (ROOT / "README.md").read_text()
    demo = next(line for line in readme.splitlines() if line.startswith("mmvsd generate --target smol-llava"))
    for drafter in ([], ["--drafter", "msd-ce"]):  # the default (vispec-ce) and the other shipped image drafter
        done = mmvsd_alone(*shlex.split(demo)[1:], *drafter, "--max-new-tokens", "8")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() and "Traceback" not in done.stderr
    listed = mmvsd_alone("drafters", "list")
    assert listed.returncode == 0, listed.stderr
    assert {line.split()[1] for line in listed.stdout.splitlines() if line.startswith("smol-llava")} == {
        "msd-ce", "vispec-ce"}


@pytest.mark.smollm2
def test_the_mllm_suite_runs_on_its_default_target_from_the_product_alone(tmp_path):
    out = tmp_path / "mllm"
    done = mmvsd_alone("bench", "--suite", "mllm", "--limit", "1", "--max-new-tokens", "12", "--methods",
                       "vanilla,tree", "--tree", "12/4/3", "--no-progress", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["target"] in ("", "smol-llava")
    rows = [row for row in result["rows"] if row["benchmark"] != "average"]
    assert len({row["benchmark"] for row in rows}) == 6
    trees = [row for row in rows if row["method"].startswith("tree")]
    assert trees and all(row["lossless_mismatches"] == 0 for row in trees)
