"""The README stays short and true: every `mmvsd` command in it parses with the real command line and names
files that exist, its links resolve, and the quick ones run as written (the rest run in
`benchmarks/check_readme.py`, the docs check)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from test_imports import ROOT

from conftest import load_benchmark_script
from mmvsd.cli import build_parser

README = ROOT / "README.md"
readme_commands = load_benchmark_script("check_readme").readme_commands  # the README parser the docs check uses
INPUT_FLAGS = ("--config", "--image", "--prompt-file")  # flags whose value is a file that must be there


def mmvsd_argv(command: str) -> list[str]:
    return shlex.split(command)[1:]


def test_readme_is_short_and_its_commands_are_found():
    assert len(README.read_text().splitlines()) <= 160  # issue 55: a README of at most 160 lines
    commands = readme_commands()
    assert any(c.startswith("mmvsd bench ") for c in commands) and any(c.startswith("mmvsd train ") for c in commands)
    assert readme_commands("```bash\nmmvsd a \\\n  --b c  # note\n# only a comment\n```") == ["mmvsd a --b c"]


@pytest.mark.parametrize("command", [c for c in readme_commands() if c.startswith("mmvsd ")])
def test_readme_command_parses_and_names_existing_files(command):
    argv = mmvsd_argv(command)
    args, extra = build_parser().parse_known_args(argv)
    assert all("=" in item and not item.startswith("-") for item in extra), f"unknown arguments {extra}"
    for flag in INPUT_FLAGS:
        for index, word in enumerate(argv[:-1]):
            value = argv[index + 1]
            if word == flag and "/" in value:
                assert (ROOT / value).exists(), f"{command}: {value} is not in the repository"


def test_readme_links_resolve():
    for link in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


@pytest.mark.smollm2
@pytest.mark.parametrize("command", [c for c in readme_commands() if c.startswith("mmvsd generate ")])
def test_readme_generate_commands_run_as_written(command, tmp_path):
    done = subprocess.run([sys.executable, "-m", "mmvsd", *mmvsd_argv(command)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
