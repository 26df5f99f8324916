"""`mmvsd profile --plot`: the cost table drawn as a PNG."""

from __future__ import annotations

from pathlib import Path

from mmvsd.decoding.costs import CostTable
from mmvsd.files import atomic_file


def plot_cost_table(table: CostTable, out_path: str | Path) -> None:
    """A PNG: verify-step ms vs tree tokens per batch size, and drafter ms vs frontier width."""
    import matplotlib  # optional plotting: only `--plot` needs it, and it is slow to import (~0.3 s)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # likewise; after use("Agg"), which picks a headless backend first

    fig, axes = plt.subplots(1, 2 if table.draft_widths else 1, figsize=(11 if table.draft_widths else 6, 4.2),
                             squeeze=False)
    left = axes[0][0]
    for batch, seconds in sorted(table.target_seconds.items()):
        left.plot(table.target_tokens, [s * 1e3 for s in seconds], marker="o", label=f"batch {batch}")
    left.set(xlabel="verified tree tokens N", ylabel="ms per verify step", ylim=(0, None),
             title=f"target {table.key['target']} ({table.key['dtype']})")
    left.legend()
    left.grid(alpha=0.3)
    if table.draft_widths:
        right = axes[0][1]
        for batch, seconds in sorted(table.draft_seconds.items()):
            line, = right.plot(table.draft_widths, [s * 1e3 for s in seconds], marker="o",
                               label=f"expand, batch {batch}")
            right.axhline(table.draft_fixed(batch) * 1e3, color=line.get_color(), linestyle="--",
                          label=f"fixed per step, batch {batch}")
        right.set(xlabel="frontier width W", ylabel="ms per call", ylim=(0, None),
                  title=f"drafter {table.key['drafter']} (draft vocab {table.key.get('draft_vocab', '?')})")
        right.legend()
        right.grid(alpha=0.3)
    fig.suptitle(f"{table.key['cpu']} [{table.key['device']}, {table.key['threads']} threads]", fontsize=9)
    fig.tight_layout()
    with atomic_file(out_path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)
