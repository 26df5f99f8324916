"""Pooled chain metrics (unbiased and teacher-forced) per shipped SmolLM2 drafter, paired differences with a
prompt bootstrap (study_stats.py), and a check that the forced values reproduce the study's init counts.

    python -m mmvsd_studies.chain_remeasure_smollm2_summary studies/results/chain_remeasure_smollm2.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from mmvsd_studies import RESULTS_DIR
from mmvsd_studies.study_stats import compare_arms, prompt_resamples, summarise_arm

SETS = ["mt_bench", "humaneval", "gsm8k"]


def check_init_counts(new: dict, study: dict) -> None:
    """Print whether the re-measured teacher-forced values of the start equal the study's init counts."""
    init_key = [k for k in study["counts"] if k.endswith("eagle3-ce")][0]
    for s in SETS:
        old = np.array(study["counts"][init_key]["accept"][s][0])
        mine = np.array(new["drafters"]["eagle3-ce"][s]["forced"])
        print(f"check {s}: study forced init {old.sum():.3f}, remeasured {mine.sum():.3f}, max |diff| per prompt "
              f"{np.abs(old - mine).max():.2e}, anchors equal "
              f"{study['counts'][init_key]['accept'][s][1] == new['drafters']['eagle3-ce'][s]['anchors']}")


def counts(new: dict, name: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """([1, P] summed expected acceptance, [1, P] anchors) over the three benchmarks: one seed."""
    num = np.concatenate([new["drafters"][name][s][metric] for s in SETS])
    den = np.concatenate([new["drafters"][name][s]["anchors"] for s in SETS])
    return num[None].astype(float), den[None].astype(float)


def main(argv: list[str] | None = None) -> int:
    new = json.loads(Path((sys.argv[1:] if argv is None else argv)[0]).read_text())
    check_init_counts(new, json.loads((RESULTS_DIR / "vsd_power_smollm2.json").read_text()))
    resamples = prompt_resamples(counts(new, "eagle3-ce", "chain")[0].shape[1], 2000, 0)
    for metric in ("chain", "forced"):
        for name in ("eagle3-ce", "eagle3-accept", "eagle3-vsd"):
            row = summarise_arm(*counts(new, name, metric), resamples)
            print(f"{metric:6s} {name:14s} {row['tau']:.4f} [{row['ci95'][0]:.4f}, {row['ci95'][1]:.4f}]")
        for name in ("eagle3-accept", "eagle3-vsd"):
            diff = compare_arms(counts(new, name, metric), counts(new, "eagle3-ce", metric), resamples)
            low, high = diff["diff_ci95"]
            print(f"{metric:6s} {name} - eagle3-ce: {diff['diff']:+.4f} [{low:+.4f}, {high:+.4f}]"
                  f" ({100 * (diff['ratio'] - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
