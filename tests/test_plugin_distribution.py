"""A plugin as a user ships one: a small distribution, pip-installed into a virtual environment, whose module listed
under `mmvsd.plugins` registers a suite (a copy of gsm8k), a `--drafter` kind (a copy of `ngram`), an objective
term (a copy of `ce`) and an engine (mmvsd's plain decoding under another name, for `bench` and `regenerate`), with
a named target (`mmvsd.targets`), a modality adapter (`mmvsd.adapters`) and a command (`mmvsd.commands`). The real
command line, run in that environment, finds them all: every registry is read after the plugins load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import save_tiny_target

REGISTRIES = '''
"""What the bar plugin adds to mmvsd's registries, as another package writes it (`mmvsd.plugins`)."""

import dataclasses
from pathlib import Path

from mmvsd.adapters.text import TextAdapter
from mmvsd.decoding.decode import vanilla_generate
from mmvsd.decoding.engines import Engine, register_engine
from mmvsd.drafters.ngram import NgramDrafter, parse_ngram_spec
from mmvsd.drafters.spec import ProposerSpec, register_proposer_spec
from mmvsd.eval.bench_method import Method
from mmvsd.eval.suites import BENCHMARKS, register_benchmark
from mmvsd.target_loader import BuiltinTarget, load_target
from mmvsd.training.regenerate import mmvsd_answers
from mmvsd.training.terms import TERMS, register_term

TARGET_FOLDER = Path({folder!r})


def bar_ngram(spec: str) -> NgramDrafter:
    return NgramDrafter(parse_ngram_spec("ngram" + spec.removeprefix("barngram")))


def bar_items(limit: int) -> list:
    return [dataclasses.replace(item, benchmark="bar_gsm8k") for item in BENCHMARKS["gsm8k"].load(limit)]


def bar_target() -> BuiltinTarget:
    return BuiltinTarget("bar-tiny", assemble=lambda: TARGET_FOLDER)


class BarText(TextAdapter):
    """A modality adapter of another package (entry point `mmvsd.adapters`): the text adapter under its own name."""


class BarAnswers:
    """Regeneration's answers: mmvsd's own, from a context manager as an engine's subprocess would be."""

    engine = "bar-engine"

    def __init__(self, target) -> None:
        self.answer = mmvsd_answers(target)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __call__(self, prompts, budgets, temperature, seeds):
        return self.answer(prompts, budgets, temperature, seeds)


class BarEngine(Engine):
    name = "bar-engine"
    report_note = "Engine: bar (plain decoding only)."
    batch_one = True

    def load_target(self, spec, dtype, device):
        return load_target(spec)

    def bench_methods(self, config, target, stack):
        return [Method("vanilla", lambda prompts, cfg: vanilla_generate(target, prompts, cfg), own_loop=True)]

    def answers(self, target, options):
        return BarAnswers(target)


register_engine(BarEngine())
register_benchmark("bar_gsm8k", dataclasses.replace(BENCHMARKS["gsm8k"], load=bar_items), suites=("barsuite",))
register_proposer_spec(ProposerSpec("barngram", lambda spec, target: bar_ngram(spec), check=bar_ngram))
register_term(dataclasses.replace(TERMS["ce"], name="barce"))
'''

COMMAND = '''
"""`mmvsd bar`: light to import, as every command's module (the parser imports it for any command line)."""

import argparse


def add_bar_command(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("bar", help="the bar plugin's command").set_defaults(handler=lambda args: print("bar says hello"))
'''

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "mmvsd-bar-plugin"
version = "0.1"

[project.entry-points."mmvsd.plugins"]
bar = "mmvsd_bar_plugin.registries"

[project.entry-points."mmvsd.targets"]
bar-tiny = "mmvsd_bar_plugin.registries:bar_target"

[project.entry-points."mmvsd.commands"]
bar = "mmvsd_bar_plugin.cli:add_bar_command"

[project.entry-points."mmvsd.adapters"]
bar-text = "mmvsd_bar_plugin.registries:BarText"

[tool.setuptools]
packages = ["mmvsd_bar_plugin"]
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """The python of a virtual environment that sees the system's mmvsd and torch, with the bar plugin installed."""
    root = tmp_path_factory.mktemp("bar")
    target = save_tiny_target(root / "tiny-target")
    source = root / "mmvsd-bar-plugin"
    (source / "mmvsd_bar_plugin").mkdir(parents=True)
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (source / "mmvsd_bar_plugin" / "__init__.py").write_text("")
    (source / "mmvsd_bar_plugin" / "registries.py").write_text(REGISTRIES.format(folder=str(target)))
    (source / "mmvsd_bar_plugin" / "cli.py").write_text(COMMAND)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "venv")],
                   check=True)
    python = root / "venv" / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                                "--no-cache-dir", "--quiet", str(source)],  # no wheel left in the user's pip cache
                               capture_output=True, text=True, check=False, cwd=root)
    assert installed.returncode == 0, installed.stderr
    return python


def mmvsd(python: Path, *args: str) -> subprocess.CompletedProcess:
    """`mmvsd ARGS` in the plugin's environment (a process of its own)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(python), "-m", "mmvsd.cli", *args], capture_output=True, text=True, check=False,
                          env=env, timeout=600)


def test_bench_runs_the_plugins_suite_with_its_drafter_kind_on_its_target(venv, tmp_path):
    out = tmp_path / "bench"
    done = mmvsd(venv, "bench", "--no-progress", "--suite", "barsuite", "--limit", "1", "--max-new-tokens", "4",
                 "--target", "bar-tiny", "--drafter", "barngram:max_n=3", "--methods", "vanilla,tree", "--tree",
                 "6/3/2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {row["benchmark"] for row in rows} == {"bar_gsm8k", "average"}
    assert "tree:barngram:max_n=3" in {row["method"] for row in rows}


def test_bench_and_regenerate_decode_with_the_plugins_engine(venv, tmp_path):
    out = tmp_path / "bench"
    done = mmvsd(venv, "bench", "--no-progress", "--suite", "barsuite", "--limit", "1", "--max-new-tokens", "4",
                 "--target", "bar-tiny", "--engine", "bar-engine", "--methods", "vanilla", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(row["benchmark"], row["method"]) for row in rows} == {("bar_gsm8k", "vanilla"), ("average", "vanilla")}
    assert "Engine: bar (plain decoding only)." in (out / "table.md").read_text()
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([{"id": "0", "conversations": [{"from": "human", "value": "w5 w6"},
                                                                {"from": "gpt", "value": "w7 w8 w9"}]}]))
    regen = mmvsd(venv, "regenerate", "--target", "bar-tiny", "--data", str(chats), "--output", str(tmp_path / "regen"),
                  "--engine", "bar-engine", "--max-new-tokens", "4")
    assert regen.returncode == 0, regen.stderr
    assert json.loads((tmp_path / "regen" / "manifest.json").read_text())["key"]["engine"] == "bar-engine"
    wrong = mmvsd(venv, "bench", "--suite", "barsuite", "--engine", "nope", "--target", "bar-tiny")
    assert wrong.returncode == 2 and "choose one of mmvsd, bar-engine, llama.cpp" in wrong.stderr


def test_the_plugins_adapter_is_listed_and_accepted_by_the_commands(venv):
    listed = mmvsd(venv, "adapters", "list")
    assert listed.returncode == 0, listed.stderr
    assert "bar-text" in listed.stdout and "mmvsd-bar-plugin" in listed.stdout
    done = mmvsd(venv, "generate", "--target", "bar-tiny", "--adapter", "bar-text", "--drafter", "none", "--prompt",
                 "w1 w2", "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr
    wrong = mmvsd(venv, "generate", "--target", "bar-tiny", "--adapter", "bar-nope", "--drafter", "none", "--prompt",
                  "w1 w2")
    assert wrong.returncode == 2 and "no modality adapter 'bar-nope'" in wrong.stderr


def test_eval_drafter_reads_the_plugins_benchmark_as_a_prompt_set(venv):
    done = mmvsd(venv, "eval-drafter", "--target", "bar-tiny", "--drafter", "barngram", "--prompt-file", "bar_gsm8k",
                 "--limit", "1", "--max-new-tokens", "4", "--tree", "6/3/2", "--no-cache")
    assert done.returncode == 0, done.stderr
    assert "greedy continuations: 1 prompts" in done.stdout


def test_train_plans_the_plugins_objective_and_its_command_runs(venv, tmp_path):
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([{"id": "0", "conversations": [{"from": "human", "value": "w5 w6"},
                                                                {"from": "gpt", "value": "w7 w8 w9"}]}]))
    plan = mmvsd(venv, "train", "--dry-run", "--target", "bar-tiny", "--objective", "ce+barce", "--data", str(chats),
                 "--output", str(tmp_path / "out"))
    assert plan.returncode == 0, plan.stderr
    assert "objective ce+barce" in plan.stdout
    assert "barce" in mmvsd(venv, "train", "--help").stdout
    hello = mmvsd(venv, "bar")
    assert hello.returncode == 0 and hello.stdout.strip() == "bar says hello", hello.stderr
