"""benchmarks/vsd_study.py: the bootstrap statistics on data with known answers, arm parsing, tables."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmvsd.errors import UserError

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vsd_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("vsd_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vsd_study"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_pooled_tau_is_total_tokens_over_total_forwards(study):
    new = np.array([[10, 30], [8, 8]], dtype=float)
    fwd = np.array([[5, 10], [4, 2]], dtype=float)
    assert study.pooled_tau(new, fwd).tolist() == pytest.approx([40 / 15, 16 / 6])
    resamples = np.array([[0, 0], [1, 1], [0, 1]])
    boot = study.bootstrap_taus(new, fwd, resamples)  # seeds averaged inside each resample
    assert boot.tolist() == pytest.approx([(2 + 2) / 2, (3 + 4) / 2, (40 / 15 + 16 / 6) / 2])


def test_bootstrap_interval_of_a_mean_matches_the_normal_theory_width(study):
    rng = np.random.default_rng(0)
    values = rng.normal(2.0, 0.5, size=400)  # forwards = 1: pooled tau is the plain mean
    new, fwd = values[None], np.ones((1, 400))
    summary = study.summarise_arm(new, fwd, study.prompt_resamples(400, 4000, seed=1))
    low, high = summary["ci95"]
    assert summary["tau"] == pytest.approx(values.mean())
    assert low < values.mean() < high
    assert high - low == pytest.approx(2 * 1.96 * values.std() / np.sqrt(400), rel=0.1)


def test_bootstrap_interval_covers_the_true_mean_about_95_percent_of_the_time(study):
    rng = np.random.default_rng(2)
    covered = 0
    for trial in range(300):
        values = rng.exponential(1.5, size=60) + 1.0  # skewed, true mean 2.5
        summary = study.summarise_arm(values[None], np.ones((1, 60)), study.prompt_resamples(60, 500, seed=trial))
        covered += summary["ci95"][0] <= 2.5 <= summary["ci95"][1]
    assert 0.88 <= covered / 300 <= 0.99  # percentile bootstrap at n = 60: slightly under 95%


def test_paired_comparison_sees_a_small_constant_gain_that_unpaired_intervals_hide(study):
    rng = np.random.default_rng(3)
    base_values = rng.uniform(1.0, 4.0, size=(3, 50))  # 3 seeds, prompts vary a lot
    baseline = (base_values, np.ones((3, 50)))
    arm = (base_values * 1.06, np.ones((3, 50)))  # 6% more tokens on every prompt
    resamples = study.prompt_resamples(50, 2000, seed=0)
    cmp = study.compare_arms(arm, baseline, resamples, goal_ratio=1.05)
    assert cmp["ratio"] == pytest.approx(1.06)
    assert cmp["ratio_ci95"] == pytest.approx([1.06, 1.06])  # identical resamples: no prompt noise
    assert cmp["diff_ci95"][0] > 0 and cmp["goal_met"]
    base_ci, arm_ci = (study.summarise_arm(*x, resamples)["ci95"] for x in (baseline, arm))
    assert arm_ci[0] < base_ci[1]  # the separate intervals overlap
    worse = study.compare_arms(baseline, arm, resamples)
    assert worse["diff_ci95"][1] < 0 and not worse["goal_met"]
    noisy = study.compare_arms((base_values + rng.normal(0, 1.0, (3, 50)), np.ones((3, 50))), baseline, resamples)
    assert noisy["diff_ci95"][0] < 0 < noisy["diff_ci95"][1] and not noisy["goal_met"]


def test_seed_spread_and_table(study):
    new = np.array([[4.0, 6.0], [5.0, 7.0], [6.0, 8.0]])
    summary = study.summarise_arm(new, np.ones((3, 2)) * 2, study.prompt_resamples(2, 200, seed=0))
    assert summary["seed_taus"] == pytest.approx([2.5, 3.0, 3.5]) and summary["seed_std"] == pytest.approx(0.5)
    row = {"temperature": 0.0, "prompts": "all", "budget": "steps", "arm": "recipe", "steps": 10, **summary,
           "vs_baseline": {"ratio": 1.1, "ratio_ci95": [1.0, 1.2], "diff": 0.3, "diff_ci95": [0.1, 0.5], "goal_met": True}}
    table = study.markdown_table([row], "ce")
    assert "| 0 | all | steps | recipe | 10 | 3.000 [" in table and "1.100 [1.000, 1.200]" in table and "| met |" in table


def test_arm_specs_and_bad_arguments(study):
    arm = study.parse_arm("recipe-b=ce+vsd:loss.ce_weight=1.0,loss.vsd_weight=0.1")
    assert (arm.name, arm.objective, arm.overrides) == ("recipe-b", "ce+vsd", ["loss.ce_weight=1.0", "loss.vsd_weight=0.1"])
    assert study.parse_arm("ce=ce").overrides == []
    with pytest.raises(UserError, match="NAME=OBJECTIVE"):
        study.parse_arm("recipe")
    args = study.parse_args(["--init", "x", "--arm", "ce=ce", "--arm", "vsd=vsd"])
    with pytest.raises(UserError, match="--budget-arm 'recipe' is not an arm"):
        study.check_args(args, [study.parse_arm(s) for s in args.arm])
    args = study.parse_args(["--init", "x", "--arm", "ce=ce", "--arm", "r=ce+vsd:loss.ce_weight=0,loss.vsd_weight=0",
                             "--budget-arm", "r", "--target", "t"])
    arms = [study.parse_arm(s) for s in args.arm]
    study.check_args(args, arms)
    assert args.evaluate_budgets == ["steps", "wall"]
    bad = study.parse_args(["--init", "x", "--evaluate-budgets", "wall,time"])
    with pytest.raises(UserError, match="--evaluate-budgets takes steps, wall or both"):
        study.check_args(bad, [study.parse_arm(s) for s in study.DEFAULT_ARMS])
    with pytest.raises(UserError, match="trains nothing"):  # every run's config is checked before training
        study.run_config(args, arms[1], 0, 5, Path("unused"))


def test_image_tasks_are_study_prompt_sets_with_their_images(study, llava_target, tmp_path, monkeypatch):
    """The multimodal pair of the study: an image task's prompts carry their images into the evaluator."""
    from mmvsd.prompts import load_eval_prompts

    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    [prompt_set] = study.load_prompt_sets(llava_target, ["vqav2_val_mini_long"], limit=2, max_new_tokens=4)
    expected = load_eval_prompts(llava_target, "vqav2_val_mini_long", limit=2)
    assert prompt_set.name == "vqav2_val_mini_long" and len(prompt_set.continuations) == 2
    for prompt, want in zip(prompt_set.prompts, expected, strict=True):
        assert len(prompt.spans) == 1 and prompt.token_ids == want.token_ids
        assert torch.equal(prompt.inputs_embeds, want.inputs_embeds)


@pytest.fixture
def fake_training(study, monkeypatch):
    """train_run replaced by a recorder (10 s per step): the list of (arm, seed, steps) it was asked for."""
    calls = []

    def fake_run(args, target, arm, seed, steps, output):
        calls.append((arm.name, seed, steps))
        return {"arm": arm.name, "seed": seed, "steps": steps, "seconds": 10.0 * steps, "folder": str(output)}

    monkeypatch.setattr(study, "train_run", fake_run)
    return calls


def test_same_wall_clock_runs_are_trained_only_when_evaluated(study, fake_training):
    calls = fake_training
    arms = [study.parse_arm(s) for s in study.DEFAULT_ARMS]
    args = study.parse_args(["--init", "x", "--steps", "4", "--seeds", "2", "--evaluate-budgets", "steps"])
    runs = study.train_all(args, None, arms)
    assert calls == [("ce", 0, 4), ("ce", 1, 4), ("recipe", 0, 4), ("recipe", 1, 4)]
    assert {r["budget"] for r in runs} == {"steps"}
    calls.clear()
    args = study.parse_args(["--init", "x", "--steps", "4", "--seeds", "2", "--wall-seconds", "80"])
    runs = study.train_all(args, None, arms)
    assert calls[4:] == [("ce", 0, 8), ("ce", 1, 8), ("recipe", 0, 8), ("recipe", 1, 8)]  # 80 s at 10 s per step
    assert sum(r["budget"] == "wall" for r in runs) == 4


def test_a_wall_clock_run_of_as_many_steps_as_its_same_steps_run_is_not_trained_again(study, fake_training):
    calls = fake_training
    arms = [study.parse_arm(s) for s in study.DEFAULT_ARMS]
    args = study.parse_args(["--init", "x", "--steps", "4", "--seeds", "2", "--wall-seconds", "40"])
    runs = study.train_all(args, None, arms)
    assert calls == [("ce", 0, 4), ("ce", 1, 4), ("recipe", 0, 4), ("recipe", 1, 4)]  # 40 s is 4 steps for both
    wall = [r for r in runs if r["budget"] == "wall"]
    assert [r["folder"] for r in wall] == [r["folder"] for r in runs if r["budget"] == "steps"]


def test_measurements_are_cached_by_weights_and_settings(study, tmp_path, monkeypatch):
    """A second evaluation of the same weights measures nothing; other weights or a T > 0 subset are new keys."""
    import torch

    calls = []

    class Tiny(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((2,), value))

    drafters = {"a": Tiny(1.0), "b": Tiny(1.0), "c": Tiny(2.0)}

    def fake_measure(target, drafter, ps, shape, temperature, seed=0, batch_size=8, sampled_limit=0):
        calls.append((drafter.w[0].item(), temperature))
        n = len(ps.prompts) if temperature == 0 else len(ps.prompts[: sampled_limit or None])
        return [3] * n, [2] * n

    monkeypatch.setattr(study, "measure_counts", fake_measure)
    monkeypatch.setattr("mmvsd.drafters.spec.neural_drafter_from_spec", lambda folder, target: drafters[folder])
    sets = [study.PromptSet("p", [None] * 5)]
    args = study.parse_args(["--init", "a", "--out", str(tmp_path), "--temperatures", "0,1", "--sampled-limit", "2"])
    counts = study.evaluate_all(args, None, [], sets)
    assert calls == [(1.0, 0.0), (1.0, 1.0)]
    assert counts["a"]["0.0"]["p"] == [[3] * 5, [2] * 5] and counts["a"]["1.0"]["p"] == [[3] * 2, [2] * 2]
    calls.clear()
    study.evaluate_all(args, None, [{"folder": "b"}], sets)  # b has a's weights: nothing new to measure
    assert calls == []
    study.evaluate_all(args, None, [{"folder": "c"}], sets)
    assert calls == [(2.0, 0.0), (2.0, 1.0)]
    calls.clear()
    args = study.parse_args(["--init", "a", "--out", str(tmp_path), "--temperatures", "1", "--sampled-limit", "3"])
    study.evaluate_all(args, None, [], sets)
    assert calls == [(1.0, 1.0)]  # three sampled prompts are another measurement than two
