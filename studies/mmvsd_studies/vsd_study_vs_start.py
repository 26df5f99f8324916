"""Each arm of a finished `vsd_study.py` study against the drafter every run started from (its `--init`).

`vsd_study.py` compares the arms with each other (against `--baseline-arm`); whether training on moved the
drafter past where it started is a different question, and the one a shipped default depends on: an arm can
beat `ce` while both fall below their start. This reads OUT/study.json (its per-prompt counts) and prints, per
metric over all prompts, each arm's paired difference to the start (hierarchical bootstrap: the arm's seeds with
replacement, then the prompts, shared with the start) and its seed-0 run's alone (prompts only):

    python -m mmvsd_studies.vsd_study_vs_start ~/vsd_power/smol_llava/study.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmvsd_studies.study_report import metric_title
from mmvsd_studies.study_stats import compare_arms, prompt_resamples, seed_resamples
from mmvsd_studies.vsd_study import CHAIN_METRICS, arm_counts, arm_seed_draws, runs_by_arm

# a study.json written before the unbiased chain metric existed names the teacher-forced product "accept"
LEGACY_METRICS = {CHAIN_METRICS["forced"]: "forced"}


def vs_start(study: dict, bootstrap: int = 2000, bootstrap_seed: int = 0, budget: str = "steps") -> list[dict]:
    """[{metric, arm, diff, diff_ci95, seed0_diff, seed0_diff_ci95}] for every metric and arm in `study`."""
    init = study["config"]["init"]
    counts = study["counts"]
    runs = runs_by_arm(sorted(study["runs"], key=lambda r: r["seed"]), budget)  # seed 0 first in each arm
    draws = arm_seed_draws(runs, bootstrap, bootstrap_seed)
    start_draws = seed_resamples(1, bootstrap, bootstrap_seed)
    rows = []
    for metric, by_set in counts[init].items():
        sets = list(by_set)
        num_prompts = sum(len(by_set[s][0]) for s in sets)
        resamples = prompt_resamples(num_prompts, bootstrap, bootstrap_seed)
        start = arm_counts(counts, [init], metric, sets)
        for arm, arm_runs in sorted(runs.items()):
            data = arm_counts(counts, [r["folder"] for r in arm_runs], metric, sets)
            pooled = compare_arms(data, start, resamples, seed_draws=(draws[arm], start_draws))
            seed0 = compare_arms((data[0][:1], data[1][:1]), start, resamples)
            rows.append({"metric": LEGACY_METRICS.get(metric, metric), "arm": arm, "seed0": arm_runs[0]["seed"],
                         "diff": pooled["diff"], "diff_ci95": pooled["diff_ci95"], "seed0_diff": seed0["diff"],
                         "seed0_diff_ci95": seed0["diff_ci95"]})
    return rows


def markdown(rows: list[dict]) -> str:
    fmt = "{:+.3f} [{:+.3f}, {:+.3f}]".format
    lines = ["| metric | arm | arm - start (seeds, then prompts) | seed-0 run - start (prompts) |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {metric_title(r['metric'])} | {r['arm']} | {fmt(r['diff'], *r['diff_ci95'])} | "
                     f"{fmt(r['seed0_diff'], *r['seed0_diff_ci95'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", help="a finished study's study.json")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    try:
        study = json.loads(Path(args.study).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"vsd_study_vs_start: cannot read {args.study}: {err}") from None
    rows = vs_start(study, args.bootstrap)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
