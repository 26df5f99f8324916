"""One registry per concept: a training-objective term, a non-neural `--drafter` kind and a benchmark each join
by one registry entry, and the config, the command line, the bench and the docs follow."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from test_objectives import setup

from conftest import save_tiny_target
from mmvsd.cli import build_parser, main
from mmvsd.drafters.ngram import NgramDrafter
from mmvsd.drafters.spec import PROPOSER_SPECS, ProposerSpec, drafter_from_spec, register_proposer_spec
from mmvsd.errors import UserError
from mmvsd.eval.bench_config import BenchConfig
from mmvsd.eval.bench_item import BenchItem
from mmvsd.eval.suites import BENCHMARKS, SUITES, Benchmark, is_multimodal, load_items, resolve_suite
from mmvsd.training.config import load_train_config
from mmvsd.training.terms import (
    TERMS,
    Term,
    make_objective,
    objective_help,
    objectives_markdown,
    register_term,
    unregister_term,
)

ROOT = Path(__file__).resolve().parent.parent


def toy_loss(drafter, target, batch, config, generator, mean, unroll):
    """A toy term: the squared norm of the drafter's trainable weights."""
    value = sum(p.pow(2).sum() for p in drafter.parameters() if p.requires_grad)
    return value, {"toy": float(value.detach())}


@pytest.fixture
def toy_term():
    term = register_term(Term("toy", toy_loss, "an L2 penalty on the drafter's weights", weight=0.5,
                              metrics=("toy",), progress=(("toy", "toy"),), cost="one pass over the weights"))
    yield term
    unregister_term("toy")
    assert "toy" not in TERMS


def write_chats(path: Path) -> Path:
    path.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": f"w{5 + i} w6 w7"},
                                                                 {"from": "gpt", "value": "w8 w9 w10 w11 w12"}]}
                                for i in range(4)]))
    return path


def test_a_new_objective_is_one_term_entry(toy_term, tiny_target, tmp_path, capsys):
    """Registered once, `ce+toy` is in the CLI's help, parses and validates as a config, trains through
    `mmvsd train`, and is ce + 0.5 x toy (the term's default weight in a mixture)."""
    assert "toy" in objective_help() and "`toy`" in objectives_markdown()
    args = build_parser().parse_args(["train", "--objective", "ce+toy"])
    assert args.objective == "ce+toy"
    config = load_train_config(None, {"target": "T", "output": "O", "objective": "ce+toy"}, [])
    assert config.objective == "ce+toy"
    with pytest.raises(UserError, match="unknown objective 'ce\\+toyy'"):
        load_train_config(None, {"target": "T", "output": "O", "objective": "ce+toyy"}, [])
    batch, drafter = setup(tiny_target)
    generator = torch.Generator().manual_seed(0)
    both, metrics = make_objective("ce+toy", config.loss)(drafter, tiny_target, batch, generator)
    ce, _ = make_objective("ce", config.loss)(drafter, tiny_target, batch, generator)
    toy, _ = toy_loss(drafter, tiny_target, batch, config.loss, generator, None, None)
    torch.testing.assert_close(both, ce + 0.5 * toy)
    assert {"ce", "acc_0", "toy"} <= set(metrics)
    target, out = save_tiny_target(tmp_path / "target"), tmp_path / "out"
    code = main(["train", "--target", str(target), "--data", str(write_chats(tmp_path / "chats.json")), "--output",
                 str(out), "--objective", "ce+toy", "max_steps=1", "batch_size=2", "draft_vocab_size=64",
                 "loss.ttt_steps=2", "progress=false", "validation_fraction=0"])
    assert code == 0, capsys.readouterr().err
    assert yaml.safe_load((out / "train_config.yaml").read_text())["objective"] == "ce+toy"


def test_the_docs_show_the_registered_terms():
    """docs/training.md's table of terms is the registry's (`objectives_markdown`)."""
    text = (ROOT / "docs" / "training.md").read_text()
    assert objectives_markdown() in text, "docs/training.md: paste mmvsd.training.terms.objectives_markdown()"
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for registry in ("mmvsd/training/terms.py", "register_proposer_spec", "register_benchmark", "ce+accept"):
        assert registry in architecture, registry


def test_a_non_neural_proposer_is_one_spec_entry(tiny_target, monkeypatch):
    """A prefix registered with a factory is what `--drafter PREFIX[:OPTIONS]` builds; n-gram branches join it
    only when it says so, and its own check runs before anything loads."""
    built = []

    def build(spec: str, target):
        built.append(spec)
        return NgramDrafter()

    def check(spec: str) -> None:
        if spec.partition(":")[2] not in ("", "fast"):
            raise UserError(f"--drafter {spec}: toy takes no option but fast")

    monkeypatch.setattr("mmvsd.drafters.spec.PROPOSER_SPECS", dict(PROPOSER_SPECS))  # restored after the test
    register_proposer_spec(ProposerSpec("toy", build, check=check))
    assert isinstance(drafter_from_spec("toy:fast", tiny_target), NgramDrafter) and built == ["toy:fast"]
    with pytest.raises(UserError, match="toy takes no option"):
        drafter_from_spec("toy:slow", tiny_target)
    with pytest.raises(UserError, match="--ngram on adds n-gram branches"):
        drafter_from_spec("toy", tiny_target, ngram=True)
    register_proposer_spec(ProposerSpec("toy", build, ngram_branches=True))
    assert type(drafter_from_spec("toy", tiny_target)).__name__ == "HybridDrafter"
    assert drafter_from_spec("none", tiny_target) is None
    with pytest.raises(UserError, match="takes no options"):
        drafter_from_spec("none:x", tiny_target)


def test_a_new_benchmark_is_one_register_call(tmp_path, monkeypatch, capsys):
    """`register_benchmark` makes a benchmark and its suite what `--suite` names, and `mmvsd bench` runs it."""
    monkeypatch.setattr("mmvsd.eval.suites.BENCHMARKS", dict(BENCHMARKS))
    monkeypatch.setattr("mmvsd.eval.suites.SUITES", {name: list(names) for name, names in SUITES.items()})
    from mmvsd.eval import suites

    items = [BenchItem("toy_words", str(i), (f"w{5 + i} w6",), {"answer": "w7"}) for i in range(3)]
    suites.register_benchmark("toy_words", Benchmark(lambda limit: items[:limit] if limit else items,
                                                     lambda answer, ref: float(ref["answer"] in answer)),
                              suites=("toy", "text"))
    assert suites.resolve_suite("toy") == ["toy_words"] and "toy_words" in suites.resolve_suite("text")
    assert not suites.is_multimodal(["toy_words"]) and len(suites.load_items("toy_words", 2)) == 2
    BenchConfig(suite="toy").validate()
    target, out = save_tiny_target(tmp_path / "target"), tmp_path / "bench"
    assert main(["bench", "--no-progress", "--max-new-tokens", "4", "--suite", "toy", "--limit", "2", "--target",
                 str(target), "--drafter", "ngram", "--methods", "vanilla,tree", "--tree", "6/3/2", "--out",
                 str(out)]) == 0, capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {row["benchmark"] for row in rows} == {"toy_words", "average"}
    with pytest.raises(UserError, match=re.escape("unknown suite or benchmark 'toys'")):
        suites.resolve_suite("toys")


def test_the_built_in_registries():
    assert list(TERMS) == ["ce", "vsd", "vsd-kl", "accept", "vsd-rloo"]
    assert set(PROPOSER_SPECS) >= {"none", "ngram", "model"}
    assert resolve_suite("text") == ["mt_bench", "humaneval", "gsm8k"] and SUITES["mllm"][0] == "vqav2_val"
    assert is_multimodal(["ai2d_mini_long"]) and not is_multimodal(["gsm8k"]) and load_items("gsm8k", 1)
