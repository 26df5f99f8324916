"""CE vs the paper's VSD recipe (and other objectives), all continued from one trained CE drafter, with 95% intervals.

The paper adds its variational term to an already trained drafter's own loss and trains on at a
small learning rate (5e-6 vs 3e-4 from scratch). This study does the same on CPU scale:

1. same steps: every arm (default `ce` and `recipe` = `ce+vsd`, i.e. ce + 0.1 * vsd) and seed continues
   `--init` for `--steps` optimizer steps, seed by seed; wall time per run is recorded. With
   `--session-minutes` an invocation trains that long and stops (exit 3); the next one resumes every run
   from its checkpoint. When a run first reaches `--check-steps` its weights must have moved by `--min-move`
   (relative L2), else the study stops and says to raise `--lr` (the manipulation check);
2. same wall clock (not with `--session-minutes`): the budget is the median wall time of the `--budget-arm`
   runs of phase 1 (or `--wall-seconds`); every other arm trains again for as many steps as its measured
   seconds per step allow (the budget arm's phase-1 runs are its same-wall-clock runs);
3. metrics on held-out prompts: with `--accept-depth D`, the expected accepted length of a depth-D chain
   sampled from the drafter, estimated without bias from the target's T = 1 continuations (`expected_acceptance`;
   deterministic given them), with the teacher-forced product beside it; tau at T = 0 with the acceptance
   evaluator (the target's greedy continuation replayed, exact) and at T > 0 with `speculative_generate`;
4. per arm: the metric pooled over prompts (new tokens / target forwards; summed expected acceptance /
   anchors), averaged over seeds; a 95% interval from a hierarchical bootstrap (seeds with replacement per
   arm, then prompts, shared by every arm); per arm vs `--baseline-arm` (ce): the paired difference and
   ratio with their intervals.

Writes OUT/study.json (config, runs, per-prompt counts, summary, the pre-registered decision: `study_report.decide`),
OUT/study.md (table and decision) and OUT/study.png. Runs already trained under OUT/runs/ are reused (delete one
to retrain it), and so are measurements already made (OUT/eval_cache.json, keyed by the drafter's weights,
prompts, tree and metric). `--evaluate-finished` with the same arguments makes those measurements for the runs
trained so far, beside a study that is still training.

    python -m mmvsd_studies.vsd_study --init runs/ce_main --out studies/results/vsd_study \\
        --feature-cache runs/cache --steps 60 --seeds 3 --lr 3e-5 \\
        --arm "recipe-b=ce+vsd:loss.ce_weight=1.0,loss.vsd_weight=0.1"

Arms are NAME=OBJECTIVE[:KEY=VALUE,...] with TrainConfig overrides (ablations: `no-arw=ce+vsd:loss.use_arw=false`).
Wall clock on a shared machine is noisy: the per-step seconds used for phase 2 are in the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mmvsd.decoding.decode import DecodeConfig, generate_each
from mmvsd.decoding.tree import TreeShape
from mmvsd.drafters.spec import neural_drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.eval.acceptance import cached_greedy_continuations, evaluate_acceptance, expected_acceptance
from mmvsd.files import atomic_file
from mmvsd.prompts import load_eval_prompts
from mmvsd.shipped import weights_sha256
from mmvsd.target_loader import load_target
from mmvsd.training.config import load_train_config
from mmvsd.training.trainer import STATE_FILE, TARGET_DTYPES, latest_checkpoint, load_training_target, train

DEFAULT_ARMS = ("ce=ce", "recipe=ce+vsd")
RUN_FILE = "study_run.json"
EVAL_CACHE_FILE = "eval_cache.json"
# the chain metrics (--accept-depth) and the name each has in the cache's keys: "accept" is the teacher-forced
# product's, the name it had as the primary metric before the unbiased estimate replaced it
CHAIN_METRICS = {"chain": "chain", "forced": "accept"}

from mmvsd_studies.study_report import compact_table, decide, decision_text, markdown_table, plot
from mmvsd_studies.study_stats import (
    compare_arms,
    prompt_resamples,
    seed_resamples,
    summarise_arm,
)

# ----------------------------------------------------------------------------- arms and training


@dataclass
class Arm:
    name: str
    objective: str
    overrides: list[str] = field(default_factory=list)


def parse_arm(spec: str) -> Arm:
    """'NAME=OBJECTIVE[:KEY=VALUE,...]' -> Arm (a bad spec is a UserError)."""
    name, sep, rest = spec.partition("=")
    objective, _, settings = rest.partition(":")
    if not sep or not name or not objective:
        raise UserError(f"--arm {spec!r}: expected NAME=OBJECTIVE[:KEY=VALUE,...]")
    return Arm(name, objective, [s for s in settings.split(",") if s])


def run_config(args: argparse.Namespace, arm: Arm, seed: int, steps: int, output: Path):
    """The TrainConfig of one run: the base config, --set, the arm's overrides, then the study's own."""
    study = [f"learning_rate={args.lr}", f"max_steps={steps}", f"seed={seed}", "progress=false",
             f"save_every={min(steps, args.save_every)}", "keep_checkpoints=1", "eval_every=0"]
    if args.feature_cache:
        study += ["features=offline", f"feature_cache={args.feature_cache}"]
    flags = {"target": args.target, "init": args.init, "objective": arm.objective, "output": str(output)}
    return load_train_config(args.config, flags, [*args.set, *arm.overrides, *study])


class Unfinished(Exception):
    """The session's training budget ran out: the study goes on when it is run again."""


def weights_moved(init_folder: str, run_folder: Path, target) -> float:
    """||w - w0|| / ||w0|| over every drafter weight: how far a run's drafter moved from the one it continues."""
    start = dict(neural_drafter_from_spec(init_folder, target).named_parameters())
    moved = dict(neural_drafter_from_spec(str(run_folder), target).named_parameters())
    change = sum(float((moved[k].detach().float() - w.detach().float()).pow(2).sum()) for k, w in start.items())
    size = sum(float(w.detach().float().pow(2).sum()) for w in start.values())
    return (change / max(size, 1e-30)) ** 0.5


def train_run(args: argparse.Namespace, target, arm: Arm, seed: int, steps: int, output: Path,
              deadline: float = float("inf")) -> dict:
    """Train one run (or reuse a finished one); returns {arm, seed, steps, seconds, folder, moved}. With a
    `deadline` (time.monotonic()), a run trains until it and resumes from its checkpoint next time (Unfinished).
    When a run first reaches --check-steps its weights must have moved by --min-move (the manipulation check)."""
    record_path, progress_path = output / RUN_FILE, output / "study_progress.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record["steps"] == steps and record["objective"] == arm.objective:
            return record
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Unfinished
    config = run_config(args, arm, seed, steps, output)
    if remaining != float("inf"):
        config.max_minutes = remaining / 60
    progress = json.loads(progress_path.read_text()) if progress_path.is_file() else {"seconds": 0.0, "chunks": 0}
    checked = "moved_at_check" in progress
    if not checked and args.min_move > 0:
        config.stop_at_step = min(args.check_steps, steps)  # this chunk ends at the check
    resume = latest_checkpoint(output) is not None
    start = time.perf_counter()
    train(config, target=target, resume=resume)
    progress["seconds"] += time.perf_counter() - start
    progress["chunks"] += 1
    done = json.loads((latest_checkpoint(output) / STATE_FILE).read_text())["step"]
    progress["moved"] = weights_moved(args.init, output, target)
    first_check = not checked and done >= min(args.check_steps, steps)
    if first_check:
        progress["moved_at_check"], progress["check_step"] = progress["moved"], done
    with atomic_file(progress_path) as handle:
        json.dump(progress, handle, indent=1)
    if first_check and progress["moved"] < args.min_move:
        raise UserError(f"manipulation check: run {output.name} moved its weights by {progress['moved']:.2%} "
                        f"(||w - w0|| / ||w0||) in its first {done} steps, under --min-move {args.min_move:.0%}: "
                        f"raise --lr (now {args.lr:g}) and start again (delete {Path(args.out) / 'runs'})")
    if done < steps:
        if first_check:  # the check passed: the run goes on in this session's budget
            return train_run(args, target, arm, seed, steps, output, deadline)
        raise Unfinished
    record = {"arm": arm.name, "objective": arm.objective, "overrides": arm.overrides, "seed": seed, "steps": steps,
              "seconds": progress["seconds"], "folder": str(output), "moved": progress["moved"],
              "moved_at_check": progress.get("moved_at_check"), "check_step": progress.get("check_step")}
    with atomic_file(record_path) as handle:
        json.dump(record, handle, indent=1)
    return record


def train_all(args: argparse.Namespace, target, arms: list[Arm]) -> list[dict]:
    """Phase 1 (same steps) for every arm and seed, then phase 2 (same wall clock) for the others,
    unless only the same-steps budget is evaluated."""
    runs_dir = Path(args.out) / "runs"
    deadline = time.monotonic() + 60 * args.session_minutes if args.session_minutes > 0 else float("inf")
    runs, unfinished = [], []
    for seed in range(args.seeds):  # seed by seed: a stopped study has whole seeds of every arm
        for arm in arms:
            try:
                record = train_run(args, target, arm, seed, args.steps, runs_dir / f"{arm.name}-steps-s{seed}",
                                   deadline)
            except Unfinished:
                unfinished.append(f"{arm.name}-steps-s{seed}")
                continue
            runs.append({**record, "budget": "steps"})
    if unfinished:
        print(f"study: --session-minutes {args.session_minutes:g} spent; {len(unfinished)} run(s) unfinished "
              f"({', '.join(unfinished)}): run the same command again to go on", file=sys.stderr)
        raise Unfinished
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
            record = same[0] if same else train_run(args, target, arm, seed, steps,
                                                    runs_dir / f"{arm.name}-wall-s{seed}")
            runs.append({**record, "budget": "wall", "budget_seconds": budget, "seconds_per_step": seconds_per_step})
    return runs


# ----------------------------------------------------------------------------- evaluation


@dataclass
class PromptSet:
    name: str
    prompts: list  # `Prompt` per prompt (token ids, and the media embeddings of image prompts)
    continuations: list[list[int]] | None = None  # the target's greedy continuations (T = 0)
    sampled: list[list[int]] | None = None  # the target's continuations sampled at T = 1 (the chain metrics)


def load_prompt_sets(target, specs: list[str], limit: int, max_new_tokens: int, sample_seed: int | None = None
                     ) -> list[PromptSet]:
    """Held-out prompts per benchmark, prompt file or image task (e.g. `vqav2_val_mini_long`, its images
    through the target's modality adapter) with the target's cached greedy continuations, and continuations
    sampled at T = 1 with `sample_seed` when it is given."""
    sets = []
    for spec in specs:
        prompts = load_eval_prompts(target, spec, limit)
        greedy = cached_greedy_continuations(target, prompts, max_new_tokens)
        sampled = None
        if sample_seed is not None:
            sampled = cached_greedy_continuations(target, prompts, max_new_tokens, temperature=1.0, seed=sample_seed)
        sets.append(PromptSet(Path(spec).stem, prompts, greedy, sampled))
    return sets


def measure_counts(target, drafter, prompt_set: PromptSet, shape, temperature: float, seed: int = 0,
                   batch_size: int = 8, sampled_limit: int = 0, accept_depth: int = 0,
                   forced: bool = False) -> tuple[list, list]:
    """Per-prompt (new tokens, target forwards): the evaluator's exact replay at T = 0, generate at T > 0, prompt i
    with seed `seed + i` (on the first `sampled_limit` prompts of the set when it is set: sampling runs the whole
    decode loop).
    With `accept_depth`: (summed expected accepted length, anchors) along the sampled continuations instead
    (`forced`: the teacher-forced product's sum)."""
    if accept_depth:
        chains = expected_acceptance(target, drafter, prompt_set.prompts, prompt_set.sampled, accept_depth, batch_size)
        return [c.forced_total if forced else c.total for c in chains], [c.anchors for c in chains]
    if temperature == 0:
        report = evaluate_acceptance(target, drafter, prompt_set.prompts, prompt_set.continuations, shape, batch_size)
        return [p.new_tokens for p in report.prompts], [p.target_forwards for p in report.prompts]

    prompts = measured_prompts(prompt_set, temperature, sampled_limit)
    max_new = max(len(c) for c in prompt_set.continuations)
    new, forwards = [], []
    config = DecodeConfig(max_new_tokens=max_new, temperature=temperature, tree=shape, seed=seed)
    for result in generate_each(target, drafter, prompts, config):  # prompt i alone, seed + i
        new.append(len(result.output_ids))
        forwards.append(result.num_target_forwards)
    return new, forwards


def measured_prompts(prompt_set: PromptSet, temperature: float, sampled_limit: int) -> list:
    """The prompts a measurement decodes: all at T = 0, the first `sampled_limit` (0: all) at T > 0."""
    return prompt_set.prompts if temperature == 0 else prompt_set.prompts[: sampled_limit or None]


def prompts_digest(prompts: list) -> str:
    """A hash of the prompts' token ids: a prompt file edited under the same name is measured again. Media are
    known by the set's name (their embeddings may differ in the last bits between thread counts, and the study
    and its `--evaluate-finished` beside it share measurements)."""
    return hashlib.sha256(json.dumps([p.token_ids for p in prompts]).encode()).hexdigest()[:16]


def evaluation_key(args: argparse.Namespace, digest: str, metric: str, prompt_set: PromptSet) -> str:
    """Everything a measurement depends on: weights (`weights_sha256`), target, prompts, tree, metric, seed."""
    if metric in CHAIN_METRICS:
        return json.dumps([digest, args.target, prompt_set.name, prompts_digest(prompt_set.prompts),
                           args.max_new_tokens, CHAIN_METRICS[metric], args.accept_depth, args.eval_seed])
    temperature = float(metric)
    prompts = prompts_digest(measured_prompts(prompt_set, temperature, args.sampled_limit))
    return json.dumps([digest, args.target, prompt_set.name, prompts, args.max_new_tokens, args.tree,
                       temperature, args.eval_seed])


def evaluate_all(args: argparse.Namespace, target, runs: list[dict], prompt_sets: list[PromptSet]) -> dict:
    """{folder: {metric: {set: [numerators, denominators]}}} for every distinct run folder and the init drafter
    (the neural drafter alone: no n-gram branches in its trees, which would blur the comparison).

    Each measurement is kept in OUT/eval_cache.json as soon as it is made, keyed by `evaluation_key`, so
    an interrupted study, or one asked for another budget or metric, measures only what is new. Two evaluators
    may share the file (`--evaluate-finished` beside the study): each reads the other's measurements before
    making one and merges them into what it writes (a measurement lost to a write in between is made again)."""
    shape = TreeShape.parse(args.tree)
    cache_path = Path(args.out) / EVAL_CACHE_FILE
    cache = read_cache(cache_path)
    folders = [args.init] + sorted({r["folder"] for r in runs})
    counts: dict = {}
    for folder in folders:
        drafter = neural_drafter_from_spec(folder, target).eval()
        digest = weights_sha256(drafter)
        counts[folder] = {}
        for metric in metric_names(args):
            by_set = counts[folder][metric] = {}
            for ps in prompt_sets:
                key = evaluation_key(args, digest, metric, ps)
                if key not in cache:
                    cache.update(read_cache(cache_path))  # what an --evaluate-finished process beside it measured
                if key not in cache:
                    accept = args.accept_depth if metric in CHAIN_METRICS else 0
                    temperature = 0.0 if metric in CHAIN_METRICS else float(metric)
                    cache[key] = measure_counts(target, drafter, ps, shape, temperature, seed=args.eval_seed,
                                                sampled_limit=args.sampled_limit, accept_depth=accept,
                                                forced=metric == "forced")
                    cache = {**read_cache(cache_path), **cache}  # keep what the other one wrote meanwhile
                    with atomic_file(cache_path) as handle:
                        json.dump(cache, handle)
                by_set[ps.name] = [list(cache[key][0]), list(cache[key][1])]
    return counts


# ----------------------------------------------------------------------------- summary and reports


def read_cache(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def finished_runs(args: argparse.Namespace) -> list[dict]:
    """The records of the runs already trained under OUT/runs (any budget)."""
    return [json.loads(p.read_text()) for p in sorted((Path(args.out) / "runs").glob(f"*/{RUN_FILE}"))]


def arm_counts(counts: dict, folders: list[str], metric: str, set_names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """[R, P] numerators and denominators (new tokens and forwards; summed expected acceptance and anchors) of the
    given run folders over the concatenated prompt sets."""
    new = np.array([[n for s in set_names for n in counts[f][metric][s][0]] for f in folders], dtype=float)
    fwd = np.array([[n for s in set_names for n in counts[f][metric][s][1]] for f in folders], dtype=float)
    return new, fwd


def metric_names(args: argparse.Namespace) -> list[str]:
    """What each run is measured by: with --accept-depth "chain" (a sampled chain's expected accepted length,
    unbiased) and "forced" (the teacher-forced product), then tau at each of --temperatures ("0", "1", ...)."""
    return (list(CHAIN_METRICS) if args.accept_depth else []) + [f"{t:g}" for t in args.temperatures]


def runs_by_arm(runs: list[dict], budget: str) -> dict[str, list[dict]]:
    """{arm: its runs at `budget`}, each arm's runs in the order `runs` lists them."""
    by_arm: dict[str, list[dict]] = {}
    for run in runs:
        if run["budget"] == budget:
            by_arm.setdefault(run["arm"], []).append(run)
    return by_arm


def arm_seed_draws(by_arm: dict[str, list[dict]], bootstrap: int, bootstrap_seed: int) -> dict[str, np.ndarray]:
    """Each arm's seed draws of the hierarchical bootstrap: the i-th arm by name draws with bootstrap_seed + 1 + i
    (bootstrap_seed itself draws the prompts)."""
    return {arm: seed_resamples(len(arm_runs), bootstrap, bootstrap_seed + 1 + i)
            for i, (arm, arm_runs) in enumerate(sorted(by_arm.items()))}


def summarise(args: argparse.Namespace, runs: list[dict], counts: dict, set_names: list[str]) -> list[dict]:
    """One row per (metric, prompt set or 'all', budget, arm), with the comparison to the baseline. Intervals are
    hierarchical: seeds drawn with replacement per arm, then prompts (shared by every arm: paired)."""
    rows = []
    for metric in metric_names(args):
        for group in [*set_names, "all"] if len(set_names) > 1 else set_names:
            names = set_names if group == "all" else [group]
            num_prompts = sum(len(counts[args.init][metric][s][0]) for s in names)
            resamples = prompt_resamples(num_prompts, args.bootstrap, args.bootstrap_seed)
            init = arm_counts(counts, [args.init], metric, names)
            rows.append({"metric": metric, "prompts": group, "budget": "-", "arm": "init", "steps": 0,
                         **summarise_arm(*init, resamples)})
            for budget in args.evaluate_budgets:
                by_arm = runs_by_arm(runs, budget)
                draws = arm_seed_draws(by_arm, args.bootstrap, args.bootstrap_seed)
                baseline = arm_counts(counts, [r["folder"] for r in by_arm[args.baseline_arm]], metric, names)
                for arm, arm_runs in by_arm.items():
                    data = arm_counts(counts, [r["folder"] for r in arm_runs], metric, names)
                    row = {"metric": metric, "prompts": group, "budget": budget, "arm": arm,
                           "steps": arm_runs[0]["steps"], **summarise_arm(*data, resamples, draws[arm])}
                    if arm != args.baseline_arm:
                        row["vs_baseline"] = compare_arms(data, baseline, resamples, args.goal_ratio,
                                                          (draws[arm], draws[args.baseline_arm]))
                    rows.append(row)
    return rows


def write_outputs(args: argparse.Namespace, runs: list[dict], counts: dict, rows: list[dict]) -> None:
    out = Path(args.out)
    decision = decide(rows)
    result = {"config": {k: v for k, v in vars(args).items()}, "runs": runs, "counts": counts, "summary": rows,
              "decision": decision}
    with atomic_file(out / "study.json") as handle:
        json.dump(result, handle, indent=1)
    with atomic_file(out / "study.md") as handle:
        handle.write(compact_table(rows, args.baseline_arm) + "\n" + markdown_table(rows, args.baseline_arm)
                     + decision_text(decision, args.baseline_arm))
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
    p.add_argument("--temperatures", default="0", help="tau at these temperatures (comma list; T > 0 runs "
                   "speculative_generate)")
    p.add_argument("--accept-depth", type=int, default=0,
                   help="also measure the expected accepted length of a chain this deep, sampled from the drafter, "
                   "from the target's T = 1 continuations (the primary metric of the powered study; 0: off)")
    p.add_argument("--session-minutes", type=float, default=0.0,
                   help="training time of this invocation (0: no limit); unfinished runs resume next time (exit 3)")
    p.add_argument("--min-move", type=float, default=0.0,
                   help="manipulation check: a run's weights must have moved by this fraction at --check-steps")
    p.add_argument("--check-steps", type=int, default=1, help="the step of the manipulation check")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps (a killed study resumes there)")
    p.add_argument("--sampled-limit", type=int, default=0,
                   help="prompts per set at T > 0 (0: all --eval-limit); sampling runs the whole decode loop")
    p.add_argument("--eval-seed", type=int, default=0)
    p.add_argument("--evaluate-finished", action="store_true",
                   help="measure the runs trained so far into OUT's cache and train nothing (beside a study that "
                   "is still training; the same other arguments)")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--goal-ratio", type=float, default=1.05)
    p.add_argument("--out", default="studies/results/vsd_study")
    args = p.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.evaluate_budgets = [b for b in args.evaluate_budgets.split(",") if b]
    return args


def check_args(args: argparse.Namespace, arms: list[Arm]) -> None:
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise UserError(f"arm names must differ: {names}")
    for role in ("baseline_arm", "budget_arm"):
        if getattr(args, role) not in names:
            raise UserError(f"--{role.replace('_', '-')} {getattr(args, role)!r} is not an arm ({', '.join(names)})")
    if not args.evaluate_budgets or not set(args.evaluate_budgets) <= {"steps", "wall"}:
        raise UserError(f"--evaluate-budgets takes steps, wall or both, got {','.join(args.evaluate_budgets)!r}")
    if (args.steps < 1 or args.seeds < 1 or args.lr <= 0 or args.bootstrap < 100 or args.wall_seconds < 0
            or args.sampled_limit < 0 or args.accept_depth < 0 or args.session_minutes < 0 or args.min_move < 0
            or args.check_steps < 1 or args.save_every < 1):
        raise UserError("need --steps >= 1, --seeds >= 1, --lr > 0, --bootstrap >= 100, --wall-seconds >= 0, "
                        "--sampled-limit >= 0, --accept-depth >= 0, --session-minutes >= 0, --min-move >= 0, "
                        "--check-steps >= 1, --save-every >= 1")
    if args.session_minutes and "wall" in args.evaluate_budgets:
        raise UserError("--session-minutes trains in chunks, whose wall time is no budget: use --evaluate-budgets "
                        "steps")


def study_prompt_sets(args: argparse.Namespace, target) -> list[PromptSet]:
    specs = [s for s in args.eval_prompts.split(",") if s]
    return load_prompt_sets(target, specs, args.eval_limit, args.max_new_tokens,
                            sample_seed=args.eval_seed if args.accept_depth else None)


def evaluate_finished(args: argparse.Namespace, target=None) -> int:
    """--evaluate-finished: measure the init drafter and every run trained so far into OUT/eval_cache.json and
    train nothing; returns how many runs it found. Run beside a study still training (on a small CPU one
    thread each: the evaluation's small decode steps gain little from a second thread), so the study's own
    evaluation later finds those measurements made."""
    target = target if target is not None else load_target(args.target)
    runs = finished_runs(args)
    evaluate_all(args, target, runs, study_prompt_sets(args, target))
    return len(runs)


def run_study(args: argparse.Namespace, target=None) -> list[dict]:
    """Train every run, evaluate them and the init drafter, write the reports; returns the summary rows."""
    arms = [parse_arm(spec) for spec in (args.arm or DEFAULT_ARMS)]
    check_args(args, arms)
    # every run's config is valid before any training starts
    configs = [run_config(args, arm, 0, args.steps, Path(args.out) / "runs" / "check") for arm in arms]
    target = target if target is not None else load_target(args.target)  # evaluation: fp32 unless given
    # training: the target as `mmvsd train` loads it (the config's target_dtype and target_engine; the engine only
    # changes a half-precision target)
    dtype = TARGET_DTYPES[configs[0].target_dtype]
    same = target.dtype == dtype and (dtype == torch.float32 or configs[0].target_engine == "exact")
    train_target = target if same else load_training_target(configs[0], "cpu")
    runs = [run for run in train_all(args, train_target, arms) if run["budget"] in args.evaluate_budgets]
    prompt_sets = study_prompt_sets(args, target)
    counts = evaluate_all(args, target, runs, prompt_sets)
    rows = summarise(args, runs, counts, [ps.name for ps in prompt_sets])
    write_outputs(args, runs, counts, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.evaluate_finished:
            found = evaluate_finished(args)
            print(f"study: the init drafter and {found} trained run(s) measured into "
                  f"{Path(args.out) / EVAL_CACHE_FILE}")
            return 0
        rows = run_study(args)
    except UserError as err:
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    except Unfinished:
        return 3
    print(markdown_table(rows, args.baseline_arm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
