"""Plot validation tau against training tokens from training runs' `val_tau.jsonl` (written when
`eval_every` > 0), one line per run, and write the points beside the figure as JSON.

    python -m mmvsd_studies.learning_curve --run "CE, ShareGPT answers=runs/ce" --run "CE on-policy=runs/onpolicy" \
        --title "SmolLM2-135M EAGLE-3 drafter, 20 MT-Bench prompts, 60/7/10" --out docs/learning_curve.png

A run's `--offset TOKENS` (`LABEL=DIR@TOKENS`) shifts its x axis, for a run that continues another
(its tokens start where the first run's ended). Points are what the trainer measured, nothing is smoothed.

`--train-metric acc_0 --window 25` plots a metric of the trainer's per-step log (`train_log.jsonl`) instead: the
mean over each `--window` consecutive steps, at the tokens seen by the window's end. A run that reads its data
once (`data_order=shards`, or the first epoch of any run) measures each batch before it trains on it, so its
`acc_0` (the first draft token's top-1 agreement with the target) is a held-out measure at no extra cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_curve(folder: Path) -> list[dict]:
    """The val_tau.jsonl lines of a training output folder (error if it has none)."""
    path = folder / "val_tau.jsonl"
    if not path.is_file():
        sys.exit(f"learning_curve: {path} not found (train with eval_every > 0)")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    missing = [line["step"] for line in lines if "tokens_seen" not in line]
    if missing:
        sys.exit(f"learning_curve: {path} has no tokens_seen at steps {missing} (written by an older trainer)")
    return lines


def read_train_metric(folder: Path, metric: str, window: int) -> list[dict]:
    """Means of `metric` over consecutive `window` steps of a run's train_log.jsonl (a last partial window too)."""
    path = folder / "train_log.jsonl"
    if not path.is_file():
        sys.exit(f"learning_curve: {path} not found (written by the trainer since 2026-11-28)")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or metric not in lines[0]:
        sys.exit(f"learning_curve: {path} has no {metric!r} (it has {', '.join(lines[0]) if lines else 'no lines'})")
    points = []
    for start in range(0, len(lines), window):
        chunk = lines[start : start + window]
        points.append({"step": chunk[-1]["step"], "tokens_seen": chunk[-1]["tokens_seen"], "steps": len(chunk),
                       metric: sum(line[metric] for line in chunk) / len(chunk)})
    return points


def parse_run(text: str) -> tuple[str, Path, int]:
    """LABEL=DIR[@TOKENS] -> (label, folder, token offset)."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        sys.exit(f"learning_curve: --run {text!r}: expected LABEL=DIR[@TOKENS]")
    folder, _, offset = rest.partition("@")
    return label, Path(folder), int(offset or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, help="LABEL=DIR[@TOKENS], repeatable")
    parser.add_argument("--title", default="validation tau while training")
    parser.add_argument("--train-metric", help="plot this metric of train_log.jsonl (e.g. acc_0) instead of tau")
    parser.add_argument("--window", type=int, default=25, help="steps per point of --train-metric (default 25)")
    parser.add_argument("--out", required=True, help="figure path (.png); the points go to the same name .json")
    args = parser.parse_args()
    import matplotlib  # plotting only: the backend is set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    curves = {}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, folder, offset in map(parse_run, args.run):
        metric = args.train_metric or "tau"
        lines = read_train_metric(folder, metric, args.window) if args.train_metric else read_curve(folder)
        xs = [(offset + line["tokens_seen"]) / 1e6 for line in lines]
        ax.plot(xs, [line[metric] for line in lines], marker="o", label=label)
        kept = ("steps",) if args.train_metric else ("num_prompts",)
        curves[label] = [{"tokens_seen": offset + line["tokens_seen"], "step": line["step"], metric: line[metric],
                          **{key: line[key] for key in kept}} for line in lines]
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel(f"{args.train_metric} (mean of {args.window} steps)" if args.train_metric else "validation tau")
    ax.set_title(args.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    out.with_suffix(".json").write_text(json.dumps({"title": args.title, "curves": curves}, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
