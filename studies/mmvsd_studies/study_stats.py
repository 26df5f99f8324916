"""The studies' statistics: tau pooled over prompts, and paired bootstrap intervals over prompts (shared by the
arms: paired comparisons), hierarchical over training seeds when a study has several (each arm draws its own
seeds, then the shared prompt resamples). Used by `vsd_study.py`, `vsd_control.py` and their summaries."""

from __future__ import annotations

import numpy as np


def pooled_tau(new_tokens: np.ndarray, forwards: np.ndarray) -> np.ndarray:
    """[R, P] per-run per-prompt counts -> [R] tau of each run pooled over prompts (sum new / sum forwards)."""
    return new_tokens.sum(-1) / np.maximum(forwards.sum(-1), 1)


def bootstrap_taus(new_tokens: np.ndarray, forwards: np.ndarray, resamples: np.ndarray,
                   seed_draws: np.ndarray | None = None) -> np.ndarray:
    """Seed-averaged pooled tau of each resample: counts [R, P], prompt resamples [N, P] -> [N]. Hierarchical with
    `seed_draws` [N, R] (seeds drawn with replacement, then prompts): the spread of training seeds counts too."""
    new = new_tokens[:, resamples].sum(-1)  # [R, N]
    fwd = np.maximum(forwards[:, resamples].sum(-1), 1)
    taus = new / fwd
    if seed_draws is None:
        return taus.mean(0)
    return taus[seed_draws.T, np.arange(taus.shape[1])].mean(0)  # [R', N] -> [N]


def seed_resamples(num_seeds: int, num_resamples: int, seed: int) -> np.ndarray:
    """[N, R] seed indices drawn with replacement (one arm's; arms are independent runs, so each draws its own)."""
    return np.random.default_rng(seed).integers(0, num_seeds, size=(num_resamples, num_seeds))


def domain_indices(domains: list[str]) -> dict[str, list[int]]:
    """Each domain's prompt indices, in order of first appearance (`domains[i]` names prompt i's; "" for none)."""
    named = dict.fromkeys(d for d in domains if d)
    return {domain: [i for i, d in enumerate(domains) if d == domain] for domain in named}


def prompt_resamples(num_prompts: int, num_resamples: int, seed: int) -> np.ndarray:
    """[N, P] prompt indices drawn with replacement (shared by every arm: paired comparisons)."""
    return np.random.default_rng(seed).integers(0, num_prompts, size=(num_resamples, num_prompts))


def percentile_interval(values: np.ndarray, level: float = 0.95) -> list[float]:
    tail = (1.0 - level) / 2 * 100
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def summarise_arm(new_tokens: np.ndarray, forwards: np.ndarray, resamples: np.ndarray,
                  seed_draws: np.ndarray | None = None) -> dict:
    """tau (mean over seeds of the pooled tau), its 95% bootstrap interval (over prompts, or seeds then prompts
    with `seed_draws`), seed spread."""
    seed_taus = pooled_tau(new_tokens, forwards)
    return {
        "tau": float(seed_taus.mean()),
        "ci95": percentile_interval(bootstrap_taus(new_tokens, forwards, resamples, seed_draws)),
        "seed_taus": [float(t) for t in seed_taus],
        "seed_std": float(seed_taus.std(ddof=1)) if len(seed_taus) > 1 else 0.0,
        "mean_prompt_tau": float((new_tokens / np.maximum(forwards, 1)).mean()),
    }


def compare_arms(arm: tuple[np.ndarray, np.ndarray], baseline: tuple[np.ndarray, np.ndarray],
                 resamples: np.ndarray, goal_ratio: float = 1.05,
                 seed_draws: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """Paired (same prompt resamples) difference and ratio of arm vs baseline, with 95% intervals; hierarchical
    with `seed_draws` (the arm's and the baseline's own seed draws, then the shared prompt resamples)."""
    arm_draws, base_draws = seed_draws if seed_draws is not None else (None, None)
    arm_boot = bootstrap_taus(*arm, resamples, arm_draws)
    base_boot = bootstrap_taus(*baseline, resamples, base_draws)
    arm_tau, base_tau = float(pooled_tau(*arm).mean()), float(pooled_tau(*baseline).mean())
    diff_ci = percentile_interval(arm_boot - base_boot)
    ratio = arm_tau / base_tau
    return {
        "diff": arm_tau - base_tau, "diff_ci95": diff_ci, "ratio": ratio,
        "ratio_ci95": percentile_interval(arm_boot / base_boot),
        "goal_met": bool(ratio >= goal_ratio and diff_ci[0] > 0),
    }
