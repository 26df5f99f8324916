"""The ceiling probes' driver: the pre-registered settings reach every arm's command, the comparison is the pilot's
paired one pooled and per domain, and a rerun replays nothing an arm already finished."""

from __future__ import annotations

import argparse
import json

import pytest

from mmvsd_studies import ceiling_probe
from mmvsd_studies.ceiling_probe import DONE, PROBES, eval_command, run_probe, train_command
from mmvsd_studies.scale_pilot import pilot_by_domain


def report(first_steps: list[list[int]]) -> dict:
    """An eval-drafter report whose prompts accepted these counts (0-3) per tree step (prefill first)."""
    return {"tree": "4/3/1", "prompts": [{"accept_lengths": [1] + [a + 1 for a in steps], "new_tokens": 1,
                                          "target_forwards": 1} for steps in first_steps]}


def test_every_arm_gets_the_shared_settings_and_its_own(tmp_path):
    for _question, arms in PROBES.values():
        assert len(arms) == 2
        for settings in arms.values():
            command = train_command("smollm2-135m", "c.yaml", "DATA", tmp_path / "arm", settings, 90)
            assert command[:2] == ["mmvsd", "train"] and command[-1] == "max_minutes=90"
            shared = [command.index(setting) for setting in ceiling_probe.SHARED]
            own = [command.index(setting) for setting in settings]
            assert max(shared) < min(own)  # the arm's own settings come last: they win over the shared ones
    assert eval_command("t", tmp_path, "h.jsonl", tmp_path / "r.json")[-2:] == ["--json", str(tmp_path / "r.json")]
    assert "--ngram" in ceiling_probe.EVAL and "4/3/1" in ceiling_probe.EVAL


def test_the_comparison_pools_and_splits_by_domain():
    better = [[1, 1, 2], [2, 3, 1], [1, 1, 1], [3, 2, 2]] * 5
    worse = [[0, 0, 1], [1, 0, 0], [0, 1, 0], [0, 0, 0]] * 5
    domains = ["chat", "math"] * 10
    result = pilot_by_domain({"base": report(worse), "other": report(better)}, "base", domains)
    assert set(result) == {"all", "chat", "math"}
    assert result["all"]["arms"]["other"]["verdict"] == "beats" and result["all"]["decision"] == "other"
    first = result["all"]["arms"]["other"]["first_token"]["value"]
    assert first == pytest.approx(1.0)  # every step of the better arm accepted its first draft token
    assert result["all"]["arms"]["base"]["first_token"]["value"] == pytest.approx(3 / 12)
    tie = pilot_by_domain({"base": report(worse), "other": report(worse)}, "base", domains)
    assert tie["all"]["arms"]["other"]["verdict"] == "tie" and tie["all"]["decision"] == "base"


def test_a_rerun_replays_nothing_an_arm_finished(tmp_path, monkeypatch):
    heldout = tmp_path / "h.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": f"p{i}", "domain": "chat"}) + "\n" for i in range(4)))
    for name in PROBES["ttt"][1]:
        arm = tmp_path / "work" / "ttt" / name
        arm.mkdir(parents=True)
        (arm / "heldout.json").write_text(json.dumps(report([[1, 0], [2, 2], [1, 0], [3, 1]])))
        (arm / DONE).write_text(json.dumps({"step": 7}))
    monkeypatch.setattr(ceiling_probe.subprocess, "Popen", lambda *a, **k: pytest.fail("started a command"))
    args = argparse.Namespace(probe="ttt", work=str(tmp_path / "work"), target="t", config="c", data="d",
                              heldout=str(heldout), minutes=90.0)
    result = run_probe(args)
    assert result["baseline"] == "ttt-3" and result["arms"]["ttt-7"]["step"] == 7
    assert result["comparison"]["all"]["arms"]["ttt-7"]["verdict"] == "tie"
