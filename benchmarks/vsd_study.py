"""CE vs the paper's VSD recipe, both continued from one trained CE drafter: tau with 95% intervals.

The paper adds its variational term to an already trained drafter's own loss and trains on at a
small learning rate (5e-6 vs 3e-4 from scratch). This study does the same on CPU scale:

1. same steps: every arm (default `ce` and `recipe` = `ce+vsd` with the provisional weights) and
   seed continues `--init` for `--steps` optimizer steps; wall time per run is recorded;
2. same wall clock: the budget is the median wall time of the `--budget-arm` runs of phase 1 (or
   `--wall-seconds`); every other arm trains again for as many steps as its measured seconds per
   step allow (the budget arm's phase-1 runs are its same-wall-clock runs);
3. tau at T = 0 with the acceptance evaluator (`mmvsd.training.acceptance`, the target's greedy continuation
   replayed, exact) on held-out prompts, optionally at T = 1 with `speculative_generate`;
4. per arm: tau pooled over prompts (new tokens / target forwards) averaged over seeds, a bootstrap
   95% interval over prompts (seeds averaged inside each resample), the spread over seeds; per arm
   vs `--baseline-arm` (ce): the paired difference and ratio with their bootstrap intervals.

Writes OUT/study.json (config, every run, per-prompt counts, summary), OUT/study.md (table) and
OUT/study.png. Runs already trained under OUT/runs/ are reused (delete one to retrain it), and so are
measurements already made (OUT/eval_cache.json, keyed by the drafter's weights, prompts, tree and temperature).

    python benchmarks/vsd_study.py --init runs/ce_main --out benchmarks/results/vsd_study \\
        --feature-cache runs/cache --steps 60 --seeds 3 --lr 3e-5 \\
        --arm "recipe-b=ce+vsd:loss.ce_weight=1.0,loss.vsd_weight=0.1"

Arms are NAME=OBJECTIVE[:KEY=VALUE,...] with TrainConfig overrides (ablations: `no-arw=ce+vsd:loss.use_arw=false`).
Wall clock on a shared machine is noisy: the per-step seconds used for phase 2 are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_ARMS = ("ce=ce", "recipe=ce+vsd")
RUN_FILE = "study_run.json"
EVAL_CACHE_FILE = "eval_cache.json"


# ----------------------------------------------------------------------------- statistics


def pooled_tau(new_tokens: np.ndarray, forwards: np.ndarray) -> np.ndarray:
    """[R, P] per-run per-prompt counts -> [R] tau of each run pooled over prompts (sum new / sum forwards)."""
    return new_tokens.sum(-1) / np.maximum(forwards.sum(-1), 1)


def bootstrap_taus(new_tokens: np.ndarray, forwards: np.ndarray, resamples: np.ndarray) -> np.ndarray:
    """Seed-averaged pooled tau of each prompt resample: counts [R, P], resamples [N, P] indices -> [N]."""
    new = new_tokens[:, resamples].sum(-1)  # [R, N]
    fwd = np.maximum(forwards[:, resamples].sum(-1), 1)
    return (new / fwd).mean(0)


def prompt_resamples(num_prompts: int, num_resamples: int, seed: int) -> np.ndarray:
    """[N, P] prompt indices drawn with replacement (shared by every arm: paired comparisons)."""
    return np.random.default_rng(seed).integers(0, num_prompts, size=(num_resamples, num_prompts))


def percentile_interval(values: np.ndarray, level: float = 0.95) -> list[float]:
    tail = (1.0 - level) / 2 * 100
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def summarise_arm(new_tokens: np.ndarray, forwards: np.ndarray, resamples: np.ndarray) -> dict:
    """tau (mean over seeds of the pooled tau), its 95% bootstrap interval over prompts, seed spread."""
    seed_taus = pooled_tau(new_tokens, forwards)
    return {
        "tau": float(seed_taus.mean()),
        "ci95": percentile_interval(bootstrap_taus(new_tokens, forwards, resamples)),
        "seed_taus": [float(t) for t in seed_taus],
        "seed_std": float(seed_taus.std(ddof=1)) if len(seed_taus) > 1 else 0.0,
        "mean_prompt_tau": float((new_tokens / np.maximum(forwards, 1)).mean()),
    }


def compare_arms(arm: tuple[np.ndarray, np.ndarray], baseline: tuple[np.ndarray, np.ndarray],
                 resamples: np.ndarray, goal_ratio: float = 1.05) -> dict:
    """Paired (same prompt resamples) difference and ratio of arm vs baseline, with 95% intervals."""
    arm_boot, base_boot = bootstrap_taus(*arm, resamples), bootstrap_taus(*baseline, resamples)
    arm_tau, base_tau = float(pooled_tau(*arm).mean()), float(pooled_tau(*baseline).mean())
    diff_ci = percentile_interval(arm_boot - base_boot)
    ratio = arm_tau / base_tau
    return {
        "diff": arm_tau - base_tau, "diff_ci95": diff_ci, "ratio": ratio,
        "ratio_ci95": percentile_interval(arm_boot / base_boot),
        "goal_met": bool(ratio >= goal_ratio and diff_ci[0] > 0),
    }


# ----------------------------------------------------------------------------- arms and training


@dataclass
class Arm:
    name: str
    objective: str
    overrides: list[str] = field(default_factory=list)


def parse_arm(spec: str) -> Arm:
    """'NAME=OBJECTIVE[:KEY=VALUE,...]' -> Arm (a bad spec is a UserError)."""
    from mmvsd.errors import UserError

    name, sep, rest = spec.partition("=")
    objective, _, settings = rest.partition(":")
    if not sep or not name or not objective:
        raise UserError(f"--arm {spec!r}: expected NAME=OBJECTIVE[:KEY=VALUE,...]")
    return Arm(name, objective, [s for s in settings.split(",") if s])


def run_config(args: argparse.Namespace, arm: Arm, seed: int, steps: int, output: Path):
    """The TrainConfig of one run: the base config, --set, the arm's overrides, then the study's own."""
    from mmvsd.training.config import load_train_config

    study = [f"learning_rate={args.lr}", f"max_steps={steps}", f"seed={seed}", "progress=false",
             f"save_every={steps}", "keep_checkpoints=1", "eval_every=0"]
    if args.feature_cache:
        study += ["features=offline", f"feature_cache={args.feature_cache}"]
    flags = {"target": args.target, "init": args.init, "objective": arm.objective, "output": str(output)}
    return load_train_config(args.config, flags, [*args.set, *arm.overrides, *study])


def train_run(args: argparse.Namespace, target, arm: Arm, seed: int, steps: int, output: Path) -> dict:
    """Train one run (or reuse a finished one); returns {arm, seed, steps, seconds, folder}."""
    from mmvsd.files import atomic_file
    from mmvsd.training.trainer import train

    record_path = output / RUN_FILE
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record["steps"] == steps and record["objective"] == arm.objective:
            return record
    config = run_config(args, arm, seed, steps, output)
    start = time.perf_counter()
    train(config, target=target)
    record = {"arm": arm.name, "objective": arm.objective, "overrides": arm.overrides, "seed": seed, "steps": steps,
              "seconds": time.perf_counter() - start, "folder": str(output)}
    with atomic_file(record_path) as handle:
        json.dump(record, handle, indent=1)
    return record


def train_all(args: argparse.Namespace, target, arms: list[Arm]) -> list[dict]:
    """Phase 1 (same steps) for every arm and seed, then phase 2 (same wall clock) for the others,
    unless only the same-steps budget is evaluated."""
    runs_dir = Path(args.out) / "runs"
    runs = []
    for arm in arms:
        for seed in range(args.seeds):
            record = train_run(args, target, arm, seed, args.steps, runs_dir / f"{arm.name}-steps-s{seed}")
            runs.append({**record, "budget": "steps"})
    if "wall" not in args.evaluate_budgets:
        return runs  # no same-wall-clock runs to train
    budget = args.wall_seconds or statistics.median(r["seconds"] for r in runs if r["arm"] == args.budget_arm)
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm.name and r["budget"] == "steps"]
        if arm.name == args.budget_arm and not args.wall_seconds:
            runs += [{**r, "budget": "wall"} for r in mine]
            continue
        seconds_per_step = statistics.median(r["seconds"] / r["steps"] for r in mine)
        steps = max(1, round(budget / seconds_per_step))
        for seed in range(args.seeds):
            same = [r for r in mine if r["seed"] == seed and r["steps"] == steps]  # that run is already trained
            record = same[0] if same else train_run(args, target, arm, seed, steps, runs_dir / f"{arm.name}-wall-s{seed}")
            runs.append({**record, "budget": "wall", "budget_seconds": budget, "seconds_per_step": seconds_per_step})
    return runs


# ----------------------------------------------------------------------------- evaluation


@dataclass
class PromptSet:
    name: str
    prompts: list  # `Prompt` per prompt (token ids, and the media embeddings of image prompts)
    continuations: list[list[int]] | None = None  # the target's greedy continuations (T = 0)


def load_prompt_sets(target, specs: list[str], limit: int, max_new_tokens: int) -> list[PromptSet]:
    """Held-out prompts per benchmark, prompt file or image task (e.g. `vqav2_val_mini_long`, its images
    through the target's modality adapter) with the target's cached greedy continuations."""
    from mmvsd.prompts import load_eval_prompts
    from mmvsd.training.acceptance import cached_greedy_continuations

    sets = []
    for spec in specs:
        prompts = load_eval_prompts(target, spec, limit)
        sets.append(PromptSet(Path(spec).stem, prompts, cached_greedy_continuations(target, prompts, max_new_tokens)))
    return sets


def measure_counts(target, drafter, prompt_set: PromptSet, shape, temperature: float, seed: int = 0,
                   batch_size: int = 8, sampled_limit: int = 0) -> tuple[list[int], list[int]]:
    """Per-prompt (new tokens, target forwards): the evaluator's exact replay at T = 0, generate at T > 0
    (on the first `sampled_limit` prompts of the set when it is set: sampling runs the whole decode loop)."""
    if temperature == 0:
        from mmvsd.training.acceptance import evaluate_acceptance

        report = evaluate_acceptance(target, drafter, prompt_set.prompts, prompt_set.continuations, shape, batch_size)
        return [p.new_tokens for p in report.prompts], [p.target_forwards for p in report.prompts]
    from mmvsd.decoding.decode import DecodeConfig, speculative_generate

    prompts = measured_prompts(prompt_set, temperature, sampled_limit)
    max_new = max(len(c) for c in prompt_set.continuations)
    config = DecodeConfig(max_new_tokens=max_new, temperature=temperature, tree=shape, seed=seed)
    new, forwards = [], []
    for start in range(0, len(prompts), batch_size):
        for result in speculative_generate(target, drafter, prompts[start : start + batch_size], config):
            new.append(len(result.output_ids))
            forwards.append(result.num_target_forwards)
    return new, forwards


def measured_prompts(prompt_set: PromptSet, temperature: float, sampled_limit: int) -> list:
    """The prompts a measurement decodes: all at T = 0, the first `sampled_limit` (0: all) at T > 0."""
    return prompt_set.prompts if temperature == 0 else prompt_set.prompts[: sampled_limit or None]


def evaluation_key(args: argparse.Namespace, digest: str, temperature: float, prompt_set: PromptSet) -> str:
    """Everything a measurement depends on: weights (`weights_sha256`), target, prompts, tree, temperature, seed."""
    prompts = len(measured_prompts(prompt_set, temperature, args.sampled_limit))
    return json.dumps([digest, args.target, prompt_set.name, prompts, args.max_new_tokens, args.tree,
                       float(temperature), args.eval_seed])


def evaluate_all(args: argparse.Namespace, target, runs: list[dict], prompt_sets: list[PromptSet]) -> dict:
    """{folder: {temperature: {set: [new, forwards]}}} for every distinct run folder and the init drafter
    (the neural drafter alone: no n-gram branches in its trees, which would blur the comparison).

    Each measurement is kept in OUT/eval_cache.json as soon as it is made, keyed by `evaluation_key`, so
    an interrupted study, or one asked for another budget or temperature, measures only what is new."""
    from mmvsd.decoding.tree import TreeShape
    from mmvsd.drafters.spec import neural_drafter_from_spec
    from mmvsd.files import atomic_file
    from mmvsd.shipped import weights_sha256

    shape = TreeShape.parse(args.tree)
    cache_path = Path(args.out) / EVAL_CACHE_FILE
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    folders = [args.init] + sorted({r["folder"] for r in runs})
    counts: dict = {}
    for folder in folders:
        drafter = neural_drafter_from_spec(folder, target).eval()
        digest = weights_sha256(drafter)
        counts[folder] = {}
        for temperature in args.temperatures:
            by_set = counts[folder][str(temperature)] = {}
            for ps in prompt_sets:
                key = evaluation_key(args, digest, temperature, ps)
                if key not in cache:
                    cache[key] = measure_counts(target, drafter, ps, shape, temperature, seed=args.eval_seed,
                                                sampled_limit=args.sampled_limit)
                    with atomic_file(cache_path) as handle:
                        json.dump(cache, handle)
                by_set[ps.name] = [list(cache[key][0]), list(cache[key][1])]
    return counts


# ----------------------------------------------------------------------------- summary and reports


def arm_counts(counts: dict, folders: list[str], temperature: str, set_names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """[R, P] new tokens and forwards of the given run folders over the concatenated prompt sets."""
    new = np.array([[n for s in set_names for n in counts[f][temperature][s][0]] for f in folders], dtype=float)
    fwd = np.array([[n for s in set_names for n in counts[f][temperature][s][1]] for f in folders], dtype=float)
    return new, fwd


def summarise(args: argparse.Namespace, runs: list[dict], counts: dict, set_names: list[str]) -> list[dict]:
    """One row per (temperature, prompt set or 'all', budget, arm), with the comparison to the baseline."""
    rows = []
    for temperature in map(str, args.temperatures):
        for group in [*set_names, "all"] if len(set_names) > 1 else set_names:
            names = set_names if group == "all" else [group]
            num_prompts = sum(len(counts[args.init][temperature][s][0]) for s in names)
            resamples = prompt_resamples(num_prompts, args.bootstrap, args.bootstrap_seed)
            init = arm_counts(counts, [args.init], temperature, names)
            rows.append({"temperature": float(temperature), "prompts": group, "budget": "-", "arm": "init", "steps": 0,
                         **summarise_arm(*init, resamples)})
            for budget in args.evaluate_budgets:
                by_arm = {}
                for run in runs:
                    if run["budget"] == budget:
                        by_arm.setdefault(run["arm"], []).append(run)
                baseline = arm_counts(counts, [r["folder"] for r in by_arm[args.baseline_arm]], temperature, names)
                for arm, arm_runs in by_arm.items():
                    data = arm_counts(counts, [r["folder"] for r in arm_runs], temperature, names)
                    row = {"temperature": float(temperature), "prompts": group, "budget": budget, "arm": arm,
                           "steps": arm_runs[0]["steps"], **summarise_arm(*data, resamples)}
                    if arm != args.baseline_arm:
                        row["vs_baseline"] = compare_arms(data, baseline, resamples, args.goal_ratio)
                    rows.append(row)
    return rows


def markdown_table(rows: list[dict], baseline: str) -> str:
    header = (f"| T | prompts | budget | arm | steps | tau (95% CI over prompts) | seeds (std) | vs {baseline}: ratio "
              "(95% CI) | diff (95% CI) | goal |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seeds = ", ".join(f"{t:.3f}" for t in r["seed_taus"])
        cmp = r.get("vs_baseline")
        vs = (f"{cmp['ratio']:.3f} [{cmp['ratio_ci95'][0]:.3f}, {cmp['ratio_ci95'][1]:.3f}] | "
              f"{cmp['diff']:+.3f} [{cmp['diff_ci95'][0]:+.3f}, {cmp['diff_ci95'][1]:+.3f}] | "
              f"{'met' if cmp['goal_met'] else 'not met'}") if cmp else "- | - | -"
        lines.append(f"| {r['temperature']:g} | {r['prompts']} | {r['budget']} | {r['arm']} | {r['steps']} | "
                     f"{r['tau']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | {seeds} ({r['seed_std']:.3f}) | {vs} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """tau with 95% intervals per arm, one panel per (temperature, budget); seeds as dots, init as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = "all" if any(r["prompts"] == "all" for r in rows) else rows[0]["prompts"]
    rows = [r for r in rows if r["prompts"] == group]
    temperatures = sorted({r["temperature"] for r in rows})
    budgets = [b for b in ("steps", "wall") if any(r["budget"] == b for r in rows)]
    fig, axes = plt.subplots(len(temperatures), len(budgets), figsize=(5 * len(budgets), 3.6 * len(temperatures)),
                             squeeze=False)
    for i, temperature in enumerate(temperatures):
        init = next(r for r in rows if r["temperature"] == temperature and r["arm"] == "init")
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            mine = [r for r in rows if r["temperature"] == temperature and r["budget"] == budget]
            for x, r in enumerate(mine):
                ax.errorbar([x], [r["tau"]], yerr=[[r["tau"] - r["ci95"][0]], [r["ci95"][1] - r["tau"]]], fmt="o",
                            capsize=4, color="C0")
                ax.scatter([x] * len(r["seed_taus"]), r["seed_taus"], s=12, color="C1", zorder=3)
            ax.axhline(init["tau"], color="gray", linestyle="--", label=f"init {init['tau']:.3f}")
            ax.set_xticks(range(len(mine)), [f"{r['arm']}\n{r['steps']} steps" for r in mine])
            ax.set_title(f"T={temperature:g}, same {'steps' if budget == 'steps' else 'wall clock'} ({group})")
            ax.set_ylabel("tau (95% CI over prompts; dots: seeds)")
            ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(args: argparse.Namespace, runs: list[dict], counts: dict, rows: list[dict]) -> None:
    from mmvsd.files import atomic_file

    out = Path(args.out)
    result = {"config": {k: v for k, v in vars(args).items()}, "runs": runs, "counts": counts, "summary": rows}
    with atomic_file(out / "study.json") as handle:
        json.dump(result, handle, indent=1)
    with atomic_file(out / "study.md") as handle:
        handle.write(markdown_table(rows, args.baseline_arm))
    tmp = out / ".study.tmp.png"
    plot(rows, tmp)
    tmp.replace(out / "study.png")


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="the trained CE drafter every arm continues (folder or name)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--config", default="smollm2_cpu", help="base training config (YAML path or shipped name)")
    p.add_argument("--feature-cache", default="", help="offline feature cache (mmvsd prepare) to train from")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE override for every run (repeatable)")
    p.add_argument("--arm", action="append", default=[], help="NAME=OBJECTIVE[:KEY=VALUE,...] (default: ce, recipe)")
    p.add_argument("--baseline-arm", default="ce")
    p.add_argument("--budget-arm", default="recipe", help="its same-steps wall time is the wall-clock budget")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of the same-steps phase")
    p.add_argument("--wall-seconds", type=float, default=0.0, help="wall-clock budget (0: from --budget-arm)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--evaluate-budgets", default="steps,wall",
                   help="which comparisons to evaluate and report: steps, wall or both (all are trained)")
    p.add_argument("--lr", type=float, default=3e-5, help="continuation learning rate (paper: 5e-6 vs 3e-4)")
    p.add_argument("--eval-prompts", default="mt_bench,humaneval,gsm8k")
    p.add_argument("--eval-limit", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="60/7/10", help="BUDGET/DEPTH/TOPK")
    p.add_argument("--temperatures", default="0", help="comma list; T > 0 uses speculative_generate")
    p.add_argument("--sampled-limit", type=int, default=0,
                   help="prompts per set at T > 0 (0: all --eval-limit); sampling runs the whole decode loop")
    p.add_argument("--eval-seed", type=int, default=0)
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--goal-ratio", type=float, default=1.05)
    p.add_argument("--out", default="benchmarks/results/vsd_study")
    args = p.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.evaluate_budgets = [b for b in args.evaluate_budgets.split(",") if b]
    return args


def check_args(args: argparse.Namespace, arms: list[Arm]) -> None:
    from mmvsd.errors import UserError

    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise UserError(f"arm names must differ: {names}")
    for role in ("baseline_arm", "budget_arm"):
        if getattr(args, role) not in names:
            raise UserError(f"--{role.replace('_', '-')} {getattr(args, role)!r} is not an arm ({', '.join(names)})")
    if not args.evaluate_budgets or not set(args.evaluate_budgets) <= {"steps", "wall"}:
        raise UserError(f"--evaluate-budgets takes steps, wall or both, got {','.join(args.evaluate_budgets)!r}")
    if (args.steps < 1 or args.seeds < 1 or args.lr <= 0 or args.bootstrap < 100 or args.wall_seconds < 0
            or args.sampled_limit < 0):
        raise UserError("need --steps >= 1, --seeds >= 1, --lr > 0, --bootstrap >= 100, --wall-seconds >= 0, "
                        "--sampled-limit >= 0")


def run_study(args: argparse.Namespace, target=None) -> list[dict]:
    """Train every run, evaluate them and the init drafter, write the reports; returns the summary rows."""
    from mmvsd.target_loader import load_target
    from mmvsd.training.trainer import TARGET_DTYPES

    arms = [parse_arm(spec) for spec in (args.arm or DEFAULT_ARMS)]
    check_args(args, arms)
    # every run's config is valid before any training starts
    configs = [run_config(args, arm, 0, args.steps, Path(args.out) / "runs" / "check") for arm in arms]
    target = target if target is not None else load_target(args.target)  # evaluation: fp32 unless given
    train_dtype = TARGET_DTYPES[configs[0].target_dtype]  # training: the config's (bf16 features are ~3x faster here)
    train_target = target if target.dtype == train_dtype else load_target(args.target, dtype=train_dtype)
    runs = [run for run in train_all(args, train_target, arms) if run["budget"] in args.evaluate_budgets]
    specs = [s for s in args.eval_prompts.split(",") if s]
    prompt_sets = load_prompt_sets(target, specs, args.eval_limit, args.max_new_tokens)
    counts = evaluate_all(args, target, runs, prompt_sets)
    rows = summarise(args, runs, counts, [ps.name for ps in prompt_sets])
    write_outputs(args, runs, counts, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    from mmvsd.errors import UserError

    args = parse_args(argv)
    try:
        rows = run_study(args)
    except UserError as err:
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(rows, args.baseline_arm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
