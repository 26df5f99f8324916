"""The `mmvsd bench` command line: flags -> `BenchConfig` -> `run_bench`, then the table."""

from __future__ import annotations

import argparse

from mmvsd.errors import UserError
from mmvsd.eval.bench_config import METHODS, BenchConfig, fixed_tree_spec
from mmvsd.placement import add_placement_arguments


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(part) for part in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {text!r}")
    return values


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    defaults = BenchConfig()
    p = sub.add_parser("bench", help="speed-up, tau and lossless check of drafters on benchmark suites",
                       description="Runs every method on the same prompts, interleaved per prompt, after a "
                                   "warm-up; writes table.md, results.json/.csv, records.jsonl and PNG plots.")
    p.add_argument("--suite", default=defaults.suite,
                   help="text, mllm, or benchmark names (mt_bench, humaneval, gsm8k, lmms-eval task names)")
    p.add_argument("--target", default=defaults.target,
                   help="target (default: smol-llava for suites with images, else smollm2-135m)")
    p.add_argument("--drafter", type=_list, default=defaults.drafters,
                   help="drafter folder(s) or shipped drafter names, comma-separated, compared side by side (default: "
                        "the target's shipped drafter, else random, an untrained EAGLE-3 drafter)")
    p.add_argument("--methods", type=_list, default=defaults.methods, help=f"subset of {','.join(METHODS)}")
    p.add_argument("--temperature", type=_temperatures, default=defaults.temperatures, help="e.g. 0,1")
    p.add_argument("--limit", type=int, default=defaults.limit, help="items per benchmark (0: all)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--tree", type=_list, default=None,
                   help="draft tree shape(s), comma-separated, one tree row per drafter and shape: auto (default: "
                        "planned per step from this machine's measured costs and the acceptance seen), paper (60/7/10 "
                        "on text, 60/5/8 on image benchmarks) or BUDGET/DEPTH/TOPK")
    p.add_argument("--tree-budget", type=int, default=None,
                   help="fixed shape instead of --tree: draft tree nodes (default: 60, the paper's for text and image "
                        "targets)")
    p.add_argument("--tree-depth", type=int, default=None,
                   help="draft tree depth (default: 7 on text benchmarks, 5 on image benchmarks, as the paper)")
    p.add_argument("--tree-topk", type=int, default=None,
                   help="children per node (default: 10 on text benchmarks, 8 on image benchmarks)")
    p.add_argument("--assistant", default="", help="draft model with the target's tokenizer, for --methods assisted")
    p.add_argument("--adapter", default="", help="modality adapter for image prompts (default: the first that fits)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out", default=defaults.out, help="results folder")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--no-progress", action="store_true")
    add_placement_arguments(p)


def run_bench_command(args: argparse.Namespace) -> None:
    tree = (args.tree_budget, args.tree_depth, args.tree_topk)
    if any(value is not None and value < 1 for value in tree):
        raise UserError("--tree-budget, --tree-depth and --tree-topk must be >= 1")
    fixed = fixed_tree_spec(*tree)
    if args.tree is not None and fixed is not None:
        raise UserError("--tree and --tree-budget/--tree-depth/--tree-topk are two ways to say one thing: give one")
    trees = [fixed] if fixed is not None else (args.tree or BenchConfig().trees)
    config = BenchConfig(suite=args.suite, target=args.target, drafters=args.drafter, methods=args.methods,
                         temperatures=args.temperature, limit=args.limit, batch_size=args.batch_size,
                         max_new_tokens=args.max_new_tokens, trees=trees, assistant=args.assistant,
                         adapter=args.adapter, seed=args.seed, out=args.out, device=args.device, dtype=args.dtype)
    from mmvsd.eval.bench import run_bench  # CLI start-up: torch and the decoders only when a bench runs

    out = run_bench(config, resume=args.resume, progress=not args.no_progress)
    print((out / "table.md").read_text())
    print(f"results in {out} (table.md, results.json, results.csv, records.jsonl, *.png)")
