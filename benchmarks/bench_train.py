"""Training step cost on a real target: `ce` vs `vsd` at several S (and L), plus feature capture speed.

Every objective runs on the same batches, interleaved round by round after a warm-up round; a
step is objective forward + backward + AdamW update (target features captured outside the timer,
as they are the same for all). Reports medians and ratios to `ce`, and writes JSON + the config.

    python benchmarks/bench_train.py --target smollm2-135m --rounds 5 --max-length 512
    python benchmarks/bench_train.py --target qwen2.5-coder-1.5b --target-dtype bf16 --precision bf16 \
        --variants ce --ttt-steps 6 --batch-size 4 --draft-vocab-size 32000 --rounds 2

`--target-dtype bf16` loads the target as `mmvsd train` does with `target_dtype=bf16` (`--target-engine`: decoding's
exact kernels or torch's kernels), `--precision bf16` runs the step under bf16 autocast with fp32 master weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.training.config import TrainConfig
from mmvsd.training.dataset import draft_vocab_from_counts, load_examples, token_frequencies
from mmvsd.training.features import capture_features, collate
from mmvsd.training.objectives import ObjectiveConfig
from mmvsd.training.terms import make_objective
from mmvsd.training.trainer import fp32_master_weights, load_training_target


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", default="sharegpt")
    p.add_argument("--num-conversations", type=int, default=200)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--anchors", type=int, default=8)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--target-dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--target-engine", default=TrainConfig.target_engine, choices=("exact", "stock"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--ttt-steps", type=int, default=ObjectiveConfig.ttt_steps)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--variants", default="ce,vsd:S=8,vsd:S=40,vsd:S=8:L=4,vsd:S=8:A=4,vsd-kl:S=8")
    p.add_argument("--out", default="benchmarks/results/bench_train.json")
    return p.parse_args()


def variant_config(spec: str, anchors: int, ttt_steps: int = ObjectiveConfig.ttt_steps) -> tuple[str, ObjectiveConfig]:
    """'vsd:S=8:L=4:A=8:T=3' -> ("vsd", ObjectiveConfig(num_samples=8, path_length=4, num_anchors=8, ttt_steps=3))."""
    name, *settings = spec.split(":")
    keys = {"S": "num_samples", "L": "path_length", "A": "num_anchors", "T": "ttt_steps"}
    values = {"num_anchors": anchors, "ttt_steps": ttt_steps}
    for item in settings:
        key, _, value = item.partition("=")
        values[keys[key]] = int(value)
    return name, ObjectiveConfig(**values)


def timed_step(objective, drafter, optimizer, target, batch, seed: int, bf16: bool = False) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = objective(drafter, target, batch, torch.Generator().manual_seed(seed))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = load_training_target(TrainConfig(target=args.target, target_dtype=args.target_dtype,
                                              target_engine=args.target_engine), "cpu")
    split = load_examples(target, args.data, num_conversations=args.num_conversations, max_length=args.max_length,
                          validation_fraction=0.0, seed=0, progress=False)
    examples = sorted(split.train, key=lambda ex: -len(ex.input_ids))  # the longest: full-length batches
    vocab = args.draft_vocab_size
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=vocab)
    drafter.set_draft_vocab(draft_vocab_from_counts(token_frequencies(split.train, target.vocab_size), vocab))
    drafter = fp32_master_weights(drafter)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    variants = [(spec, *variant_config(spec, args.anchors, args.ttt_steps)) for spec in args.variants.split(",")]
    objectives = {spec: make_objective(name, cfg) for spec, name, cfg in variants}
    times: dict[str, list[float]] = {spec: [] for spec in objectives}
    capture: list[float] = []
    capture_seconds: list[float] = []
    tokens_per_step: list[int] = []
    for round_index in range(args.rounds + 1):  # round 0 is the warm-up
        rows = examples[round_index * args.batch_size : (round_index + 1) * args.batch_size]
        tokens = collate(rows)
        start = time.perf_counter()
        batch = capture_features(target, tokens, keep_cache=True)
        elapsed = time.perf_counter() - start
        for spec, objective in objectives.items():
            seconds = timed_step(objective, drafter, optimizer, target, batch, round_index, args.precision == "bf16")
            if round_index:
                times[spec].append(seconds)
        if round_index:
            capture.append(int(tokens.lengths.sum()) / elapsed)
            capture_seconds.append(elapsed)
            tokens_per_step.append(int(tokens.lengths.sum()))
        print(f"round {round_index}: {int(tokens.lengths.sum())} tokens", flush=True)
    base = statistics.median(times["ce"]) if "ce" in times else None
    report = {"target": args.target, "args": vars(args), "engine": target.engine, "threads": torch.get_num_threads(),
              "feature_capture_tokens_per_s": statistics.median(capture),
              "step_seconds": {k: statistics.median(v) for k, v in times.items()}}
    report["tokens_per_core_hour"] = core_hour_rates(report, statistics.median(capture_seconds),
                                                     statistics.median(tokens_per_step))
    print(f"feature capture: {report['feature_capture_tokens_per_s']:.0f} tokens/s (median), "
          f"{report['threads']} thread(s)")
    for spec, seconds in report["step_seconds"].items():
        ratio = f"{seconds / base:.2f}x ce" if base else ""
        rates = report["tokens_per_core_hour"][spec]
        print(f"{spec:>16}: {seconds:.3f} s/step  {ratio}  tokens per core-hour: "
              f"{rates['online']:.0f} online, {rates['cached']:.0f} cached features")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(args.out).with_suffix(".png"))


def core_hour_rates(report: dict, capture_seconds: float, tokens: int) -> dict[str, dict[str, float]]:
    """Training tokens per core-hour of each variant: with features captured in the step (online) or read from a
    cache (the drafter step alone; reading a cache costs next to nothing beside it). A core-hour is one of the
    process's threads for an hour, so two one-thread processes and one two-thread process compare."""
    core_hours = report["threads"] / 3600
    return {spec: {"online": tokens / ((step + capture_seconds) * core_hours), "cached": tokens / (step * core_hours)}
            for spec, step in report["step_seconds"].items()}


def plot(report: dict, path: Path) -> None:
    """Bar chart of the median step time of each objective variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, seconds = zip(*report["step_seconds"].items())
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, seconds, color="tab:blue")
    ax.set_ylabel("seconds per training step (median)")
    ax.set_title(f"{report['target']}: batch {report['args']['batch_size']} x {report['args']['max_length']} tokens")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
