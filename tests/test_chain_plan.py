"""The chain plan for engines that verify chains (llama.cpp's n_max / p_min): its arithmetic against direct
computation, its choice against an exhaustive search and against simulated decoding, and the recorder on the
exact replay."""

from __future__ import annotations

import random

import pytest

from conftest import PROMPT_POOL
from mmvsd.decoding.chain_plan import (
    ChainCosts,
    ChainRecorder,
    ChainSample,
    expected_rate,
    plan_chain,
    step_outcome,
)
from mmvsd.eval.acceptance import evaluate_acceptance, greedy_continuations

COSTS = ChainCosts(verify_seconds=(0.010, 0.012, 0.015, 0.019, 0.024), draft_seconds=0.001)


def test_step_outcome_follows_llama_cpps_loop():
    sample = ChainSample((0.9, 0.8, 0.3, 0.95), accepted=3)
    assert step_outcome(sample, 4, 0.0) == (4, 3, 4)  # n_max reached: no forward after the 4th token
    assert step_outcome(sample, 4, 0.5) == (2, 2, 3)  # the 3rd token (0.3) stops the chain after its forward
    assert step_outcome(sample, 1, 0.5) == (1, 1, 1)
    assert step_outcome(sample, 4, 0.95) == (0, 0, 1)  # nothing drafted: a plain step plus one drafter forward


def test_expected_rate_is_tokens_over_seconds():
    samples = [ChainSample((0.9, 0.2), 2), ChainSample((0.4, 0.9), 0)]
    # n=2, p=0.3: first drafts 1 (0.2 stops; 2 forwards), accepts 1; second drafts 1 (0.9 not reached? no: n=2,
    # 0.4 >= 0.3 then 0.9 >= 0.3 -> 2 drafted, 2 forwards), accepts 0
    tokens = (1 + 1) + (1 + 0)
    seconds = (COSTS.verify(2) + 2 * 0.001) + (COSTS.verify(3) + 2 * 0.001)
    assert expected_rate(samples, COSTS, 2, 0.3) == pytest.approx(tokens / seconds)
    assert COSTS.verify(7) == pytest.approx(0.024 + 2 * 0.005)  # the last slope continues


def world(seed: int, size: int, depth: int) -> list[ChainSample]:
    """A calibrated drafter: each drafted token is right with its own draft probability."""
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        probs = tuple(rng.betavariate(2, 1.2) for _ in range(depth))
        accepted = 0
        while accepted < depth and rng.random() < probs[accepted]:
            accepted += 1
        out.append(ChainSample(probs, accepted))
    return out


def test_plan_is_the_best_of_an_exhaustive_search():
    samples = world(0, 400, 5)
    plan = plan_chain(samples, COSTS)
    best = max(expected_rate(samples, COSTS, n, p) for n in range(1, 6) for p in (0.0, 0.05, 0.1, 0.15, 0.2, 0.3,
                                                                                    0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
    assert plan.rate == pytest.approx(best) and plan.table[(plan.n_max, plan.p_min)] == pytest.approx(best)
    assert plan.plain_rate == pytest.approx(100.0) and plan.speedup > 1


def simulate(samples_at: list[ChainSample], costs: ChainCosts, n_max: int, p_min: float) -> float:
    """Decode a stream whose every position has its chain: advance by accepted + 1 per step."""
    position = tokens = 0
    seconds = 0.0
    while position < len(samples_at):
        drafted, accepted, forwards = step_outcome(samples_at[position], n_max, p_min)
        tokens += 1 + accepted
        seconds += costs.verify(1 + drafted) + forwards * costs.draft_seconds
        position += 1 + accepted
    return tokens / seconds


def test_plan_choice_is_near_the_best_simulated_decoding():
    stream = world(1, 4000, 5)
    plan = plan_chain(stream[::3], COSTS)  # planned from a sample of positions, judged on the whole stream
    simulated = {(n, p): simulate(stream, COSTS, n, p) for n in range(1, 6) for p in (0.0, 0.2, 0.4, 0.6, 0.8)}
    assert simulate(stream, COSTS, plan.n_max, plan.p_min) >= 0.97 * max(simulated.values())


def test_expensive_drafting_plans_nothing_better_than_plain():
    weak = [ChainSample((0.3, 0.3), 0)] * 50 + [ChainSample((0.3, 0.3), 1)] * 10
    plan = plan_chain(weak, ChainCosts((0.010, 0.016, 0.022), draft_seconds=0.004))
    assert plan.speedup < 1  # the best chain still loses: the caller should not draft


def test_recorder_records_every_step_of_the_exact_replay(tiny_target, fitted_drafter):
    prompts = PROMPT_POOL[:3]
    continuations = greedy_continuations(tiny_target, prompts, 24)
    recorder = ChainRecorder(depth=3)
    evaluate_acceptance(tiny_target, fitted_drafter, prompts, continuations, recorder)
    assert recorder.samples and all(len(s.draft_probs) == 3 for s in recorder.samples)
    assert all(0 < p <= 1 for s in recorder.samples for p in s.draft_probs)
    assert all(0 <= s.accepted <= 3 for s in recorder.samples)
    steps = sum(1 + s.accepted for s in recorder.samples)
    assert steps >= sum(len(c) for c in continuations) - len(prompts)  # the chains cover every continuation token
