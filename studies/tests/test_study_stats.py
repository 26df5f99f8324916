"""The studies' statistics (studies/mmvsd_studies/study_stats.py): pooled tau, bootstrap intervals against normal theory
and their coverage, paired comparisons, and the hierarchical (seeds, then prompts) resampling by hand."""

from __future__ import annotations

import numpy as np
import pytest

from mmvsd_studies import study_stats


@pytest.fixture(scope="module")
def stats():
    return study_stats


def test_pooled_tau_is_total_tokens_over_total_forwards(stats):
    new = np.array([[10, 30], [8, 8]], dtype=float)
    fwd = np.array([[5, 10], [4, 2]], dtype=float)
    assert stats.pooled_tau(new, fwd).tolist() == pytest.approx([40 / 15, 16 / 6])
    resamples = np.array([[0, 0], [1, 1], [0, 1]])
    boot = stats.bootstrap_taus(new, fwd, resamples)  # seeds averaged inside each resample
    assert boot.tolist() == pytest.approx([(2 + 2) / 2, (3 + 4) / 2, (40 / 15 + 16 / 6) / 2])


def test_bootstrap_interval_of_a_mean_matches_the_normal_theory_width(stats):
    rng = np.random.default_rng(0)
    values = rng.normal(2.0, 0.5, size=400)  # forwards = 1: pooled tau is the plain mean
    new, fwd = values[None], np.ones((1, 400))
    summary = stats.summarise_arm(new, fwd, stats.prompt_resamples(400, 4000, seed=1))
    low, high = summary["ci95"]
    assert summary["tau"] == pytest.approx(values.mean())
    assert low < values.mean() < high
    assert high - low == pytest.approx(2 * 1.96 * values.std() / np.sqrt(400), rel=0.1)


def test_bootstrap_interval_covers_the_true_mean_about_95_percent_of_the_time(stats):
    rng = np.random.default_rng(2)
    covered = 0
    for trial in range(300):
        values = rng.exponential(1.5, size=60) + 1.0  # skewed, true mean 2.5
        summary = stats.summarise_arm(values[None], np.ones((1, 60)), stats.prompt_resamples(60, 500, seed=trial))
        covered += summary["ci95"][0] <= 2.5 <= summary["ci95"][1]
    assert 0.88 <= covered / 300 <= 0.99  # percentile bootstrap at n = 60: slightly under 95%


def test_paired_comparison_sees_a_small_constant_gain_that_unpaired_intervals_hide(stats):
    rng = np.random.default_rng(3)
    base_values = rng.uniform(1.0, 4.0, size=(3, 50))  # 3 seeds, prompts vary a lot
    baseline = (base_values, np.ones((3, 50)))
    arm = (base_values * 1.06, np.ones((3, 50)))  # 6% more tokens on every prompt
    resamples = stats.prompt_resamples(50, 2000, seed=0)
    cmp = stats.compare_arms(arm, baseline, resamples, goal_ratio=1.05)
    assert cmp["ratio"] == pytest.approx(1.06)
    assert cmp["ratio_ci95"] == pytest.approx([1.06, 1.06])  # identical resamples: no prompt noise
    assert cmp["diff_ci95"][0] > 0 and cmp["goal_met"]
    base_ci, arm_ci = (stats.summarise_arm(*x, resamples)["ci95"] for x in (baseline, arm))
    assert arm_ci[0] < base_ci[1]  # the separate intervals overlap
    worse = stats.compare_arms(baseline, arm, resamples)
    assert worse["diff_ci95"][1] < 0 and not worse["goal_met"]
    noisy = stats.compare_arms((base_values + rng.normal(0, 1.0, (3, 50)), np.ones((3, 50))), baseline, resamples)
    assert noisy["diff_ci95"][0] < 0 < noisy["diff_ci95"][1] and not noisy["goal_met"]


def test_hierarchical_intervals_count_the_spread_of_seeds(stats):
    """Seeds drawn with replacement, then prompts: an arm whose seeds disagree gets a wider interval than the
    prompt-only bootstrap gives it, and one whose seeds agree gets the same."""
    rng = np.random.default_rng(1)
    prompts = rng.uniform(2, 4, size=50)
    spread = (np.stack([prompts * f for f in (0.9, 1.0, 1.1)]), np.ones((3, 50)))
    alike = (np.stack([prompts] * 3), np.ones((3, 50)))
    resamples = stats.prompt_resamples(50, 2000, seed=0)
    draws = stats.seed_resamples(3, 2000, seed=1)
    assert draws.shape == (2000, 3) and set(np.unique(draws)) == {0, 1, 2}

    def width(ci):
        return ci[1] - ci[0]

    assert width(stats.summarise_arm(*spread, resamples, draws)["ci95"]) > 2 * width(
        stats.summarise_arm(*spread, resamples)["ci95"])
    assert stats.summarise_arm(*alike, resamples, draws)["ci95"] == pytest.approx(
        stats.summarise_arm(*alike, resamples)["ci95"])
    # by hand: resample n draws seeds draws[n] and prompts resamples[n]
    taus = spread[0][:, resamples].sum(-1) / 50  # [3, N]
    by_hand = np.array([taus[draws[n], n].mean() for n in range(2000)])
    np.testing.assert_allclose(stats.bootstrap_taus(*spread, resamples, draws), by_hand)
