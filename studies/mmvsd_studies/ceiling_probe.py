"""The drafter issue's ceiling probes, pre-registered in docs/training.md ("Where the ceiling is"): two arms trained
side by side at equal CPU time on the same data, both replayed on the same held-out prompts, compared once.

    python -m mmvsd_studies.heldout_prompts --chat 20 --math 20 --code 20 --out h60.jsonl
    python -m mmvsd_studies.ceiling_probe --probe layers --data ~/regen/smollm2 --heldout h60.jsonl \
        --work ~/probes --out studies/results/ceiling_probe_layers.json

Each arm is `mmvsd train` with the shared settings plus the arm's own (`PROBES`), one thread each, `--minutes` of
wall clock each (both at once, so equal CPU time); then `mmvsd eval-drafter --tree 4/3/1 --ngram off
--max-new-tokens 128 --dtype fp32 --json` on the held-out prompts (both at once, one thread each). The comparison
is `scale_pilot`'s (first token, depth-3 chain, arm minus baseline with a paired bootstrap 95% interval over
prompts; a tie goes to the baseline, the cheaper arm), pooled and per domain. A rerun skips the arms whose drafter
and report are written, so an interrupted probe resumes with what is left (an arm cut short trains afresh).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

from mmvsd.prompts import prompt_domains
from mmvsd_studies.scale_pilot import format_pilot, pilot_by_domain

# probe -> (what it asks, the cheaper arm (the baseline) and the other, each NAME: its settings)
PROBES: dict[str, tuple[str, dict[str, list[str]]]] = {
    "layers": ("decoder layers, 1 against 2", {"layers-1": ["draft_layers=1"], "layers-2": ["draft_layers=2"]}),
    "init": ("initialisation, random against the target's last decoder layer",
             {"init-random": ["init_layers_from_target=false"], "init-target": ["init_layers_from_target=true"]}),
    "ttt": ("TTT depth, 3 against 7", {"ttt-3": ["loss.ttt_steps=3"], "ttt-7": ["loss.ttt_steps=7"]}),
    "vocab": ("draft vocabulary, 8,192 against 32,768 words",
              {"vocab-8k": ["draft_vocab_size=8192"], "vocab-32k": ["draft_vocab_size=32768"]}),
}
# The minutes bind, not the data: shuffled epochs over the folder's conversations and a schedule over 2,000 steps,
# of which an arm reaches 150-300 (the rate stays within 5% of its peak). Probe (a) ran with data_order=shards,
# which stops where the finished shards end: both arms stopped after one pass, at 112 steps (docs/training.md).
SHARED = ["objective=ce", "data_order=shuffle", "max_steps=2000", "max_length=512", "batch_size=4",
          "learning_rate=3e-4", "warmup_steps=10", "precision=fp32", "target_dtype=fp32", "validation_fraction=0",
          "save_every=100000", "progress=false"]
EVAL = ["--tree", "4/3/1", "--ngram", "off", "--max-new-tokens", "128", "--dtype", "fp32"]
DONE = "probe_arm.json"  # written in an arm's folder once its drafter is trained and replayed


def train_command(target: str, config: str, data: str, out: Path, settings: list[str], minutes: float) -> list[str]:
    return ["mmvsd", "train", "--config", config, "--target", target, "--data", data, "--output", str(out),
            *SHARED, *settings, f"max_minutes={minutes:g}"]


def eval_command(target: str, drafter: Path, heldout: str, report: Path) -> list[str]:
    return ["mmvsd", "eval-drafter", "--target", target, "--drafter", str(drafter), "--prompt-file", heldout, *EVAL,
            "--json", str(report)]


def run_side_by_side(commands: dict[str, list[str]], logs: Path) -> None:
    """Start every command at once, one thread each, and wait for all; any failure stops the probe."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running = {}
    if not commands:
        return
    for name, command in commands.items():
        log = open(logs / f"{name}.log", "a", encoding="utf-8")  # noqa: SIM115  (closed below)
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    failed = []
    for name, (process, log) in running.items():
        if process.wait() != 0:
            failed.append(name)
        log.close()
    if failed:
        sys.exit(f"ceiling_probe: {', '.join(failed)} failed; see {logs}/<arm>.log")


def trained_steps(out: Path) -> dict:
    """What an arm's training did: its last logged step and first-step accuracy (train_log.jsonl)."""
    lines = (out / "train_log.jsonl").read_text().splitlines() if (out / "train_log.jsonl").is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    return {key: last[key] for key in ("step", "tokens_seen", "acc_0", "acc_0_all", "loss") if key in last}


def run_probe(args: argparse.Namespace) -> dict:
    question, arms = PROBES[args.probe]
    work = Path(args.work).expanduser() / args.probe
    work.mkdir(parents=True, exist_ok=True)
    pending = [name for name in arms if not (work / name / DONE).is_file()]
    for name in pending:
        shutil.rmtree(work / name, ignore_errors=True)  # an arm cut short trains afresh: equal time for both
    if pending:
        print(f"ceiling_probe {args.probe}: training {', '.join(pending)} side by side, {args.minutes:g} minutes each",
              flush=True)
    run_side_by_side({name: train_command(args.target, args.config, args.data, work / name, arms[name], args.minutes)
                      for name in pending}, work)
    run_side_by_side({name: eval_command(args.target, work / name, args.heldout, work / name / "heldout.json")
                      for name in pending}, work)
    for name in pending:
        (work / name / DONE).write_text(json.dumps({"settings": arms[name], **trained_steps(work / name)}) + "\n")
    reports = {name: json.loads((work / name / "heldout.json").read_text()) for name in arms}
    baseline = next(iter(arms))
    return {"probe": args.probe, "question": question, "baseline": baseline, "minutes_per_arm": args.minutes,
            "data": args.data, "heldout": args.heldout, "shared_settings": SHARED, "eval": EVAL,
            "arms": {name: {"settings": arms[name], **json.loads((work / name / DONE).read_text())} for name in arms},
            "comparison": pilot_by_domain(reports, baseline, prompt_domains(args.heldout))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", required=True, choices=sorted(PROBES))
    parser.add_argument("--data", required=True, help="a `mmvsd regenerate` folder (the shards restored)")
    parser.add_argument("--heldout", required=True, help="held-out prompts (mmvsd_studies.heldout_prompts)")
    parser.add_argument("--work", required=True, help="where the arms' runs go (one folder per probe)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--config", default=str(files("mmvsd.configs") / "smollm2_cpu.yaml"))
    parser.add_argument("--minutes", type=float, default=90.0, help="wall clock per arm (pre-registered: 90)")
    parser.add_argument("--out", help="the result as JSON")
    args = parser.parse_args(argv)
    for path, what in ((args.data, "--data"), (args.heldout, "--heldout"), (args.config, "--config")):
        if not Path(path).expanduser().exists():
            sys.exit(f"ceiling_probe: {what} {path} not found")
    result = run_probe(args)
    print("\n".join(f"{scope}:\n{format_pilot(scoped)}" for scope, scoped in result["comparison"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
