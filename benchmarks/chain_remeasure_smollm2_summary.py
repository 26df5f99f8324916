"""Pooled chain metrics (unbiased and teacher-forced) per shipped SmolLM2 drafter, paired differences with a
prompt bootstrap (study_stats.py), and a check that the forced values reproduce the study's init counts.

    python benchmarks/chain_remeasure_smollm2_summary.py benchmarks/results/chain_remeasure_smollm2.json
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_stats import compare_arms, prompt_resamples, summarise_arm  # noqa: E402

new = json.load(open(sys.argv[1]))
study = json.load(open(str(Path(__file__).resolve().parent / "results/vsd_power_smollm2.json")))
init_key = [k for k in study["counts"] if k.endswith("eagle3-ce")][0]
sets = ["mt_bench", "humaneval", "gsm8k"]
for s in sets:
    old = np.array(study["counts"][init_key]["accept"][s][0])
    mine = np.array(new["drafters"]["eagle3-ce"][s]["forced"])
    print(f"check {s}: study forced init {old.sum():.3f}, remeasured {mine.sum():.3f}, max |diff| per prompt "
          f"{np.abs(old - mine).max():.2e}, anchors equal "
          f"{study['counts'][init_key]['accept'][s][1] == new['drafters']['eagle3-ce'][s]['anchors']}")


def counts(name, metric):
    """([1, P] summed expected acceptance, [1, P] anchors) over the three benchmarks: one seed."""
    num = np.concatenate([new["drafters"][name][s][metric] for s in sets])
    den = np.concatenate([new["drafters"][name][s]["anchors"] for s in sets])
    return num[None].astype(float), den[None].astype(float)


resamples = prompt_resamples(counts("eagle3-ce", "chain")[0].shape[1], 2000, 0)
for metric in ("chain", "forced"):
    for name in ("eagle3-ce", "eagle3-accept", "eagle3-vsd"):
        row = summarise_arm(*counts(name, metric), resamples)
        print(f"{metric:6s} {name:14s} {row['tau']:.4f} [{row['ci95'][0]:.4f}, {row['ci95'][1]:.4f}]")
    for name in ("eagle3-accept", "eagle3-vsd"):
        diff = compare_arms(counts(name, metric), counts("eagle3-ce", metric), resamples)
        low, high = diff["diff_ci95"]
        print(f"{metric:6s} {name} - eagle3-ce: {diff['diff']:+.4f} [{low:+.4f}, {high:+.4f}]"
              f" ({100 * (diff['ratio'] - 1):+.1f}%)")
