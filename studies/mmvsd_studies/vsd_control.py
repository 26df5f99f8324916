"""A synthetic control for the objectives (issue 33): where CE, VSD and exact acceptance win, by construction.

The language is a branching order-2 Markov chain over `num_tokens` words, fixed by a seed: each context
(a, b) has its own next-word distribution, drawn from four kinds (near-deterministic, two modes, three
modes, high entropy). A tiny Llama target is trained on samples of it until it models it well (its
per-token KL to the true chain is reported), and saved under OUT (reused when present). A conversation is
`<|user|> PROMPT <|assistant|> ANSWER` in the target's word-level chat template; the chain runs on across the
markers. This world (settings, language, target, training prompts) is `control_world.py`.

Every arm starts from the same narrow EAGLE-3 drafter (`mmvsd/drafters/eagle3.py`: the hidden width must equal
the target's, since the drafter borrows the target's embeddings, so it is narrowed where it can be: a
`drafter_intermediate`-wide MLP and one `drafter_head_dim` attention head, against the target's
`target_intermediate` x `target_layers`), written as an `--init` folder, and is trained by mmvsd's own
trainer (`mmvsd.training.trainer.train`, objectives from `mmvsd.training.objectives`) on the same user
prompts, answered by the target (the trainer's `regenerate`):

    ce-greedy  ce on greedy answers (regenerate=greedy, T = 0)
    ce-sample  ce on T = 1 answers (regenerate=sample)
    vsd        vsd alone (the ELBO's E_q[log kappa] half), T = 1 answers
    ce+vsd     ce + 0.1 * vsd (loss.ce_weight=1.0, loss.vsd_weight=0.1: the paper's recipe), T = 1 answers
    accept     accept alone (sum_v min(p, q) along the unroll), T = 1 answers
    ce+accept  ce + accept, T = 1 answers
    vsd-rloo   VSD's proposals scored by kappa against a leave-one-out baseline (no binary oracle), T = 1 answers
    ce+vsd-rloo  ce + vsd-rloo, T = 1 answers
plus `init`, the untrained drafter, as a floor.

Metrics on held-out prompts (prefixes of the chain drawn with another seed), per prompt, then a bootstrap
(95% percentile intervals; differences paired on the same prompt resamples; with several replicates, i.e.
training seeds (`--replicate OUT:SEED`), each arm's value is the mean over its seeds and the bootstrap draws
seeds, then prompts):
    accept_t1  expected accepted length of a depth-D chain sampled from the drafter and verified at T = 1,
               estimated without bias from the target's own T = 1 continuation y of the prompt
               (`mmvsd.eval.acceptance.expected_acceptance`, the powered study's primary metric). At each
               anchor t (the drafter has read the pairs up to t, the root is token t+1; every t whose token t+2
               is a continuation token after the first, which the prefill chooses) the drafter is unrolled D
               steps along the continuation (training-time test: step i is fed the continuation's token t+1+i,
               as a decoding session fed those tokens computes), a_i = sum_v min(p_i(v), q_i(v)) with p_i the
               target's distribution of token t+2+i and q_i the drafter's (0 past the continuation's end),
               r_i = min(p_i, q_i)(y_i) / p_i(y_i) at the continuation's token, and E_t = sum_{k=1..D} r_1 ...
               r_{k-1} a_k. accept_t1 = the mean of E_t over every anchor of every prompt. The table also gives
               the mean a_i per step.
    forced_t1  the teacher-forced product sum_k a_1 ... a_k instead (what the control reported as accept_t1
               before 2026-11-27): each later step's context follows p, not the accepted drafts' law, so it is
               biased beyond depth 1, towards what the `accept` objective maximises.
    tau_t0     tau (new tokens / target forwards, the prefill counted) of tree decoding at T = 0 with
               `mmvsd.decoding.decode.speculative_generate` and the tree `tree`; every output is checked
               token for token against `vanilla_generate` (greedy): the run fails if one differs.
    tau_t1     tau of the same tree decoding at T = 1 (sampled, so noisy; a check that accept_t1 ranks the
               arms as decoding does).

    python -m mmvsd_studies.vsd_control                      # everything, resumable
    python -m mmvsd_studies.vsd_control arm_steps=200 num_eval_prompts=40 --arms ce-sample,accept
    python -m mmvsd_studies.vsd_control --replicate /tmp/vsd_control:0 --replicate /tmp/vsd_control:1 \
        --replicate /tmp/vsd_control:2                     # three training seeds, pooled

`KEY=VALUE` overrides any `ControlConfig` field. OUT (default /tmp/vsd_control) holds the target
(target-<digest>/, reused when its settings match), the data, one folder per trained arm (skipped when
trained) and the evaluations (eval/<arm>-<digest>.json, reused); the result goes to
studies/results/vsd_control.json (and .png) and a markdown table to stdout. Run it with one thread
(OMP_NUM_THREADS=1): it sets torch.set_num_threads(1) itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmvsd.decoding.decode import DecodeConfig, generate_each, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape
from mmvsd.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_linear_weights
from mmvsd.eval.acceptance import expected_acceptance
from mmvsd.shipped import weights_sha256
from mmvsd.target_loader import load_target
from mmvsd.training.config import load_train_config
from mmvsd.training.trainer import latest_checkpoint, train
from mmvsd_studies import RESULTS_DIR
from mmvsd_studies import study_stats as stats
from mmvsd_studies.control_world import (
    ARM_KEYS,
    ASSISTANT_ID,
    DATA_KEYS,
    DRAFTER_KEYS,
    EVAL_KEYS,
    SPECIALS,
    USER_ID,
    ControlConfig,
    MarkovLanguage,
    make_language,
    parse_overrides,
    prepared_target,
    training_data,
    word_text,
)

RESULTS = RESULTS_DIR / "vsd_control.json"

# ----------------------------------------------------------------------------- the narrow drafter


def narrow_drafter_folder(config: ControlConfig, target, out: Path) -> Path:
    """OUT/drafter-init-<digest>: the fresh EAGLE-3 drafter every arm starts from (`--init`), narrowed where the
    architecture allows (MLP width, one attention head), drafting over the whole vocabulary."""
    folder = out / f"drafter-init-{config.digest(*DRAFTER_KEYS)}"
    if (folder / "config.json").is_file():
        return folder
    sizes = Eagle3Config.from_target(target, draft_vocab_size=target.vocab_size)
    narrow = dataclasses.replace(sizes, intermediate_size=config.drafter_intermediate, num_attention_heads=1,
                                 num_key_value_heads=1, head_dim=config.drafter_head_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.arm_seed)
        drafter = Eagle3Drafter(narrow, target.input_embeddings)
        drafter.apply(init_linear_weights)
    drafter.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    name: str
    objective: str
    regenerate: str  # greedy | sample: the answers it trains on
    overrides: tuple[str, ...] = ()


def control_arms(config: ControlConfig) -> list[Arm]:
    return [
        Arm("ce-greedy", "ce", "greedy"),
        Arm("ce-sample", "ce", "sample"),
        Arm("vsd", "vsd", "sample"),
        Arm("ce+vsd", "ce+vsd", "sample", ("loss.ce_weight=1.0", f"loss.vsd_weight={config.vsd_alpha}")),
        Arm("accept", "accept", "sample"),
        Arm("ce+accept", "ce+accept", "sample", ("loss.accept_weight=1.0",)),
        Arm("vsd-rloo", "vsd-rloo", "sample"),
        Arm("ce+vsd-rloo", "ce+vsd-rloo", "sample", ("loss.rloo_weight=1.0",)),
    ]


def arm_train_config(config: ControlConfig, arm: Arm, target_folder: Path, init_folder: Path, data: Path,
                     out: Path, run_dir: Path):
    """The TrainConfig of one arm (as `mmvsd train` resolves it from flags and key=value overrides)."""
    depth = config.depth
    cache = out / "regenerated" / f"{arm.regenerate}-{config.digest(*DATA_KEYS)}-s{config.arm_seed}.jsonl"
    flags = {"target": str(target_folder), "init": str(init_folder), "objective": arm.objective,
             "output": str(run_dir), "data": str(data)}
    overrides = [
        f"regenerate={arm.regenerate}", f"regenerate_max_new_tokens={config.answer_tokens}",
        f"regenerate_cache={cache}", "regenerate_batch_size=64",
        f"max_length={config.prompt_max + config.answer_tokens + 4}",
        "validation_fraction=0", f"max_steps={config.arm_steps}", f"batch_size={config.arm_batch}",
        f"learning_rate={config.arm_lr}", f"seed={config.arm_seed}", f"save_every={max(1, config.arm_steps // 4)}",
        "keep_checkpoints=1", "eval_every=0", "progress=false", f"log_every={max(1, config.arm_steps // 20)}",
        f"loss.ttt_steps={depth}", f"loss.path_length={depth}", f"loss.num_samples={config.num_samples}",
        f"loss.num_anchors={config.num_anchors}", f"eval_tree={config.tree}", *arm.overrides,
    ]
    return load_train_config(None, flags, overrides)


RUN_RECORD = "control_run.json"


def train_arm(config: ControlConfig, arm: Arm, target, target_folder: Path, init_folder: Path, data: Path,
              out: Path, log=print) -> dict:
    """Train one arm with mmvsd's trainer (resuming an interrupted run from its last checkpoint), or reuse its
    finished run (OUT/runs/<arm>-<digest>/)."""
    run_dir = out / "runs" / f"{arm.name}-{config.digest(*ARM_KEYS)}"
    record_path = run_dir / RUN_RECORD
    if record_path.is_file():
        return json.loads(record_path.read_text())
    train_config = arm_train_config(config, arm, target_folder, init_folder, data, out, run_dir)
    resume = latest_checkpoint(run_dir) is not None
    log(f"training {arm.name}: {arm.objective} on {arm.regenerate} answers, {config.arm_steps} steps"
        + (f" (resumed from {latest_checkpoint(run_dir).name})" if resume else ""))
    start = time.perf_counter()
    train(train_config, target=target, resume=resume)
    record = {"arm": arm.name, "objective": arm.objective, "data": arm.regenerate, "overrides": list(arm.overrides),
              "steps": config.arm_steps, "train_seconds": time.perf_counter() - start, "resumed": resume,
              "folder": str(run_dir)}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    log(f"trained {arm.name} in {record['train_seconds']:.0f} s")
    return record


# ----------------------------------------------------------------------------- evaluation


@dataclass
class EvalSet:
    """Held-out prompts (chat-rendered ids) with the target's continuations."""

    prompts: list[list[int]]
    greedy: list[list[int]]  # vanilla_generate at T = 0
    sampled: list[list[int]]  # vanilla_generate at T = 1, one seed per prompt


def eval_seed(config: ControlConfig, index: int) -> int:
    """The sampling seed of held-out prompt `index` (the same for every arm: paired comparisons)."""
    return config.eval_seed * 1_000_003 + index


def eval_prompts(config: ControlConfig, language: MarkovLanguage, target) -> list[list[int]]:
    """Held-out chain prefixes as the target's chat prompts (`Target.encode_chat`, as regeneration builds them)."""
    generator = torch.Generator().manual_seed(config.eval_seed)
    prompts = []
    for _ in range(config.num_eval_prompts):
        prompt_len = int(torch.randint(config.prompt_min, config.prompt_max + 1, (), generator=generator))
        words = language.sample(1, prompt_len, generator)[0]
        ids = target.encode_chat([{"role": "user", "content": word_text(words.tolist())}])
        expected = [USER_ID, *(words + len(SPECIALS)).tolist(), ASSISTANT_ID]
        if ids != expected:
            raise RuntimeError(f"the chat template rendered {ids}, not {expected}")
        prompts.append(ids)
    return prompts


def make_eval_set(config: ControlConfig, language: MarkovLanguage, target, out: Path) -> EvalSet:
    """The held-out prompts and the target's greedy and T = 1 continuations (cached in OUT/eval/)."""
    path = out / "eval" / f"prompts-{config.digest(*EVAL_KEYS)}.json"
    if path.is_file():
        return EvalSet(**json.loads(path.read_text()))
    prompts = eval_prompts(config, language, target)
    greedy = [r.output_ids for r in vanilla_generate(target, prompts, DecodeConfig(config.answer_tokens))]
    decode = DecodeConfig(config.answer_tokens, temperature=1.0, seed=eval_seed(config, 0))  # prompt i: + i
    sampled = [r.output_ids for r in generate_each(target, None, prompts, decode)]
    result = EvalSet(prompts, greedy, sampled)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(result)))
    return result


def chain_acceptance(target, drafter, prompts: list[list[int]], continuations: list[list[int]], depth: int,
                     batch_size: int = 16) -> list[dict]:
    """Per prompt: {"sum": sum of E_t over its anchors (a sampled chain's expected accepted length, unbiased),
    "forced": the teacher-forced product's sum beside it, "roots": their number, "step_rates": the mean a_i of
    each step i over the anchors where token t+2+i lies in the continuation} from mmvsd's evaluator
    (`mmvsd.eval.acceptance.expected_acceptance`)."""
    return [{"sum": c.total, "forced": c.forced_total, "roots": c.anchors, "step_rates": c.step_rates}
            for c in expected_acceptance(target, drafter, prompts, continuations, depth, batch_size)]


@torch.no_grad()
def tree_decoding(target, drafter, eval_set: EvalSet, config: ControlConfig, temperature: float) -> list[dict]:
    """Per prompt: {"new": new tokens, "forwards": target forwards} of `speculative_generate` with the tree; at
    T = 0 each output must equal the target's greedy continuation (lossless), else RuntimeError."""
    shape = TreeShape.parse(config.tree)
    results = []
    if temperature == 0:
        decode = DecodeConfig(config.answer_tokens, temperature=0.0, tree=shape)
        outputs = []
        for first in range(0, len(eval_set.prompts), 16):
            outputs += speculative_generate(target, drafter, eval_set.prompts[first : first + 16], decode)
        for index, (result, greedy) in enumerate(zip(outputs, eval_set.greedy)):
            if result.output_ids != greedy:
                raise RuntimeError(f"prompt {index}: tree decoding at T = 0 differs from vanilla greedy decoding")
            results.append({"new": len(result.output_ids), "forwards": result.num_target_forwards})
        return results
    decode = DecodeConfig(config.answer_tokens, temperature=temperature, tree=shape, seed=eval_seed(config, 0))
    return [{"new": len(r.output_ids), "forwards": r.num_target_forwards}  # prompt i with eval_seed(config, i)
            for r in generate_each(target, drafter, eval_set.prompts, decode)]


def evaluate_drafter(config: ControlConfig, target, folder: Path, eval_set: EvalSet, out: Path, name: str) -> dict:
    """accept_t1, tau_t0 (lossless-checked) and tau_t1 per prompt for the drafter in `folder` (cached by weights)."""
    drafter = Eagle3Drafter.from_pretrained(folder, target).eval()
    digest = weights_sha256(drafter)[:12]
    # "chain2": records made before accept_t1 became the unbiased estimate are never reused as it
    path = out / "eval" / f"{name}-{config.digest(*EVAL_KEYS)}-{digest}-chain2.json"
    if path.is_file():
        return json.loads(path.read_text())
    start = time.perf_counter()
    record = {
        "accept_t1": chain_acceptance(target, drafter, eval_set.prompts, eval_set.sampled, config.depth),
        "tau_t0": tree_decoding(target, drafter, eval_set, config, 0.0),
        "tau_t1": tree_decoding(target, drafter, eval_set, config, 1.0),
        "lossless_t0": True,  # tree_decoding raised otherwise
    }
    record["eval_seconds"] = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return record


# ----------------------------------------------------------------------------- summary


METRICS = {"accept_t1": ("accept_t1", "sum", "roots"), "forced_t1": ("accept_t1", "forced", "roots"),
           "tau_t0": ("tau_t0", "new", "forwards"), "tau_t1": ("tau_t1", "new", "forwards")}  # record, num., den.
BASELINES = ("ce-greedy", "ce-sample")


def metric_counts(records: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """([R, P] numerators, [R, P] denominators) of a metric over an arm's R replicates: each replicate's value is
    their pooled ratio (sum / sum)."""
    key, numerator, denominator = METRICS[metric]
    return (np.array([[r[numerator] for r in record[key]] for record in records], dtype=float),
            np.array([[r[denominator] for r in record[key]] for record in records], dtype=float))


def summarise(evaluations: dict[str, list[dict]], num_resamples: int, seed: int) -> dict[str, dict]:
    """{arm: {metric: {value, ci95, replicates, vs_<baseline>: {diff, diff_ci95}}}} from each arm's replicates
    (training seeds): the value is the mean over replicates of the pooled ratio; the interval a percentile
    bootstrap, hierarchical when there are several replicates (each arm draws its own replicates with
    replacement, then the held-out prompts, whose resamples every arm shares: differences are paired)."""
    num_prompts = len(next(iter(evaluations.values()))[0]["tau_t0"])
    resamples = stats.prompt_resamples(num_prompts, num_resamples, seed)
    draws = {arm: stats.seed_resamples(len(records), num_resamples, seed + 1 + index) if len(records) > 1 else None
             for index, (arm, records) in enumerate(evaluations.items())}
    summary = {}
    for arm, records in evaluations.items():
        summary[arm] = {}
        for metric in METRICS:
            counts = metric_counts(records, metric)
            boot = stats.bootstrap_taus(*counts, resamples, draws[arm])
            per_replicate = stats.pooled_tau(*counts)
            row = {"value": float(per_replicate.mean()), "ci95": stats.percentile_interval(boot),
                   "replicates": per_replicate.tolist()}
            for baseline in BASELINES:
                if baseline in evaluations and baseline != arm:
                    base = metric_counts(evaluations[baseline], metric)
                    diff = float(per_replicate.mean() - stats.pooled_tau(*base).mean())
                    row[f"vs_{baseline}"] = {"diff": diff, "diff_ci95": stats.percentile_interval(
                        boot - stats.bootstrap_taus(*base, resamples, draws[baseline]))}
            summary[arm][metric] = row
        summary[arm]["step_rates_t1"] = np.mean([r["step_rates"] for record in records for r in record["accept_t1"]],
                                                axis=0).tolist()
    return summary


def _interval(row: dict) -> str:
    return f"{row['value']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]"


def _difference(row: dict, baseline: str) -> str:
    cmp = row.get(f"vs_{baseline}")
    return f"{cmp['diff']:+.3f} [{cmp['diff_ci95'][0]:+.3f}, {cmp['diff_ci95'][1]:+.3f}]" if cmp else "-"


def markdown_tables(summary: dict[str, dict], runs: dict[str, dict], config: ControlConfig) -> str:
    """The arms x metrics table, then each arm's paired differences from the two CE baselines (`runs`: each arm's
    first replicate's run, with the mean training time over its replicates)."""
    lines = [f"| arm | objective | answers | train min | accept_t1 (D={config.depth}) | forced_t1 | "
             f"tau_t0 ({config.tree}) | tau_t1 ({config.tree}) | a_1..a_{config.depth} at T=1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, rows in summary.items():
        run = runs.get(arm, {})
        minutes = f"{run['train_seconds'] / 60:.1f}" if run else "-"
        rates = " ".join(f"{r:.2f}" for r in rows["step_rates_t1"])
        lines.append(f"| {arm} | {run.get('objective', '-')} | {run.get('data', '-')} | {minutes} | "
                     f"{_interval(rows['accept_t1'])} | {_interval(rows['forced_t1'])} | {_interval(rows['tau_t0'])} | "
                     f"{_interval(rows['tau_t1'])} | "
                     f"{rates} |")
    lines += ["", "| arm | " + " | ".join(f"{metric} - {baseline}" for metric in METRICS for baseline in BASELINES)
              + " |", "|---|" + "---|" * (len(METRICS) * len(BASELINES))]
    for arm, rows in summary.items():
        lines.append(f"| {arm} | " + " | ".join(_difference(rows[metric], baseline) for metric in METRICS
                                                 for baseline in BASELINES) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict], config: ControlConfig, path: Path, replicates: int = 1) -> None:
    """Each metric per arm with its 95% interval, one panel per metric (written by a rename)."""
    import matplotlib  # plotting only: the backend is set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    titles = {"accept_t1": f"expected accepted length, T=1 chain D={config.depth}",
              "forced_t1": f"teacher-forced product, T=1 chain D={config.depth}",
              "tau_t0": f"tau, T=0 tree {config.tree}", "tau_t1": f"tau, T=1 tree {config.tree}"}
    arms = list(summary)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 3.8))
    for ax, metric in zip(axes, METRICS):
        values = [summary[a][metric]["value"] for a in arms]
        lows = [v - summary[a][metric]["ci95"][0] for v, a in zip(values, arms)]
        highs = [summary[a][metric]["ci95"][1] - v for v, a in zip(values, arms)]
        ax.errorbar(range(len(arms)), values, yerr=[lows, highs], fmt="o", capsize=4)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        ax.set_title(titles[metric], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    over = f"{replicates} training seeds, then prompts" if replicates > 1 else "prompts"
    fig.suptitle(f"synthetic control: order-2 Markov language, narrow EAGLE-3 drafter (95% CI over {over})",
                 fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


# ----------------------------------------------------------------------------- the whole control


def run_replicate(config: ControlConfig, out: Path, arm_names: list[str] | None = None, log=print,
                  device: str = "cpu") -> dict:
    """One replicate in `out`: the target, data, and every arm's training (seed `config.arm_seed`) and evaluation,
    each reused when done. `device`: where the target (and so the drafters, training and decoding) runs once
    trained (the target's own training, the data and the initial drafter are made on the CPU, so they are the
    same on every device)."""
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in control_arms(config) if arm_names is None or a.name in arm_names]
    if arm_names is not None and len(arms) != len(arm_names):
        known = ", ".join(a.name for a in control_arms(config))
        raise SystemExit(f"vsd_control: unknown arm in {','.join(arm_names)} (known: {known})")
    language = make_language(config)
    target_folder = prepared_target(config, out, language, log)
    target = load_target(str(target_folder))
    data = training_data(config, language, out)
    init = narrow_drafter_folder(config, target, out)
    if device != "cpu":
        target = load_target(str(target_folder), device=device)
    runs = {arm.name: train_arm(config, arm, target, target_folder, init, data, out, log) for arm in arms}
    eval_set = make_eval_set(config, language, target, out)
    evaluations = {"init": evaluate_drafter(config, target, init, eval_set, out, "init")}
    for name, run in runs.items():
        evaluations[name] = evaluate_drafter(config, target, Path(run["folder"]), eval_set, out, name)
        log(f"evaluated {name} ({evaluations[name]['eval_seconds']:.0f} s)")
    return {"out": str(out), "arm_seed": config.arm_seed, "device": device, "runs": runs, "evaluations": evaluations,
            "target": json.loads((target_folder / "control_target.json").read_text()), "language": language}


def run_control(config: ControlConfig, out: Path, arm_names: list[str] | None = None,
                results: Path | None = RESULTS, log=print, device: str = "cpu",
                replicates: list[tuple[Path, int]] | None = None) -> dict:
    """Every replicate (`replicates`: (OUT, arm seed) pairs, default `out` at `config.arm_seed`) run or reused, then
    the summary over them; returns the result."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    done = [run_replicate(dataclasses.replace(config, arm_seed=seed), Path(folder), arm_names, log, device)
            for folder, seed in (replicates or [(out, config.arm_seed)])]
    evaluations = {arm: [r["evaluations"][arm] for r in done] for arm in done[0]["evaluations"]}
    summary = summarise(evaluations, config.bootstrap, config.bootstrap_seed)
    runs = {arm: {**run, "train_seconds": float(np.mean([r["runs"][arm]["train_seconds"] for r in done]))}
            for arm, run in done[0]["runs"].items()}
    language = done[0]["language"]
    result = {
        "config": dataclasses.asdict(config),
        "target": done[0]["target"],
        "language": {"kind_counts": torch.bincount(language.kinds.flatten(), minlength=4).tolist(),
                     "mean_context_entropy": language.entropy()},
        "metrics": {"accept_t1": chain_acceptance.__doc__, "forced_t1": "the teacher-forced product (biased)",
                    "tau_t0": "tree decoding at T = 0, lossless-checked",
                    "tau_t1": "tree decoding at T = 1, one seed per prompt"},
        "replicates": [{"out": r["out"], "arm_seed": r["arm_seed"], "runs": r["runs"]} for r in done],
        "summary": summary,
        "per_prompt": evaluations,  # {arm: [one record per replicate]}
        "seconds_this_call": time.perf_counter() - start,  # what this call did (cached stages take none)
    }
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        tmp = results.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.rename(results)
        plot(summary, config, results.with_suffix(".png"), len(done))
    result["table"] = markdown_tables(summary, runs, config)
    return result


def parse_replicate(spec: str) -> tuple[Path, int]:
    folder, sep, seed = spec.rpartition(":")
    if not sep or not folder or not seed.isdigit():
        raise SystemExit(f"vsd_control: --replicate {spec!r}: use OUT:SEED (a working folder and an arm seed)")
    return Path(folder), int(seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings of ControlConfig")
    parser.add_argument("--out", default="/tmp/vsd_control", help="working folder (target, data, runs, evaluations)")
    parser.add_argument("--arms", default="", help="comma list of arms to run (default: all)")
    parser.add_argument("--results", default=str(RESULTS), help="where the result JSON goes")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where arms train and are "
                        "evaluated")
    parser.add_argument("--replicate", action="append", default=[], type=parse_replicate, metavar="OUT:SEED",
                        help="a replicate (working folder and arm seed; repeat: the summary pools them); default "
                        "--out at the config's arm_seed")
    args = parser.parse_args(argv)
    config = parse_overrides(ControlConfig(), args.overrides)
    arm_names = [a for a in args.arms.split(",") if a] or None
    result = run_control(config, Path(args.out), arm_names, Path(args.results), device=args.device,
                         replicates=args.replicate or None)
    target = result["target"]
    print(f"target: KL to the chain {target['kl_to_chain']:.4f} nats/token, trained in "
          f"{target['train_seconds'] / 60:.1f} min; this call {result['seconds_this_call'] / 60:.1f} min\n")
    print(result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
