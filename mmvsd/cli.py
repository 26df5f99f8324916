"""The `mmvsd` command line. User errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import json
import sys

from mmvsd.errors import UserError


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode prompts with tree speculative decoding (or vanilla)")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", required=True,
                   help="drafter folder, 'none' for vanilla decoding, or 'random' for an untrained EAGLE-3 drafter")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt (goes through the target's chat template)")
    source.add_argument("--prompt-file", help="JSONL file with a 'prompt' (or MT-Bench 'turns') field per line")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tree-budget", type=_positive_int, default=60, help="tree nodes per verification, root included")
    p.add_argument("--tree-depth", type=_positive_int, default=7)
    p.add_argument("--tree-topk", type=_positive_int, default=10)
    p.add_argument("--batch-size", type=_positive_int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write per-prompt results (with token ids) to this file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvsd", description="Multimodal speculative decoding toolkit.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    return parser


def run_generate(args: argparse.Namespace) -> None:
    """`mmvsd generate`: load target and drafter, decode in batches, print and save the results."""
    import torch

    from mmvsd.decode import DecodeConfig, speculative_generate, vanilla_generate
    from mmvsd.drafter import load_drafter
    from mmvsd.prompts import read_prompt_file
    from mmvsd.targets import load_target
    from mmvsd.tree import TreeShape

    texts = read_prompt_file(args.prompt_file) if args.prompt_file else [args.prompt]
    if any(not t.strip() for t in texts):
        raise UserError("empty prompt")
    config = DecodeConfig(args.max_new_tokens, args.temperature,
                          TreeShape(args.tree_budget, args.tree_depth, args.tree_topk), args.seed)
    target = load_target(args.target)
    drafter = None
    if args.drafter == "random":
        from mmvsd.drafters.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter.from_target(target, seed=args.seed).eval()
    elif args.drafter != "none":
        drafter = load_drafter(args.drafter, target)
    torch.manual_seed(args.seed)
    prompts = [target.encode_prompt(t) for t in texts]
    records = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        if drafter is None:
            results = vanilla_generate(target, chunk, config)
        else:
            results = speculative_generate(target, drafter, chunk, config)
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
            }
            records.append(record)
            _print_record(len(records), record)
    if args.json:
        from mmvsd.files import atomic_file

        with atomic_file(args.json) as handle:
            json.dump({"target": args.target, "drafter": args.drafter, "results": records}, handle, indent=2)


def _print_record(number: int, record: dict) -> None:
    print(f"=== prompt {number}: {record['prompt'][:70]!r}")
    print(record["text"])
    print(f"--- new tokens {record['new_tokens']} | target forwards {record['target_forwards']} | "
          f"tau {record['tau']:.2f} | {record['wall_seconds']:.2f} s | {record['tokens_per_second']:.1f} tok/s",
          flush=True)


COMMANDS = {"generate": run_generate}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except UserError as err:
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmvsd: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
