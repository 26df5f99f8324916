"""Plot validation tau against training tokens from training runs' `val_tau.jsonl` (written when
`eval_every` > 0), one line per run, and write the points beside the figure as JSON.

    python -m mmvsd_studies.learning_curve --run "CE, ShareGPT answers=runs/ce" --run "CE on-policy=runs/onpolicy" \
        --title "SmolLM2-135M EAGLE-3 drafter, 20 MT-Bench prompts, 60/7/10" --out docs/learning_curve.png

A run's `--offset TOKENS` (`LABEL=DIR@TOKENS`) shifts its x axis, for a run that continues another
(its tokens start where the first run's ended). Points are what the trainer measured, nothing is smoothed.
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
    parser.add_argument("--out", required=True, help="figure path (.png); the points go to the same name .json")
    args = parser.parse_args()
    import matplotlib  # plotting only: the backend is set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    curves = {}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, folder, offset in map(parse_run, args.run):
        lines = read_curve(folder)
        xs = [(offset + line["tokens_seen"]) / 1e6 for line in lines]
        ys = [line["tau"] for line in lines]
        ax.plot(xs, ys, marker="o", label=label)
        curves[label] = [{"tokens_seen": offset + line["tokens_seen"], "step": line["step"], "tau": line["tau"],
                          "num_prompts": line["num_prompts"]} for line in lines]
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation tau")
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
