"""Pooled chain metrics (unbiased and teacher-forced) per shipped SmolLM2 drafter, paired differences with a
prompt bootstrap, and a check that the forced values reproduce the study's init counts.

    python benchmarks/chain_remeasure_smollm2_summary.py benchmarks/results/chain_remeasure_smollm2.json
"""
import json
import sys
from pathlib import Path

import numpy as np

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


def arrays(name, metric):
    num = np.concatenate([new["drafters"][name][s][metric] for s in sets])
    den = np.concatenate([new["drafters"][name][s]["anchors"] for s in sets])
    return num, den


rng = np.random.default_rng(0)
n = len(arrays("eagle3-ce", "chain")[0])
idx = rng.integers(0, n, size=(2000, n))
out = {}
for metric in ("chain", "forced"):
    for name in ("eagle3-ce", "eagle3-accept", "eagle3-vsd"):
        num, den = arrays(name, metric)
        boot = num[idx].sum(1) / den[idx].sum(1)
        out[(metric, name)] = (num, den, boot)
        low, high = np.percentile(boot, [2.5, 97.5])
        print(f"{metric:6s} {name:14s} {num.sum() / den.sum():.4f} [{low:.4f}, {high:.4f}]")
    for name in ("eagle3-accept", "eagle3-vsd"):
        a, b = out[(metric, name)], out[(metric, "eagle3-ce")]
        diff = a[0].sum() / a[1].sum() - b[0].sum() / b[1].sum()
        boot = a[2] - b[2]
        low, high = np.percentile(boot, [2.5, 97.5])
        print(f"{metric:6s} {name} - eagle3-ce: {diff:+.4f} [{low:+.4f}, {high:+.4f}]"
              f" ({100 * diff / (b[0].sum() / b[1].sum()):+.1f}%)")
