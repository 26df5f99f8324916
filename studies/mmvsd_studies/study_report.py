"""The studies' reports: a study's summary rows as markdown tables (full and compact), a plot, and the
pre-registered decision (`decide`, docs/reproduction.md) with its text. Used by `vsd_study.py` and its summaries."""

from __future__ import annotations

from pathlib import Path

METRIC_TITLES = {"chain": "E[accepted] T=1", "forced": "E[accepted] T=1, teacher-forced"}


def metric_title(metric: str) -> str:
    return METRIC_TITLES.get(metric, f"tau T={metric}")


def markdown_table(rows: list[dict], baseline: str) -> str:
    header = (f"| metric | prompts | budget | arm | steps | value (95% CI: seeds, then prompts) | seeds (std) | "
              f"vs {baseline}: ratio (95% CI) | diff (95% CI) | goal |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seeds = ", ".join(f"{t:.3f}" for t in r["seed_taus"])
        cmp = r.get("vs_baseline")
        vs = (f"{cmp['ratio']:.3f} [{cmp['ratio_ci95'][0]:.3f}, {cmp['ratio_ci95'][1]:.3f}] | "
              f"{cmp['diff']:+.3f} [{cmp['diff_ci95'][0]:+.3f}, {cmp['diff_ci95'][1]:+.3f}] | "
              f"{'met' if cmp['goal_met'] else 'not met'}") if cmp else "- | - | -"
        lines.append(f"| {metric_title(r['metric'])} | {r['prompts']} | {r['budget']} | {r['arm']} | {r['steps']} | "
                     f"{r['tau']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | "
                     f"{seeds} ({r['seed_std']:.3f}) | {vs} |")
    return "\n".join(lines) + "\n"


def pooled_prompts(rows: list[dict]) -> str:
    """The prompt group a verdict or summary reads: every prompt set pooled ("all"), or the only set there is."""
    return "all" if any(r["prompts"] == "all" for r in rows) else rows[0]["prompts"]


def compact_table(rows: list[dict], baseline: str, budget: str = "steps") -> str:
    """The pooled prompts at `budget` in two small tables: each arm's value per metric, then each arm minus
    `baseline` (95% intervals: seeds, then prompts)."""
    pooled = pooled_prompts(rows)
    mine = [r for r in rows if r["prompts"] == pooled and r["budget"] in (budget, "-")]
    metrics = list(dict.fromkeys(r["metric"] for r in mine))
    arms = list(dict.fromkeys(r["arm"] for r in mine))
    cell = {(r["arm"], r["metric"]): r for r in mine}
    titles = " | ".join(metric_title(m) for m in metrics)
    lines = [f"| arm | {titles} |", "|---" * (len(metrics) + 1) + "|"]
    for arm in arms:
        values = [f"{cell[arm, m]['tau']:.3f} [{cell[arm, m]['ci95'][0]:.3f}, {cell[arm, m]['ci95'][1]:.3f}]"
                  if (arm, m) in cell else "-" for m in metrics]
        lines.append(f"| {arm} | {' | '.join(values)} |")
    lines += ["", f"| arm - {baseline} | {titles} |", "|---" * (len(metrics) + 1) + "|"]
    for arm in arms:
        compared = [cell.get((arm, m), {}).get("vs_baseline") for m in metrics]
        if any(compared):
            values = [f"{c['diff']:+.3f} [{c['diff_ci95'][0]:+.3f}, {c['diff_ci95'][1]:+.3f}]" if c else "-"
                      for c in compared]
            lines.append(f"| {arm} | {' | '.join(values)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Each metric with 95% intervals per arm, one panel per (metric, budget); seeds as dots, init as a line."""
    import matplotlib  # plotting only: the backend is set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    group = pooled_prompts(rows)
    rows = [r for r in rows if r["prompts"] == group]
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    budgets = [b for b in ("steps", "wall") if any(r["budget"] == b for r in rows)]
    fig, axes = plt.subplots(len(metrics), len(budgets), figsize=(5 * len(budgets), 3.6 * len(metrics)),
                             squeeze=False)
    for i, metric in enumerate(metrics):
        init = next(r for r in rows if r["metric"] == metric and r["arm"] == "init")
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            mine = [r for r in rows if r["metric"] == metric and r["budget"] == budget]
            for x, r in enumerate(mine):
                ax.errorbar([x], [r["tau"]], yerr=[[r["tau"] - r["ci95"][0]], [r["ci95"][1] - r["tau"]]], fmt="o",
                            capsize=4, color="C0")
                ax.scatter([x] * len(r["seed_taus"]), r["seed_taus"], s=12, color="C1", zorder=3)
            ax.axhline(init["tau"], color="gray", linestyle="--", label=f"init {init['tau']:.3f}")
            ax.set_xticks(range(len(mine)), [f"{r['arm']}\n{r['steps']} steps" for r in mine])
            ax.set_title(f"{metric_title(metric)}, same {'steps' if budget == 'steps' else 'wall clock'} ({group})")
            ax.set_ylabel("95% CI: seeds, then prompts; dots: seeds")
            ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decide(rows: list[dict], primary: str = "chain", guard: str = "0", budget: str = "steps") -> dict | None:
    """The pre-registered rule (docs/reproduction.md) on the pooled prompts at `budget`: an arm beats the baseline
    when its `primary` difference's interval lies above 0 and its `guard` (T = 0 tau) difference's does not lie
    below 0; the winner is the beating arm with the largest `primary` difference (None: no arm beats it). None
    when the study lacks either metric."""
    pooled = pooled_prompts(rows)
    found = {(r["metric"], r["arm"]): r["vs_baseline"] for r in rows
             if r["prompts"] == pooled and r["budget"] == budget and "vs_baseline" in r}
    arms = sorted({arm for metric, arm in found if metric == primary})
    if not arms or any((guard, arm) not in found for arm in arms):
        return None
    verdicts = {arm: {"primary_diff": found[primary, arm]["diff"], "primary_ci95": found[primary, arm]["diff_ci95"],
                      "guard_diff": found[guard, arm]["diff"], "guard_ci95": found[guard, arm]["diff_ci95"]}
                for arm in arms}
    for verdict in verdicts.values():
        verdict["beats"] = bool(verdict["primary_ci95"][0] > 0 and verdict["guard_ci95"][1] >= 0)
    beating = [arm for arm in arms if verdicts[arm]["beats"]]
    winner = max(beating, key=lambda arm: verdicts[arm]["primary_diff"]) if beating else None
    return {"primary": primary, "guard": guard, "budget": budget, "prompts": pooled, "arms": verdicts,
            "winner": winner}


def decision_text(decision: dict | None, baseline: str) -> str:
    if decision is None:
        return ""
    lines = [f"\nDecision ({metric_title(decision['primary'])} interval above 0, {metric_title(decision['guard'])} "
             f"interval not below 0; {decision['prompts']} prompts, budget {decision['budget']}):"]
    for arm, v in decision["arms"].items():
        lines.append(f"- {arm}: {'beats' if v['beats'] else 'does not beat'} {baseline} "
                     f"({v['primary_diff']:+.3f} [{v['primary_ci95'][0]:+.3f}, {v['primary_ci95'][1]:+.3f}]; "
                     f"{v['guard_diff']:+.3f} [{v['guard_ci95'][0]:+.3f}, {v['guard_ci95'][1]:+.3f}])")
    lines.append(f"- winner: {decision['winner'] or f'none ({baseline} stays)'}")
    return "\n".join(lines) + "\n"
