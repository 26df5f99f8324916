"""`mmvsd generate`: decode prompts with tree speculative decoding (or vanilla) and print or save the results."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from mmvsd.errors import UserError
from mmvsd.files import atomic_file
from mmvsd.placement import add_placement_arguments, half_precision_warning, positive_int
from mmvsd.prompts import read_prompt_file
from mmvsd.tree_options import add_ngram_argument, add_tree_arguments, tree_for_prompts, tree_spec_from_args


def add_generate_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd generate` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("generate", help="decode prompts with tree speculative decoding (or vanilla)")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter",
                   help="drafter folder, model:MODEL (a draft model with the target's tokenizer: a built-in name, a "
                        "folder or a .gguf file), 'default' or a name from `mmvsd drafters list` (a shipped drafter; "
                        "default: "
                        "'default' when the target has one), 'none' for vanilla decoding, 'random' for an untrained "
                        "EAGLE-3 drafter, or 'ngram' (options: ngram:max_n=4,min_n=1,num_continuations=4,max_len=8) "
                        "for prompt lookup")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt (goes through the target's chat template)")
    source.add_argument("--prompt-file", help="JSONL file with a 'prompt' (or MT-Bench 'turns') field per line")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    add_tree_arguments(p, default="auto")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write per-prompt results (with token ids) to this file")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image shown before the prompt text (repeat for several)")
    p.add_argument("--adapter", help="modality adapter by name (default: the first registered one that fits)")
    add_ngram_argument(p, "n-gram (prompt-lookup) branches in a neural drafter's trees (default on; 'off' disables)")
    add_placement_arguments(p)
    p.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> None:
    """`mmvsd generate`: load target and drafter, decode in batches, print and save the results."""
    import torch  # CLI start-up: loaded per command

    from mmvsd.adapters import check_adapter  # CLI start-up: loaded per command
    from mmvsd.decoding.decode import (  # CLI start-up: loaded per command
        DecodeConfig,
        speculative_generate,
        vanilla_generate,
    )
    from mmvsd.decoding.engines import DEFAULT_ENGINE, get_engine  # CLI start-up: loaded per command
    from mmvsd.decoding.shape_policy import AcceptanceStats  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import check_drafter_spec, drafter_from_spec  # CLI start-up: loaded per command
    from mmvsd.shipped import implicit_drafter_spec  # CLI start-up: loaded per command

    texts = read_prompt_file(args.prompt_file) if args.prompt_file else [args.prompt]
    if any(not t.strip() for t in texts):
        raise UserError("empty prompt")
    missing = [path for path in args.image if not os.path.isfile(path)]
    if missing:
        raise UserError(f"image file not found: {missing[0]}")
    config = DecodeConfig(args.max_new_tokens, args.temperature, seed=args.seed)  # checked before anything loads
    tree = tree_spec_from_args(args)  # likewise; resolved for the prompts' kind once they are encoded
    args.drafter = args.drafter or implicit_drafter_spec(args.target)
    check_drafter_spec(args.drafter, args.target, args.ngram)
    check_adapter(args.adapter or "")
    target = get_engine(DEFAULT_ENGINE).load_target(args.target, args.dtype, args.device)
    drafter = drafter_from_spec(args.drafter, target, args.seed, ngram=args.ngram)
    warning = half_precision_warning(target) if drafter is not None else None
    if warning:
        print(warning, file=sys.stderr)
    torch.manual_seed(args.seed)
    prompts = _encode_prompts(target, texts, args)
    config = dataclasses.replace(config, tree=tree_for_prompts(tree, prompts))
    records = []
    stats = AcceptanceStats()  # what `--tree auto` learns of the drafter carries over from prompt to prompt
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        if drafter is None:
            results = vanilla_generate(target, chunk, config)
        else:
            results = speculative_generate(target, drafter, chunk, config, stats=stats)
        for offset, result in enumerate(results):
            record = {
                "prompt": texts[start + offset],
                "text": target.decode(result.output_ids),
                "output_ids": result.output_ids,
                "new_tokens": len(result.output_ids),
                "target_forwards": result.num_target_forwards,
                "tau": round(result.tau, 4),
                "wall_seconds": round(result.wall_seconds, 4),
                "tokens_per_second": round(result.tokens_per_second, 2),
                "tree_sizes": size_histogram(result.tree_sizes),
            }
            records.append(record)
            _print_record(len(records), record)
    if args.json:
        with atomic_file(args.json) as handle:
            json.dump({"target": args.target, "drafter": args.drafter, "results": records}, handle, indent=2)


def size_histogram(tree_sizes: list[int]) -> dict[str, int]:
    """{nodes verified per step: number of steps} (1 = a plain step), for the results JSON."""
    counts: dict[str, int] = {}
    for size in sorted(tree_sizes):
        counts[str(size)] = counts.get(str(size), 0) + 1
    return counts


def _encode_prompts(target, texts: list[str], args: argparse.Namespace) -> list:
    """Prompts through the chosen modality adapter (plain chat-template ids when there is no media)."""
    from mmvsd.adapters import choose_adapter  # CLI start-up: loaded per command

    if not args.image and not args.adapter:
        return [target.encode_prompt(t) for t in texts]
    adapter = choose_adapter(target, args.adapter or "", "image" if args.image else "")
    return [adapter.encode(target, text, [Path(p) for p in args.image]) for text in texts]


def _print_record(number: int, record: dict) -> None:
    print(f"=== prompt {number}: {record['prompt'][:70]!r}")
    print(record["text"])
    print(f"--- new tokens {record['new_tokens']} | target forwards {record['target_forwards']} | "
          f"tau {record['tau']:.2f} | {record['wall_seconds']:.2f} s | {record['tokens_per_second']:.1f} tok/s",
          flush=True)
