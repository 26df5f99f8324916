"""The `mmvsd bench` command line: flags -> `BenchConfig` -> `run_bench`, then the table."""

from __future__ import annotations

import argparse

from mmvsd.eval.bench_config import METHODS, BenchConfig
from mmvsd.placement import add_placement_arguments
from mmvsd.tree_options import add_tree_arguments, tree_spec


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


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd bench` (entry point `mmvsd.commands`)."""
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
                        "the target's default as in `mmvsd generate`, else random, an untrained EAGLE-3 drafter)")
    p.add_argument("--methods", type=_list, default=defaults.methods, help=f"subset of {','.join(METHODS)}")
    p.add_argument("--temperature", type=_temperatures, default=defaults.temperatures, help="e.g. 0,1")
    p.add_argument("--limit", type=int, default=defaults.limit, help="items per benchmark (0: all)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    add_tree_arguments(p, default="auto", many=True)
    p.add_argument("--assistant", default="", help="draft model with the target's tokenizer, for --methods assisted")
    p.add_argument("--engine", default=defaults.engine,
                   help="where the methods decode, by name: mmvsd (its own loop), llama.cpp (llama-server "
                        "subprocesses on the target's GGUF file; methods vanilla, pld = its n-gram lookup, assisted, "
                        "tree = a chain drafted by each --drafter; needs mmvsd[llamacpp]), or a plugin's engine")
    p.add_argument("--chain", default=defaults.chain,
                   help="--engine llama.cpp: the drafted chain, N/PMIN (up to N tokens, stopping below draft "
                        "probability PMIN), llama for llama.cpp's defaults, or auto: planned per drafter from "
                        "llama.cpp's measured step costs and the drafter's chains on held-out prompts")
    p.add_argument("--adapter", default="", help="modality adapter for image prompts (default: the first that fits)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--out", default=defaults.out, help="results folder")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--no-progress", action="store_true")
    add_placement_arguments(p)
    p.set_defaults(handler=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> None:
    parts = (args.tree_budget, args.tree_depth, args.tree_topk)
    trees = [tree_spec(spec, *parts, default=args.tree_default) for spec in args.tree or [None]]
    config = BenchConfig(suite=args.suite, target=args.target, drafters=args.drafter, methods=args.methods,
                         temperatures=args.temperature, limit=args.limit, batch_size=args.batch_size,
                         max_new_tokens=args.max_new_tokens, trees=trees, assistant=args.assistant,
                         adapter=args.adapter, seed=args.seed, out=args.out, device=args.device, dtype=args.dtype,
                         engine=args.engine, chain=args.chain)
    from mmvsd.eval.bench import run_bench  # CLI start-up: torch and the decoders only when a bench runs

    out = run_bench(config, resume=args.resume, progress=not args.no_progress)
    print((out / "table.md").read_text())
    print(f"results in {out} (table.md, results.json, results.csv, records.jsonl, *.png)")
