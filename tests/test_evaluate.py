"""The exact T=0 acceptance evaluator: equal to `generate`'s tau, its continuation cache, report, CLI and
the trainer's validation-tau hook."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import PROMPT_POOL, make_tiny_llama, random_prompts, run_cli, save_tiny_target
from mmvsd.cli import main
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape
from mmvsd.errors import UserError
from mmvsd.eval import acceptance as evaluate
from mmvsd.eval.acceptance import (
    cached_greedy_continuations,
    evaluate_acceptance,
    greedy_continuations,
)
from mmvsd.target import Target

PROMPTS = PROMPT_POOL[:6] + random_prompts(3, seed=41)  # the fitted drafter knows PROMPT_POOL: real acceptances
SHAPES = [TreeShape(60, 7, 10), TreeShape(12, 4, 3), TreeShape(4, 3, 1), TreeShape(1, 7, 10)]
MAX_NEW = 40


@pytest.fixture(scope="module")
def eos_target(tiny_target) -> Target:
    """The tiny target with an EOS id that some greedy continuations reach early, at different lengths."""
    outputs = [r.output_ids for r in vanilla_generate(tiny_target, PROMPTS, DecodeConfig(MAX_NEW))]
    in_middle = Counter(tok for out in outputs for tok in set(out[3:30]) - set(out[:3]))
    target = Target(tiny_target.model, None, "tiny-llama-eos")
    target.eos_token_ids = frozenset({in_middle.most_common(1)[0][0]})
    return target


def assert_same_as_generate(target, drafter, shape, batch_size=4, decode_batch=3) -> evaluate.AcceptanceReport:
    """The evaluator's counters equal speculative decoding's, prompt by prompt."""
    continuations = greedy_continuations(target, PROMPTS, MAX_NEW, batch_size=5)
    report = evaluate_acceptance(target, drafter, PROMPTS, continuations, shape, batch_size=batch_size)
    decoded = []
    for start in range(0, len(PROMPTS), decode_batch):
        chunk = PROMPTS[start:start + decode_batch]
        decoded += speculative_generate(target, drafter, chunk, DecodeConfig(MAX_NEW, tree=shape))
    assert [r.output_ids for r in decoded] == continuations  # lossless: the replayed path is decoding's
    assert report.ties == [] and report.num_mismatches == 0  # so equality below must be exact
    for result, replay in zip(decoded, report.prompts):
        assert (replay.new_tokens, replay.target_forwards) == (len(result.output_ids), result.num_target_forwards)
        assert replay.tau == result.tau
        assert replay.accept_lengths[:-1] == result.accept_lengths[:-1]  # the last step may run past the end
    pooled = sum(len(r.output_ids) for r in decoded) / sum(r.num_target_forwards for r in decoded)
    assert report.tau == pytest.approx(pooled, abs=1e-12)
    return report


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.budget}-{s.depth}-{s.topk}")
def test_evaluator_tau_equals_generate(tiny_target, fitted_drafter, shape):
    report = assert_same_as_generate(tiny_target, fitted_drafter, shape)
    if shape.budget == 1:
        assert report.tau == 1.0 and report.acceptance_by_depth == [0.0] * shape.depth
    if shape == SHAPES[0]:
        assert report.tau > 2.0  # a drafter that really drafts: the comparison is not vacuous


def test_evaluator_counts_nothing_after_eos(eos_target, fitted_drafter):
    continuations = greedy_continuations(eos_target, PROMPTS, MAX_NEW)
    lengths = [len(c) for c in continuations]
    assert min(lengths) < MAX_NEW and len(set(lengths)) > 2  # rows end early, at different lengths
    for cont in continuations:
        eos_at = [i for i, tok in enumerate(cont) if tok in eos_target.eos_token_ids]
        assert eos_at in ([], [len(cont) - 1])
    assert_same_as_generate(eos_target, fitted_drafter, TreeShape(16, 5, 4), batch_size=2)


def test_evaluator_equals_generate_with_ngram_and_hybrid_drafters(tiny_target, fitted_drafter):
    """n-gram statistics are shared by a batch's rows: equal to generate one prompt at a time (its default)."""
    from mmvsd.drafters.hybrid import with_ngram
    from mmvsd.drafters.spec import drafter_from_spec

    assert_same_as_generate(tiny_target, with_ngram(fitted_drafter), TreeShape(20, 5, 4), 1, 1)
    assert_same_as_generate(tiny_target, drafter_from_spec("ngram", tiny_target), TreeShape(20, 5, 4), 1, 1)


def test_acceptance_by_depth_and_report_dict(tiny_target, fitted_drafter):
    continuations = greedy_continuations(tiny_target, PROMPTS, MAX_NEW)
    report = evaluate_acceptance(tiny_target, fitted_drafter, PROMPTS, continuations, TreeShape(30, 6, 4))
    rates = report.acceptance_by_depth
    assert len(rates) == 6 and all(0 <= r <= 1 for r in rates)
    assert all(a >= b for a, b in itertools.pairwise(rates)) and rates[0] > 0.2
    steps = sum(p.target_forwards - 1 for p in report.prompts)
    assert 0 < sum(report.accepted_counts) <= steps  # steps cut short by the continuation's end are not counted
    accepted_in_full_steps = sum(k * n for k, n in enumerate(report.accepted_counts))
    assert 0 < accepted_in_full_steps <= sum(p.new_tokens - p.target_forwards for p in report.prompts)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["tree"] == "30/6/4" and len(data["prompts"]) == len(PROMPTS) and data["tau"] == report.tau
    assert "tau" in evaluate.format_report(report)


def test_figures_per_group_of_prompts_are_the_whole_reports_figures_on_those_prompts(tiny_target, fitted_drafter):
    continuations = greedy_continuations(tiny_target, PROMPTS, MAX_NEW)
    shape = TreeShape(4, 3, 1)  # the depth-3 chain
    report = evaluate_acceptance(tiny_target, fitted_drafter, PROMPTS, continuations, shape)
    groups = ["chat" if i % 2 else "math" for i in range(len(PROMPTS))]
    figures = report.by_group(groups)
    for name, figure in figures.items():
        rows = [i for i, group in enumerate(groups) if group == name]
        alone = evaluate_acceptance(tiny_target, fitted_drafter, [PROMPTS[i] for i in rows],
                                    [continuations[i] for i in rows], shape)
        counts = alone.accepted_counts
        assert figure["first_token"] == pytest.approx(alone.acceptance_by_depth[0])
        assert figure["accepted_per_step"] == pytest.approx(sum(k * n for k, n in enumerate(counts)) / sum(counts))
        assert figure["tau"] == pytest.approx(alone.tau) and figure["num_prompts"] == len(rows)
    text = evaluate.format_report(report, groups)
    assert "chat: " in text and "math: " in text and "chat: " not in evaluate.format_report(report)


def test_near_ties_on_the_greedy_path_are_reported():
    model = make_tiny_llama(seed=0)
    target = Target(model, None, "tiny-tie")
    prompt = PROMPTS[0]
    first = vanilla_generate(target, [prompt], DecodeConfig(1))[0].output_ids[0]
    other = (first + 1) % model.config.vocab_size
    with torch.no_grad():  # two tokens with the same LM-head row: every choice of `first` is a tie
        model.lm_head.weight[other] = model.lm_head.weight[first]
    continuations = greedy_continuations(target, [prompt], 12)
    drafter = evaluate_random_drafter(target)
    report = evaluate_acceptance(target, drafter, [prompt], continuations, TreeShape(8, 3, 2))
    tied = [i for i, tok in enumerate(continuations[0]) if tok in (first, other)]
    assert tied and [t.position for t in report.ties] == tied
    assert all(t.prompt == 0 and t.margin == 0.0 for t in report.ties)


def evaluate_random_drafter(target):
    from mmvsd.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter.from_target(target, seed=5).eval()


def test_evaluator_with_image_prompts_equals_generate(llava_target, llava_dir):
    from mmvsd.adapter_base import Prompt
    from mmvsd.adapters import choose_adapter
    from mmvsd.drafter_base import drafter_class

    adapter = choose_adapter(llava_target, "", "image")
    prompts = [adapter.encode(llava_target, "w5 w6", [llava_dir / "a.png"]),
               adapter.encode(llava_target, "w9", [llava_dir / "b.png"]), Prompt(llava_target.encode_prompt("w7 w8"))]
    shape = TreeShape(10, 4, 3)
    for name in ("vispec", "msd"):
        drafter = drafter_class(name).from_target(llava_target, seed=2).eval()
        continuations = greedy_continuations(llava_target, prompts, 16)
        report = evaluate_acceptance(llava_target, drafter, prompts, continuations, shape, batch_size=2)
        decoded = speculative_generate(llava_target, drafter, prompts, DecodeConfig(16, tree=shape))
        assert [r.output_ids for r in decoded] == continuations
        assert [p.target_forwards for p in report.prompts] == [r.num_target_forwards for r in decoded]


def test_continuation_cache(tiny_target, tmp_path, monkeypatch):
    first = cached_greedy_continuations(tiny_target, PROMPTS[:3], 10, cache_dir=tmp_path)
    assert first == greedy_continuations(tiny_target, PROMPTS[:3], 10)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("regenerated although cached")

    monkeypatch.setattr(evaluate, "greedy_continuations", fail)
    assert cached_greedy_continuations(tiny_target, PROMPTS[:3], 10, cache_dir=tmp_path) == first
    for other in ((PROMPTS[:2], 10), (PROMPTS[:3], 11)):  # other prompts or another length: another key
        with pytest.raises(AssertionError, match="regenerated"):
            cached_greedy_continuations(tiny_target, *other, cache_dir=tmp_path)
    monkeypatch.undo()
    next(tmp_path.glob("*.json")).write_text("{not json")  # a corrupt cache entry is generated again
    assert cached_greedy_continuations(tiny_target, PROMPTS[:3], 10, cache_dir=tmp_path) == first


def test_sampled_continuations_are_independent_per_prompt_and_cached_by_seed(tiny_target, tmp_path):
    """At T = 1 prompt i is sampled alone with seed + i: the same prompt twice gives two samples, each one is
    what decoding that prompt alone with its seed gives, and another seed is another cache entry."""
    from mmvsd.decoding.decode import DecodeConfig, vanilla_generate

    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    sampled = greedy_continuations(tiny_target, prompts, 12, temperature=1.0, seed=5)
    assert sampled[0] != sampled[1]  # a batch's shared stream would have made these copies
    for i, prompt in enumerate(prompts):
        alone = vanilla_generate(tiny_target, [prompt], DecodeConfig(max_new_tokens=12, temperature=1.0, seed=5 + i))
        assert sampled[i] == alone[0].output_ids
    assert cached_greedy_continuations(tiny_target, prompts, 12, cache_dir=tmp_path, temperature=1.0, seed=5) == sampled
    other = cached_greedy_continuations(tiny_target, prompts, 12, cache_dir=tmp_path, temperature=1.0, seed=6)
    greedy = cached_greedy_continuations(tiny_target, prompts, 12, cache_dir=tmp_path)
    assert other != sampled and greedy[0] == greedy[1] and len(list(tmp_path.glob("*.json"))) == 3


def test_bad_evaluator_input(tiny_target, fitted_drafter):
    with pytest.raises(UserError, match="no prompts"):
        evaluate.check_eval_prompts(tiny_target, [], 10, TreeShape())
    with pytest.raises(UserError, match="context window"):
        evaluate.check_eval_prompts(tiny_target, [[1] * 500], 10, TreeShape())
    with pytest.raises(UserError, match="one continuation per prompt"):
        evaluate_acceptance(tiny_target, fitted_drafter, PROMPTS[:2], [[1]], TreeShape())


# ----------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("eval-target"))


def write_prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def test_eval_drafter_cli_matches_generate(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    prompts = write_prompts(tmp_path / "p.jsonl", ["w1 w2 w3", "w9 w8", "w40 w41 w42 w43"])
    common = ["--target", str(tiny_dir), "--drafter", "random", "--prompt-file", str(prompts),
              "--max-new-tokens", "24"]
    code, out, err = run_cli(capsys, "eval-drafter", *common, "--tree", "12/4/3", "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    assert "tau" in out and list((tmp_path / "cache" / "continuations").glob("*.json"))
    code, _, err = run_cli(capsys, "generate", *common, "--tree-budget", "12", "--tree-depth", "4", "--tree-topk", "3",
                           "--json", str(tmp_path / "g.json"))
    assert code == 0, err
    replay = json.loads((tmp_path / "e.json").read_text())
    decoded = json.loads((tmp_path / "g.json").read_text())["results"]
    assert [p["target_forwards"] for p in replay["prompts"]] == [r["target_forwards"] for r in decoded]
    assert [p["new_tokens"] for p in replay["prompts"]] == [r["new_tokens"] for r in decoded]
    assert replay["tree"] == "12/4/3" and replay["num_ties"] == 0


def test_eval_drafter_gives_figures_per_domain_of_the_prompt_file(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    rows = [("w1 w2 w3", "chat"), ("w9 w8", "math"), ("w40 w41 w42 w43", "chat")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "domain": domain}) + "\n" for text, domain in rows))
    code, out, err = run_cli(capsys, "eval-drafter", "--target", str(tiny_dir), "--drafter", "random", "--prompt-file",
                             str(prompts), "--max-new-tokens", "16", "--tree", "4/3/1",
                             "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "e.json").read_text())
    assert {name: figures["num_prompts"] for name, figures in report["by_domain"].items()} == {"chat": 2, "math": 1}
    assert "  chat: 2 prompts, first token accepted" in out and "  math: 1 prompts" in out


def test_eval_drafter_reads_builtin_benchmarks(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, "eval-drafter", "--target", str(tiny_dir), "--drafter", "random",
                           "--prompt-file", "gsm8k", "--limit", "2", "--max-new-tokens", "6", "--tree", "6/2/2",
                           "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    assert json.loads((tmp_path / "e.json").read_text())["num_prompts"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--prompt-file", "EMPTY"], "holds no prompts"),
    (["--prompt-file", "mt_bnch"], "prompt file not found"),
    (["--prompt-file", "LONG", "--max-new-tokens", "600"], "context window"),
    (["--prompt-file", "LONG", "--tree", "60/7"], "BUDGET/DEPTH/TOPK"),
    (["--prompt-file", "LONG", "--drafter", "none"], "nothing"),
    (["--prompt-file", "LONG", "--limit", "-1"], "--limit"),
])
def test_eval_drafter_bad_input(tiny_dir, tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    files = {"EMPTY": tmp_path / "empty.jsonl", "LONG": write_prompts(tmp_path / "p.jsonl", ["w1 w2"])}
    files["EMPTY"].write_text("\n")
    argv = ["eval-drafter", "--target", str(tiny_dir), *[str(files.get(a, a)) for a in extra]]
    if "--drafter" not in extra:
        argv += ["--drafter", "random"]
    code, _, err = run_cli(capsys, *argv)
    last = err.strip().splitlines()[-1]  # (loading the target may draw a progress bar above it)
    assert code == 2 and message in last and last.startswith("mmvsd: error:") and err.count("mmvsd: error:") == 1


def test_trainer_logs_validation_tau(tiny_dir, tmp_path, capsys, monkeypatch):
    from conftest import TINY, write_sharegpt

    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    data = write_sharegpt(tmp_path / "data.json")
    prompts = write_prompts(tmp_path / "val.jsonl", ["w1 w2 w3", "w7 w8"])
    out = tmp_path / "out"
    code = main(["train", "--target", str(tiny_dir), "--data", str(data), "--output", str(out), *TINY, "max_steps=3",
                 "eval_every=2", f"eval_prompts={prompts}", "eval_max_new_tokens=10", "eval_tree=8/3/2"])
    assert code == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in (out / "val_tau.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 3]  # every 2 steps and after the last
    assert 0 < lines[0]["tokens_seen"] < lines[1]["tokens_seen"]  # the learning curve's x axis
    assert all(line["tau"] >= 1.0 and line["num_prompts"] == 2 and len(line["acceptance_by_depth"]) == 3
               for line in lines)
    code = main(["train", "--target", str(tiny_dir), "--data", str(data), "--output", str(tmp_path / "o2"), *TINY,
                 "max_steps=1", "eval_every=1", "eval_tree=60/7"])
    assert code == 2 and "eval_tree '60/7': expected auto, paper or BUDGET/DEPTH/TOPK" in capsys.readouterr().err


def test_the_recipe_takes_its_tau_monitor_from_its_caller(tmp_path, monkeypatch):
    """Training sits below evaluation: `train()` is handed the monitor (the command hands it evaluation's), and
    eval_every without one is refused before anything loads."""
    from mmvsd.training import trainer
    from mmvsd.training.config import TrainConfig

    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: pytest.fail("loaded a target"))
    config = TrainConfig(target="smollm2-135m", output=str(tmp_path / "out"), eval_every=5)
    with pytest.raises(ValueError, match="eval_every > 0 needs a validation evaluator"):
        trainer.train(config)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tree, shape", [("paper", "60/7/10"), ("0/3/0", "60/3/10"), ("8/3/2", "8/3/2")])
def test_the_tau_monitor_takes_the_one_tree_grammar(chat_target, tree, shape, tmp_path, monkeypatch):
    from mmvsd.drafters.eagle3 import Eagle3Drafter

    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    prompts = write_prompts(tmp_path / "val.jsonl", ["w1 w2 w3", "w7 w8"])
    monitor = evaluate.TauMonitor(chat_target, str(prompts), 0, 8, tree)
    report = monitor(Eagle3Drafter.from_target(chat_target, seed=0))
    assert evaluate.shape_text(report.shape) == shape and len(report.prompts) == 2


def test_evaluator_replays_the_auto_plan(tiny_target, fitted_drafter):
    """`--tree auto` in the evaluator: the trees AutoShape plans (from given costs, learning acceptance as it
    goes), replayed exactly; deterministic, and the shape it chose is reported as nodes per step."""
    from test_shape_policy import LinearCosts

    from mmvsd.decoding.shape_policy import AcceptanceStats, AutoShape

    prompts = PROMPTS[:3]
    continuations = evaluate.greedy_continuations(tiny_target, prompts, MAX_NEW)
    reports = [evaluate.evaluate_acceptance(tiny_target, fitted_drafter, prompts, continuations,
                                            AutoShape(LinearCosts(), AcceptanceStats()), batch_size=1)
               for _ in range(2)]
    assert reports[0].to_dict()["prompts"] == reports[1].to_dict()["prompts"]
    summary = reports[0].to_dict()
    assert summary["tree"] == "auto" and reports[0].tau > 1.0
    assert 1.0 <= summary["mean_nodes_per_step"] <= 64


def test_eval_drafter_cli_takes_tree_auto(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    prompts = write_prompts(tmp_path / "p.jsonl", ["w1 w2 w3", "w9 w8"])
    code, out, err = run_cli(capsys, "eval-drafter", "--target", str(tiny_dir), "--drafter", "random", "--prompt-file",
                             str(prompts), "--max-new-tokens", "12", "--tree", "auto", "--json",
                             str(tmp_path / "a.json"))
    assert code == 0, err
    assert "tree auto" in out and "nodes per step" in out
    assert json.loads((tmp_path / "a.json").read_text())["tree"] == "auto"


def test_image_tasks_are_read_with_their_images(llava_target, llava_dir, tmp_path, capsys, monkeypatch):
    """`--prompt-file vqav2_val_mini_long` gives the task's first turns with their images, as the bench encodes
    them (the adapter's prompt of the item's text and image), and eval-drafter replays them."""
    from mmvsd.adapters import choose_adapter
    from mmvsd.eval.suites import load_items
    from mmvsd.prompts import load_eval_prompts

    prompts = load_eval_prompts(llava_target, "vqav2_val_mini_long", limit=2)
    items = load_items("vqav2_val_mini_long", 2)
    adapter = choose_adapter(llava_target, "", "image")
    for prompt, item in zip(prompts, items, strict=True):
        item.images[0].save(tmp_path / "x.png")
        expected = adapter.encode(llava_target, item.turns[0], [tmp_path / "x.png"])
        assert len(prompt.spans) == 1 and prompt.token_ids == expected.token_ids
        assert torch.equal(prompt.inputs_embeds, expected.inputs_embeds)
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, "eval-drafter", "--target", str(llava_dir), "--drafter", "random",
                             "--prompt-file", "vqav2_val_mini_long", "--limit", "2", "--max-new-tokens", "6",
                             "--tree", "6/2/2", "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    assert json.loads((tmp_path / "e.json").read_text())["num_prompts"] == 2


def test_report_counts_continuation_tokens_outside_the_draft_vocabulary(tiny_target, fitted_drafter):
    from mmvsd.drafters.eagle3 import Eagle3Drafter
    from mmvsd.drafters.hybrid import with_ngram

    continuations = greedy_continuations(tiny_target, PROMPTS, MAX_NEW)
    shape = TreeShape(12, 4, 3)
    half = tiny_target.vocab_size // 2
    small = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=half, seed=3).eval()
    small.set_draft_vocab(torch.arange(0, 2 * half, 2))  # the even ids
    report = evaluate_acceptance(tiny_target, small, PROMPTS, continuations, shape)
    draftable = [tok for cont in continuations for tok in cont[1:]]
    odd = sum(tok % 2 for tok in draftable)
    assert 0 < odd < len(draftable) and report.num_out_of_vocab == odd
    assert report.draft_vocab_coverage == pytest.approx(1 - odd / len(draftable))
    assert report.to_dict()["draft_vocab_coverage"] == report.draft_vocab_coverage
    assert "the draft vocabulary holds" in evaluate.format_report(report)
    full = evaluate_acceptance(tiny_target, fitted_drafter, PROMPTS, continuations, shape)
    assert full.draft_vocab_coverage == 1.0
    hybrid = evaluate_acceptance(tiny_target, with_ngram(small), PROMPTS, continuations, shape, batch_size=1)
    assert hybrid.draft_vocab_coverage is None  # n-gram branches may propose any token
    assert "the draft vocabulary holds" not in evaluate.format_report(hybrid)
