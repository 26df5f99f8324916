"""The scale issue's study tools: the pilot's read-out (scale_pilot.py), its prompts (heldout_prompts.py) and the
learning curve from the trainer's per-step log (learning_curve.py)."""

import json

import pytest

from mmvsd_studies import heldout_prompts, learning_curve, scale_pilot


def _report(per_prompt: list[list[int]]) -> dict:
    """An eval-drafter report whose prompt i replayed steps accepting per_prompt[i][s] draft tokens (prefill first)."""
    prompts = []
    for accepted in per_prompt:
        lengths = [1] + [a + 1 for a in accepted]
        prompts.append({"new_tokens": sum(lengths), "target_forwards": len(lengths), "accept_lengths": lengths})
    return {"prompts": prompts}


def test_measures_are_pooled_over_prompts_as_counted_directly():
    report = _report([[0, 1, 3], [2, 0], [3, 3, 3, 0]])
    counts = scale_pilot.prompt_counts(report)
    steps = 3 + 2 + 4
    first = sum(a > 0 for p in ([0, 1, 3], [2, 0], [3, 3, 3, 0]) for a in p)
    accepted = 0 + 1 + 3 + 2 + 0 + 3 + 3 + 3 + 0
    assert counts["first_token"][0].sum() / counts["first_token"][1].sum() == pytest.approx(first / steps)
    assert counts["chain_3"][0].sum() / counts["chain_3"][1].sum() == pytest.approx(accepted / steps)
    result = scale_pilot.pilot({"ce": report}, "ce", {"ce": {**report, "tree": "60/7/10"}}, resamples_count=50)
    assert result["arms"]["ce"]["first_token"]["value"] == pytest.approx(6 / 9)
    assert result["arms"]["ce"]["tau_60_7_10"] == pytest.approx((9 + 15 + 3) / (4 + 3 + 5))
    assert result["decision"] == "ce"


def test_an_arm_beats_loses_or_ties_by_the_registered_rule():
    base = [[1, 0, 2, 0, 1]] * 30
    better = [[2, 1, 3, 1, 2]] * 30  # more tokens at every step, more first tokens
    reports = {"ce": _report(base), "ce+accept": _report(better), "ce+vsd": _report(base),
               "start": _report([[0, 0, 1, 0, 0]] * 30)}
    result = scale_pilot.pilot(reports, "ce", {}, references=("start",), resamples_count=200)
    arms = result["arms"]
    assert arms["ce+accept"]["verdict"] == "beats" and arms["ce+accept"]["vs_baseline"]["chain_3"]["diff"] > 0
    assert arms["ce+vsd"]["verdict"] == "tie" and arms["ce+vsd"]["vs_baseline"]["chain_3"]["diff"] == 0
    assert arms["start"]["verdict"] == "loses"
    assert result["decision"] == "ce+accept"
    reports["start"] = _report([[3, 3, 3, 3, 3]] * 30)  # a reference that beats everything is not a candidate
    assert scale_pilot.pilot(reports, "ce", {}, references=("start",), resamples_count=200)["decision"] == "ce+accept"
    assert "decision: ce+accept" in scale_pilot.format_pilot(result)


def test_the_first_token_rule_decides_by_the_first_token():
    """Fewer first tokens at an equal chain: a tie by the pilot's rule, a loss by a new default's; and the reverse."""
    base, fewer_first = _report([[1, 1, 0, 0]] * 20), _report([[2, 0, 0, 0]] * 20)
    chain = scale_pilot.pilot({"b": base, "a": fewer_first}, "b", {}, resamples_count=100)
    first = scale_pilot.pilot({"b": base, "a": fewer_first}, "b", {}, resamples_count=100, rule="first-token")
    assert chain["arms"]["a"]["verdict"] == "tie" and chain["rule"] == "chain"
    assert first["arms"]["a"]["verdict"] == "loses" and first["rule"] == "first-token"
    reverse = scale_pilot.pilot({"b": fewer_first, "a": base}, "b", {}, resamples_count=100, rule="first-token")
    assert reverse["arms"]["a"]["verdict"] == "beats" and reverse["decision"] == "a"


def test_an_arm_may_be_several_reports_read_as_one(tmp_path, capsys):
    """One report per image task: the arm's prompts are theirs in order, and the read-out equals one report's."""
    first, second = _report([[1, 0, 2]] * 3), _report([[0, 3]] * 4)
    for name, report in {"a1": first, "a2": second, "b": _report([[1, 0, 2]] * 3 + [[0, 3]] * 4)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**report, "tree": "4/3/1"}))
    out = tmp_path / "out.json"
    assert scale_pilot.main(["--arm", f"a={tmp_path / 'a1.json'},{tmp_path / 'a2.json'}", "--arm",
                             f"b={tmp_path / 'b.json'}", "--baseline", "b", "--out", str(out)]) == 0
    arms = json.loads(out.read_text())["arms"]
    assert arms["a"]["first_token"] == arms["b"]["first_token"] and arms["a"]["vs_baseline"]["chain_3"]["diff"] == 0
    (tmp_path / "a2.json").write_text(json.dumps({**second, "tree": "60/5/8"}))
    with pytest.raises(SystemExit, match="different trees"):
        scale_pilot.main(["--arm", f"a={tmp_path / 'a1.json'},{tmp_path / 'a2.json'}", "--baseline", "a"])


def test_a_heldout_file_splits_the_comparison_by_domain(tmp_path, capsys):
    """`--heldout`: pooled, then each domain on its own prompts, each equal to the pilot of those prompts alone."""
    chat, math = [[1, 0, 2], [2, 0]], [[3, 3], [2, 1, 0]]
    reports = {"base": _report(chat + math), "new": _report([[0, 0, 0], [0, 1]] + [[3, 3], [3, 3, 3]])}
    for name, report in reports.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**report, "tree": "4/3/1"}))
    heldout = tmp_path / "h.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": f"p{i}", "domain": d}) + "\n"
                               for i, d in enumerate(["chat", "chat", "math", "math"])))
    out = tmp_path / "out.json"
    arms = [f"--arm={name}={tmp_path / name}.json" for name in reports]
    assert scale_pilot.main([*arms, "--baseline", "base", "--heldout", str(heldout), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result) == ["all", "chat", "math"] and "math:" in capsys.readouterr().out
    alone = scale_pilot.pilot({"base": _report(math), "new": _report([[3, 3], [3, 3, 3]])}, "base")
    assert result["math"] == json.loads(json.dumps(alone))
    assert result["math"]["arms"]["base"]["first_token"]["value"] == pytest.approx(4 / 5)
    assert result["all"] == json.loads(json.dumps(scale_pilot.pilot(reports, "base")))
    heldout.write_text(json.dumps({"prompt": "p", "domain": "chat"}) + "\n")
    with pytest.raises(SystemExit, match="do not match"):
        scale_pilot.main([*arms, "--baseline", "base", "--heldout", str(heldout)])


def test_heldout_prompts_are_the_datasets_last_chat_turns_and_later_benchmark_items(tmp_path):
    out = tmp_path / "heldout.jsonl"
    options = ["--chat", "3", "--math", "2", "--math-start", "5", "--code", "2", "--code-start", "150"]
    assert heldout_prompts.main(["--out", str(out), *options]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["source"] for row in rows[3:]] == ["gsm8k:5", "gsm8k:6", "humaneval:HumanEval/150",
                                                   "humaneval:HumanEval/151"]
    assert [row["domain"] for row in rows] == ["chat"] * 3 + ["math"] * 2 + ["code"] * 2
    assert rows[5]["prompt"].lstrip().startswith("def ") or "def " in rows[5]["prompt"]
    assert all(row["source"].startswith("sharegpt:") and 16 <= len(row["prompt"].strip()) <= 1200 for row in rows[:3])
    again = tmp_path / "again.jsonl"
    heldout_prompts.main(["--out", str(again), *options])
    assert again.read_text() == out.read_text()


def test_a_train_metric_is_averaged_over_windows_of_steps(tmp_path):
    lines = [{"step": step, "tokens_seen": 100 * step, "acc_0": step / 10} for step in range(1, 6)]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    points = learning_curve.read_train_metric(tmp_path, "acc_0", window=2)
    assert [(p["step"], p["tokens_seen"], p["steps"]) for p in points] == [(2, 200, 2), (4, 400, 2), (5, 500, 1)]
    assert [p["acc_0"] for p in points] == pytest.approx([0.15, 0.35, 0.5])
    with pytest.raises(SystemExit, match="has no 'acc_9'"):
        learning_curve.read_train_metric(tmp_path, "acc_9", window=2)
