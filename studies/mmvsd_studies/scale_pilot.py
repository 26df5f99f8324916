"""The scale issue's pre-registered objective pilot, read from `mmvsd eval-drafter --json` reports (docs/training.md,
"The scale run's objective").

    python -m mmvsd_studies.scale_pilot --baseline ce --reference start=START.json --arm ce=CE.json \
        --arm ce+accept=ACCEPT.json --arm ce+vsd=VSD.json --out studies/results/scale_pilot_smollm2.json

Each report is one drafter replayed on the same held-out prompts with an argmax depth-3 chain (`--tree 4/3/1
--ngram off`; a budget counts the root): the target's greedy continuations are the same for every drafter, so
the prompts pair. Per prompt, the tree steps after the prefill give the two primary measures, pooled over prompts:
- first_token: the share of steps that accepted at least one draft token;
- chain_3: draft tokens accepted per step (0-3).
Each arm minus the baseline, with a paired bootstrap 95% interval over prompts. An arm beats the baseline when its
chain_3 interval lies above 0 and its first_token interval does not lie below 0 (`--rule chain`, the pilot's); with
`--rule first-token` (the issue's rule for a new default) when its first_token interval lies above 0 and its chain_3
interval does not lie below 0. An arm the baseline beats the same way loses; anything else is a tie, and a tie goes
to the cheaper objective (the order of `--arm`, cheapest first). `--reference NAME=REPORT` (e.g. the arms' start) is
measured and compared the same way but is not a candidate. `--tau NAME=REPORT` adds a secondary tau (the paper's
tree: 60/7/10, or 60/5/8 on image prompts), reported beside the primary measures as `tau_BUDGET_DEPTH_TOPK`.
`NAME=A.json,B.json` reads several reports of one drafter (e.g. one per image task) as one, their prompts in that
order. `--heldout PROMPTS.jsonl` (the reports' prompt file, each line with its `domain`) compares pooled and then
per domain, the prompts of each alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from mmvsd.prompts import prompt_domains
from mmvsd.shipped import held_out_tau_key
from mmvsd_studies.study_stats import (
    bootstrap_taus,
    compare_arms,
    domain_indices,
    percentile_interval,
    pooled_tau,
    prompt_resamples,
)

MEASURES = ("first_token", "chain_3")
RULES = {"chain": ("chain_3", "first_token"), "first-token": ("first_token", "chain_3")}  # (decides, must not oppose)


def prompt_counts(report: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-prompt (numerator, denominator) [1, P] of each measure from one eval-drafter report."""
    steps, first, accepted = [], [], []
    for prompt in report["prompts"]:
        lengths = prompt["accept_lengths"][1:]  # the first entry is the prefill's token
        steps.append(len(lengths))
        first.append(sum(length >= 2 for length in lengths))
        accepted.append(sum(length - 1 for length in lengths))
    den = np.array([steps], dtype=float)
    return {"first_token": (np.array([first], dtype=float), den),
            "chain_3": (np.array([accepted], dtype=float), den)}


def tau_counts(report: dict) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([[p["new_tokens"] for p in report["prompts"]]], dtype=float),
            np.array([[p["target_forwards"] for p in report["prompts"]]], dtype=float))


def tau_key(report: dict) -> str:
    """The held_out key of a report's tau (tau_60_7_10 for the 60/7/10 tree), as shipped cards name it."""
    return held_out_tau_key(report["tree"])


def verdict(comparison: dict[str, dict], rule: str = "chain") -> str:
    """beats | loses | tie, by a pre-registered rule (RULES: one measure decides, the other must not go the other
    way)."""
    decides, other = (comparison[measure]["diff_ci95"] for measure in RULES[rule])
    if decides[0] > 0 and not other[1] < 0:
        return "beats"
    if decides[1] < 0 and not other[0] > 0:
        return "loses"
    return "tie"


def pilot(reports: dict[str, dict], baseline: str, taus: dict[str, dict] | None = None,
          references: tuple[str, ...] = (), resamples_count: int = 2000, seed: int = 0, rule: str = "chain") -> dict:
    """Every arm's measures with intervals, each non-baseline arm against the baseline, and the decision (among
    the arms that are not `references`)."""
    sizes = {len(report["prompts"]) for report in reports.values()}
    if len(sizes) != 1:
        sys.exit(f"scale_pilot: the reports hold different numbers of prompts ({sorted(sizes)})")
    resamples = prompt_resamples(sizes.pop(), resamples_count, seed)
    counts = {name: prompt_counts(report) for name, report in reports.items()}
    taus = taus or {}
    out: dict = {"baseline": baseline, "arms": {}, "resamples": resamples_count, "rule": rule}
    for name, measures in counts.items():
        row = {}
        for measure, counted in measures.items():  # a pooled ratio, as tau is: study_stats serves both
            row[measure] = {"value": float(pooled_tau(*counted)[0]),
                            "ci95": percentile_interval(bootstrap_taus(*counted, resamples))}
        if name in taus:
            row[tau_key(taus[name])] = float(pooled_tau(*tau_counts(taus[name]))[0])
        if name != baseline:
            row["vs_baseline"] = {m: compare_arms(measures[m], counts[baseline][m], resamples) for m in MEASURES}
            row["verdict"] = verdict(row["vs_baseline"], rule)
        out["arms"][name] = row
    beaten = [name for name, row in out["arms"].items() if row.get("verdict") == "beats" and name not in references]
    deciding = RULES[rule][0]
    best = max(beaten, key=lambda n: out["arms"][n]["vs_baseline"][deciding]["diff"]) if beaten else baseline
    out["decision"] = best
    return out


def pilot_by_domain(reports: dict[str, dict], baseline: str, domains: list[str], taus: dict[str, dict] | None = None,
                    references: tuple[str, ...] = (), rule: str = "chain") -> dict:
    """`pilot` pooled ("all") and once per domain, on the prompts of that domain alone (`domains[i]` names prompt
    i's; [] or "" for none), the tau reports' prompts split the same way."""
    result = {"all": pilot(reports, baseline, taus, references, rule=rule)}
    if domains and {len(report["prompts"]) for report in reports.values()} != {len(domains)}:
        sys.exit(f"scale_pilot: the reports' prompts do not match the {len(domains)} held-out prompts' domains")
    for domain, keep in domain_indices(domains).items():
        result[domain] = pilot(_prompts(reports, keep), baseline, _prompts(taus or {}, keep), references, rule=rule)
    return result


def _prompts(named: dict[str, dict], keep: list[int]) -> dict[str, dict]:
    """Each report with only the prompts `keep` indexes, in that order."""
    return {name: {**report, "prompts": [report["prompts"][i] for i in keep]} for name, report in named.items()}


def format_pilot(result: dict) -> str:
    lines = [f"{'arm':<12} {'first token':>22} {'chain_3':>22}  vs {result['baseline']}"]
    for name, row in result["arms"].items():
        cells = [f"{row[m]['value']:.3f} [{row[m]['ci95'][0]:.3f}, {row[m]['ci95'][1]:.3f}]" for m in MEASURES]
        versus = ""
        if "vs_baseline" in row:
            diffs = [row["vs_baseline"][m] for m in MEASURES]
            versus = "  ".join(f"{d['diff']:+.3f} [{d['diff_ci95'][0]:+.3f}, {d['diff_ci95'][1]:+.3f}]" for d in diffs)
            versus += f"  {row['verdict']}"
        tau = "".join(f"  {key} {value:.3f}" for key, value in row.items() if key.startswith("tau_"))
        lines.append(f"{name:<12} {cells[0]:>22} {cells[1]:>22}  {versus}{tau}")
    lines.append(f"decision: {result['decision']}")
    return "\n".join(lines)


def _named(items: list[str], flag: str) -> dict[str, dict]:
    named = {}
    for item in items:
        name, sep, paths = item.partition("=")
        if not sep:
            sys.exit(f"scale_pilot: {flag} {item!r}: expected NAME=REPORT.json[,REPORT.json...]")
        reports = []
        for path in paths.split(","):
            try:
                reports.append(json.loads(Path(path).read_text()))
            except (OSError, json.JSONDecodeError) as err:
                sys.exit(f"scale_pilot: {flag} {name}: cannot read {path}: {err}")
        if len({report["tree"] for report in reports}) > 1:
            sys.exit(f"scale_pilot: {flag} {name}: the reports replayed different trees")
        named[name] = {**reports[0], "prompts": [prompt for report in reports for prompt in report["prompts"]]}
    return named


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", action="append", required=True,
                        help="NAME=REPORT.json[,REPORT.json...], cheapest objective first")
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--reference", action="append", default=[], help="NAME=REPORT.json, compared, not a candidate")
    parser.add_argument("--tau", action="append", default=[], help="NAME=REPORT.json at the paper's tree (secondary)")
    parser.add_argument("--heldout", help="the reports' prompt file (JSONL with `domain`): also compared per domain")
    parser.add_argument("--rule", choices=sorted(RULES), default="chain",
                        help="which measure decides: chain (the pilot's) or first-token (a new default's)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    references = _named(args.reference, "--reference")
    reports = {**references, **_named(args.arm, "--arm")}
    if args.baseline not in reports or args.baseline in references:
        names = ", ".join(item.partition("=")[0] for item in args.arm)
        sys.exit(f"scale_pilot: --baseline {args.baseline!r} must be one of the arms ({names})")
    taus = _named(args.tau, "--tau")
    if args.heldout:  # {"all": ..., "chat": ..., ...}
        if not Path(args.heldout).is_file():
            sys.exit(f"scale_pilot: --heldout {args.heldout} not found")
        result = pilot_by_domain(reports, args.baseline, prompt_domains(args.heldout), taus, tuple(references),
                                 args.rule)
        print("\n".join(f"{scope}:\n{format_pilot(scoped)}" for scope, scoped in result.items()))
    else:
        result = pilot(reports, args.baseline, taus, tuple(references), rule=args.rule)
        print(format_pilot(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
