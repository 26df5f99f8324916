"""studies/mmvsd_studies/vsd_study.py: arm parsing, tables and the decision, training runs and their resumption, cached
evaluations (the statistics: test_study_stats.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmvsd.decoding.decode import as_prompts
from mmvsd.errors import UserError
from mmvsd_studies import vsd_study, vsd_study_vs_start


@pytest.fixture(scope="module")
def study():
    return vsd_study


def test_seed_spread_and_table(study):
    new = np.array([[4.0, 6.0], [5.0, 7.0], [6.0, 8.0]])
    summary = study.summarise_arm(new, np.ones((3, 2)) * 2, study.prompt_resamples(2, 200, seed=0))
    assert summary["seed_taus"] == pytest.approx([2.5, 3.0, 3.5]) and summary["seed_std"] == pytest.approx(0.5)
    row = {"metric": "0", "prompts": "all", "budget": "steps", "arm": "recipe", "steps": 10, **summary,
           "vs_baseline": {"ratio": 1.1, "ratio_ci95": [1.0, 1.2], "diff": 0.3, "diff_ci95": [0.1, 0.5],
                           "goal_met": True}}
    table = study.markdown_table([row], "ce")
    assert "| tau T=0 | all | steps | recipe | 10 | 3.000 [" in table
    assert "1.100 [1.000, 1.200]" in table and "| met |" in table


def test_the_compact_table_has_each_arm_per_metric_then_its_difference(study):
    def row(metric, arm, value, budget="steps", prompts="all", diff=None):
        out = {"metric": metric, "prompts": prompts, "budget": budget, "arm": arm, "tau": value,
               "ci95": [value - 0.1, value + 0.1]}
        if diff is not None:
            out["vs_baseline"] = {"diff": diff, "diff_ci95": [diff - 0.05, diff + 0.05]}
        return out

    rows = [row("chain", "init", 1.0, budget="-"), row("chain", "ce", 1.2), row("chain", "recipe", 1.3, diff=0.1),
            row("0", "init", 2.0, budget="-"), row("0", "ce", 2.2), row("0", "recipe", 2.1, diff=-0.1),
            row("0", "recipe", 9.0, prompts="gsm8k", diff=5.0), row("0", "recipe", 9.0, budget="wall", diff=5.0)]
    table = study.compact_table(rows, "ce")
    assert "| arm | E[accepted] T=1 | tau T=0 |" in table and "| recipe | 1.300 [1.200, 1.400] | 2.100 [" in table
    assert "| init | 1.000 [0.900, 1.100] | 2.000 [1.900, 2.100] |" in table
    assert "| recipe | +0.100 [+0.050, +0.150] | -0.100 [-0.150, -0.050] |" in table
    assert "| ce | +" not in table and "9.000" not in table and "+5.000" not in table


def _compared(metric, arm, diff, low, high, prompts="all", budget="steps"):
    return {"metric": metric, "prompts": prompts, "budget": budget, "arm": arm,
            "vs_baseline": {"diff": diff, "diff_ci95": [low, high]}}


def test_the_decision_rule_is_the_pre_registered_one(study):
    rows = [{"metric": m, "prompts": "all", "budget": "steps", "arm": "ce"} for m in ("chain", "0")]
    rows += [_compared("chain", "recipe", 0.05, 0.01, 0.09), _compared("0", "recipe", -0.02, -0.10, 0.06),
             _compared("chain", "accept", 0.20, 0.12, 0.28), _compared("0", "accept", -0.15, -0.25, -0.05),
             _compared("chain", "tv", 0.03, -0.01, 0.07), _compared("0", "tv", 0.30, 0.20, 0.40),
             _compared("chain", "recipe", 9.0, 8.0, 10.0, prompts="mt_bench"),  # one set's rows do not count
             _compared("chain", "tv", 9.0, 8.0, 10.0, budget="wall")]
    decision = study.decide(rows)
    verdicts = {arm: v["beats"] for arm, v in decision["arms"].items()}
    # accept's larger gain is vetoed by its T = 0 interval below 0; tv's primary interval touches 0
    assert verdicts == {"accept": False, "recipe": True, "tv": False} and decision["winner"] == "recipe"
    rows[3] = _compared("0", "recipe", -0.05, -0.10, -0.01)
    assert study.decide(rows)["winner"] is None
    text = study.decision_text(study.decide(rows), "ce")
    assert "- recipe: does not beat ce (+0.050 [+0.010, +0.090]; -0.050 [-0.100, -0.010])" in text
    assert "- winner: none (ce stays)" in text
    assert study.decide([r for r in rows if r["metric"] == "chain"]) is None  # no T = 0 rows: no decision
    assert study.decision_text(None, "ce") == ""


def test_arm_specs_and_bad_arguments(study):
    arm = study.parse_arm("recipe-b=ce+vsd:loss.ce_weight=1.0,loss.vsd_weight=0.1")
    assert (arm.name, arm.objective, arm.overrides) == ("recipe-b", "ce+vsd",
                                                        ["loss.ce_weight=1.0", "loss.vsd_weight=0.1"])
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

    def fake_run(args, target, arm, seed, steps, output, deadline=float("inf")):
        calls.append((arm.name, seed, steps))
        return {"arm": arm.name, "seed": seed, "steps": steps, "seconds": 10.0 * steps, "folder": str(output)}

    monkeypatch.setattr(study, "train_run", fake_run)
    return calls


def test_same_wall_clock_runs_are_trained_only_when_evaluated(study, fake_training):
    calls = fake_training
    arms = [study.parse_arm(s) for s in study.DEFAULT_ARMS]
    args = study.parse_args(["--init", "x", "--steps", "4", "--seeds", "2", "--evaluate-budgets", "steps"])
    runs = study.train_all(args, None, arms)
    assert calls == [("ce", 0, 4), ("recipe", 0, 4), ("ce", 1, 4), ("recipe", 1, 4)]  # whole seeds first
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
    assert calls == [("ce", 0, 4), ("recipe", 0, 4), ("ce", 1, 4), ("recipe", 1, 4)]  # 40 s is 4 steps for both
    wall = [r for r in runs if r["budget"] == "wall"]
    assert sorted(r["folder"] for r in wall) == sorted(r["folder"] for r in runs if r["budget"] == "steps")


def test_measurements_are_cached_by_weights_and_settings(study, tmp_path, monkeypatch):
    """A second evaluation of the same weights measures nothing; other weights or a T > 0 subset are new keys."""
    import torch

    calls = []

    class Tiny(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((2,), value))

    drafters = {"a": Tiny(1.0), "b": Tiny(1.0), "c": Tiny(2.0)}

    def fake_measure(target, drafter, ps, shape, temperature, seed=0, batch_size=8, sampled_limit=0, accept_depth=0,
                     forced=False):
        calls.append((drafter.w[0].item(), temperature))
        n = len(ps.prompts) if temperature == 0 else len(ps.prompts[: sampled_limit or None])
        return [3] * n, [2] * n

    monkeypatch.setattr(study, "measure_counts", fake_measure)
    monkeypatch.setattr(study, "neural_drafter_from_spec", lambda folder, target: drafters[folder])
    sets = [study.PromptSet("p", as_prompts([[i] for i in range(5)]))]
    args = study.parse_args(["--init", "a", "--out", str(tmp_path), "--temperatures", "0,1", "--sampled-limit", "2"])
    counts = study.evaluate_all(args, None, [], sets)
    assert calls == [(1.0, 0.0), (1.0, 1.0)]
    assert counts["a"]["0"]["p"] == [[3] * 5, [2] * 5] and counts["a"]["1"]["p"] == [[3] * 2, [2] * 2]
    calls.clear()
    study.evaluate_all(args, None, [{"folder": "b"}], sets)  # b has a's weights: nothing new to measure
    assert calls == []
    study.evaluate_all(args, None, [{"folder": "c"}], sets)
    assert calls == [(2.0, 0.0), (2.0, 1.0)]
    calls.clear()
    args = study.parse_args(["--init", "a", "--out", str(tmp_path), "--temperatures", "1", "--sampled-limit", "3"])
    study.evaluate_all(args, None, [], sets)
    assert calls == [(1.0, 1.0)]  # three sampled prompts are another measurement than two


def test_evaluate_finished_measures_the_trained_runs_for_the_study_and_shares_the_cache(study, tmp_path,
                                                                                         monkeypatch):
    """--evaluate-finished measures the init drafter and every trained run (train nothing), and the study's own
    evaluation then measures nothing again; a measurement written by the other evaluator meanwhile is kept."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((2,), value))

    drafters = {"init": Tiny(0.0), str(tmp_path / "runs/ce-steps-s0"): Tiny(1.0),
                str(tmp_path / "runs/recipe-steps-s0"): Tiny(2.0)}
    calls = []
    cache_path = tmp_path / study.EVAL_CACHE_FILE

    def fake_measure(target, drafter, ps, shape, temperature, seed=0, batch_size=8, sampled_limit=0, accept_depth=0,
                     forced=False):
        calls.append(drafter.w[0].item())
        if drafter.w[0].item() == 2.0:  # the other process writes a measurement while this one is measured
            written = json.loads(cache_path.read_text())
            cache_path.write_text(json.dumps({**written, "other": [[1], [1]]}))
        return [3] * len(ps.prompts), [2] * len(ps.prompts)

    monkeypatch.setattr(study, "measure_counts", fake_measure)
    monkeypatch.setattr(study, "neural_drafter_from_spec", lambda folder, target: drafters[folder])
    sets = [study.PromptSet("p", as_prompts([[i] for i in range(4)]))]
    monkeypatch.setattr(study, "study_prompt_sets", lambda args, target: sets)
    for name in ("ce-steps-s0", "recipe-steps-s0"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / study.RUN_FILE).write_text(json.dumps({"folder": str(tmp_path / "runs" / name)}))
    (tmp_path / "runs" / "accept-steps-s0").mkdir()  # still training: no record, not measured
    args = study.parse_args(["--init", "init", "--out", str(tmp_path), "--evaluate-finished"])
    assert study.evaluate_finished(args, target=object()) == 2
    assert calls == [0.0, 1.0, 2.0]
    assert "other" in json.loads(cache_path.read_text())  # merged, not overwritten
    calls.clear()
    runs = [{"folder": str(tmp_path / "runs" / name)} for name in ("ce-steps-s0", "recipe-steps-s0")]
    counts = study.evaluate_all(args, None, runs, sets)
    assert calls == [] and counts[runs[1]["folder"]]["0"]["p"] == [[3] * 4, [2] * 4]


def test_a_session_budget_leaves_runs_to_resume(study, monkeypatch, capsys):
    """--session-minutes: runs the budget does not reach are reported, and the study stops with exit 3."""
    def fake_run(args, target, arm, seed, steps, output, deadline=float("inf")):
        if seed > 0:
            raise study.Unfinished
        return {"arm": arm.name, "seed": seed, "steps": steps, "seconds": 1.0, "folder": str(output)}

    monkeypatch.setattr(study, "train_run", fake_run)
    arms = [study.parse_arm(s) for s in study.DEFAULT_ARMS]
    args = study.parse_args(["--init", "x", "--steps", "4", "--seeds", "2", "--evaluate-budgets", "steps",
                             "--session-minutes", "5"])
    with pytest.raises(study.Unfinished):
        study.train_all(args, None, arms)
    assert "2 run(s) unfinished (ce-steps-s1, recipe-steps-s1)" in capsys.readouterr().err
    bad = study.parse_args(["--init", "x", "--session-minutes", "5"])
    with pytest.raises(UserError, match="--session-minutes trains in chunks"):
        study.check_args(bad, arms)


def test_a_run_trained_in_chunks_resumes_to_the_uninterrupted_weights(study, tmp_path, capsys):
    """train_run with the real trainer on a tiny target: a spent budget starts nothing (Unfinished); a run stops at
    the manipulation check's step and goes on; a run stopped after its first step resumes from its checkpoint to
    the weights of the run trained without a stop; a check the run cannot pass stops the study with the fix."""
    from safetensors.torch import load_file

    from conftest import TINY, save_tiny_target, write_sharegpt
    from mmvsd.cli import main
    from mmvsd.target_loader import load_target
    from mmvsd.training.trainer import train

    target_dir, data = save_tiny_target(tmp_path / "target"), write_sharegpt(tmp_path / "data.json")
    init = tmp_path / "init"
    assert main(["train", "--target", str(target_dir), "--data", str(data), "--output", str(init), *TINY,
                 "max_steps=1"]) == 0
    common = ["--init", str(init), "--target", str(target_dir), "--config", "", "--lr", "0.01", "--out",
              str(tmp_path / "study"), "--set", f"data={data}", *[f"--set={s}" for s in TINY]]
    args = study.parse_args(common + ["--min-move", "0.001", "--check-steps", "2"])
    arm = study.parse_arm("ce=ce")
    target = load_target(str(target_dir))
    with pytest.raises(study.Unfinished):  # the session's budget is already spent
        study.train_run(args, target, arm, 0, 3, tmp_path / "chunked", deadline=0.0)
    assert not (tmp_path / "chunked").exists()  # a spent budget starts nothing
    record = study.train_run(args, target, arm, 0, 3, tmp_path / "checked")
    assert record["steps"] == 3 and record["moved"] > 0.001 and record["check_step"] == 2  # stopped there, went on
    assert json.loads((tmp_path / "checked" / "study_progress.json").read_text())["chunks"] == 2
    plain = study.parse_args(common)  # no check: one chunk
    study.train_run(plain, target, arm, 0, 3, tmp_path / "whole")
    assert json.loads((tmp_path / "whole" / "study_progress.json").read_text())["chunks"] == 1
    progress = tmp_path / "chunked" / "study_progress.json"
    config = study.run_config(args, arm, 0, 3, tmp_path / "chunked")
    config.max_minutes = 1e-9  # the trainer stops after its first step
    train(config, target=target)
    assert not progress.exists()
    first = study.train_run(plain, target, arm, 0, 3, tmp_path / "chunked")  # resumes from step 1
    assert first["steps"] == 3
    whole, chunked, checked = (load_file(str(tmp_path / name / "model.safetensors"))
                               for name in ("whole", "chunked", "checked"))
    for key, value in whole.items():
        torch.testing.assert_close(chunked[key], value)
        torch.testing.assert_close(checked[key], value)
    strict = study.parse_args(common + ["--min-move", "10", "--out", str(tmp_path / "strict")])
    with pytest.raises(UserError, match="manipulation check: .* raise --lr"):
        study.train_run(strict, target, arm, 0, 2, tmp_path / "strict" / "runs" / "ce-steps-s0")


def test_the_chain_metrics_counts_are_the_evaluators_sums(study, tiny_target, random_drafter):
    """"chain" is the unbiased estimate, "forced" the teacher-forced product; their cache keys differ (the
    product's keeps the name "accept" it had), and a key changes with the prompts' tokens."""
    from mmvsd.eval.acceptance import expected_acceptance

    gen = torch.Generator().manual_seed(3)
    prompts = as_prompts([torch.randint(0, 128, (n,), generator=gen).tolist() for n in (4, 7, 5)])
    sampled = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 6, 8)]
    totals, anchors = study.measure_counts(tiny_target, random_drafter, study.PromptSet("p", prompts, sampled=sampled),
                                           None, 1.0, accept_depth=3, batch_size=2)
    forced, _ = study.measure_counts(tiny_target, random_drafter, study.PromptSet("p", prompts, sampled=sampled),
                                     None, 1.0, accept_depth=3, batch_size=2, forced=True)
    chains = expected_acceptance(tiny_target, random_drafter, prompts, sampled, depth=3)
    assert totals == pytest.approx([c.total for c in chains]) and anchors == [c.anchors for c in chains]
    assert forced == pytest.approx([c.forced_total for c in chains]) and forced != pytest.approx(totals)
    args = study.parse_args(["--init", "x", "--accept-depth", "3", "--temperatures", "0,1"])
    assert study.metric_names(args) == ["chain", "forced", "0", "1"]
    keys = [json.loads(study.evaluation_key(args, "d", m, study.PromptSet("p", prompts))) for m in ("chain", "forced")]
    assert keys[0][5] == "chain" and keys[1][5] == "accept" and keys[0][:5] == keys[1][:5]
    edited = as_prompts([p.token_ids[:-1] + [p.token_ids[-1] + 1] for p in prompts])  # same name and count
    assert json.loads(study.evaluation_key(args, "d", "chain", study.PromptSet("p", edited)))[3] != keys[0][3]
    timed = [json.loads(study.evaluation_key(args, "d", "1", study.PromptSet("p", ps))) for ps in (prompts, edited)]
    assert timed[0][3] != timed[1][3]
    assert anchors == [8, 5, 7]  # every continuation token after the first is an anchor's next-but-one token


def test_the_training_target_is_loaded_as_mmvsd_train_loads_it(study, tiny_target, monkeypatch):
    """run_study trains on the config's target_dtype and target_engine (`load_training_target`), and reuses the
    evaluation's fp32 target when the config asks for fp32 (the engine only changes a half-precision target)."""
    loaded, trained_on = [], []

    class Stop(Exception):
        pass

    def fake_load(config, device):
        loaded.append((config.target_dtype, config.target_engine, device))
        return "the training target"

    def fake_train_all(args, target, arms):
        trained_on.append(target)
        raise Stop

    monkeypatch.setattr(study, "load_training_target", fake_load)
    monkeypatch.setattr(study, "train_all", fake_train_all)
    base = ["--init", "x", "--config", "", "--seeds", "1", "--evaluate-budgets", "steps", "--set", "data=x.json"]
    for sets, expected in ((["target_dtype=fp32", "target_engine=exact"], []),
                           (["target_dtype=fp32", "target_engine=stock"], []),
                           (["target_dtype=bf16", "target_engine=exact"], [("bf16", "exact", "cpu")]),
                           (["target_dtype=bf16", "target_engine=stock"], [("bf16", "stock", "cpu")])):
        loaded.clear(), trained_on.clear()
        args = study.parse_args(base + [f"--set={s}" for s in sets])
        with pytest.raises(Stop):
            study.run_study(args, target=tiny_target)
        assert loaded == expected
        assert trained_on == [tiny_target if not expected else "the training target"]


def test_each_arm_against_its_start_is_the_direct_paired_difference():
    vs_start = vsd_study_vs_start
    init = "start"
    start = {"a": [[2.0, 4.0], [1.0, 2.0]], "b": [[3.0], [1.0]]}  # per prompt: tokens 2, 4, 3 over 1, 2, 1 forwards
    ones = [[1.0, 1.0], [1.0]]

    def counts(values):  # forwards 1: pooled tau is the mean of the values over the three prompts
        return {"a": [values[:2], ones[0]], "b": [values[2:], ones[1]]}

    seeds = {"ce-s0": [3.0, 3.0, 4.0], "ce-s1": [2.0, 3.0, 6.0], "acc-s0": [1.0, 1.0, 1.0]}
    study_json = {
        "config": {"init": init},
        "counts": {init: {"accept": start}, **{f: {"accept": counts(v)} for f, v in seeds.items()}},
        "runs": [{"arm": "ce", "seed": 1, "budget": "steps", "folder": "ce-s1"},
                 {"arm": "ce", "seed": 0, "budget": "steps", "folder": "ce-s0"},
                 {"arm": "acc", "seed": 0, "budget": "steps", "folder": "acc-s0"},
                 {"arm": "acc", "seed": 0, "budget": "wall", "folder": "ignored"}],
    }
    rows = {r["arm"]: r for r in vs_start.vs_start(study_json, bootstrap=200)}
    start_tau = 9.0 / 4.0  # pooled over the three prompts; per prompt 2, 2, 3
    assert rows["ce"]["diff"] == pytest.approx(3.5 - start_tau)  # the seeds' pooled taus 10 / 3 and 11 / 3
    assert rows["ce"]["seed0_diff"] == pytest.approx(10.0 / 3.0 - start_tau)  # seed 0, listed second
    assert rows["acc"]["diff"] == pytest.approx(1.0 - start_tau)
    low, high = rows["ce"]["diff_ci95"]
    assert 0 < low <= rows["ce"]["diff"] <= high
    assert rows["acc"]["diff_ci95"][1] < 0
    assert rows["ce"]["metric"] == "forced"  # an old study's name for the teacher-forced product
    assert "E[accepted] T=1, teacher-forced | ce | +1.250" in vs_start.markdown(list(rows.values()))
