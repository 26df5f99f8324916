"""The `mmvsd` command line. User errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys

from mmvsd.errors import UserError
from mmvsd.eval.bench_cli import add_bench_parser, run_bench_command
from mmvsd.layouts import add_export_parser, run_export


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
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image shown before the prompt text (repeat for several)")
    p.add_argument("--adapter", help="modality adapter by name (default: the first registered one that fits)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a drafter (objectives ce, vsd, vsd-kl, ce+vsd)",
                       description="Train a drafter. Settings: defaults < --config YAML < flags < key=value.")
    p.add_argument("--target", help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", help="drafter architecture (default eagle3)")
    p.add_argument("--init", help="none (default) | a drafter folder | a released layout (eagle3) | LAYOUT:PATH")
    p.add_argument("--objective", help="ce (default) | vsd | vsd-kl | ce+vsd")
    p.add_argument("--data", help="sharegpt (default), sharegpt:PATH, llava-instruct:PATH or a JSON/JSONL file")
    p.add_argument("--output", help="output folder: becomes a drafter folder for `mmvsd generate --drafter`")
    p.add_argument("--config", help="YAML file of TrainConfig settings (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. max_steps=100 loss.num_samples=8")


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="write the offline target-feature cache a training run reads",
                       description="Capture target features of the training examples into DIR "
                                   "(resumable); train with features=offline feature_cache=DIR.")
    p.add_argument("--target", help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--data", help="same as `mmvsd train --data`")
    p.add_argument("--output", required=True, help="cache folder")
    p.add_argument("--config", help="YAML file of TrainConfig settings (data keys are used)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="storage type of the features (auto: the target's)")
    p.add_argument("--yes", action="store_true", help="do not ask before writing")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def _add_adapters(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapters", help="modality adapters")
    p.add_argument("action", choices=["list"], help="list: show registered adapters and where they come from")


def _add_lab(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lab", help="build the embedded CPU targets (smol-llava)")
    lab = p.add_subparsers(dest="lab_command", required=True)
    b = lab.add_parser("build-target", help="train smol-llava's projector on the CPU and install it in the mmvsd cache",
                       description="Assemble smol-llava (EfficientNet-Lite0 + SmolLM2-135M) and train its projector "
                                   "within the time budget; --target smol-llava then uses it.")
    b.add_argument("name", choices=["smol-llava"])
    b.add_argument("--minutes", type=float, default=28.0, help="time budget of the whole build (default 28)")
    b.add_argument("--max-steps", type=int, default=0, help="stop after N steps instead of at the time budget")
    b.add_argument("--num-images", type=_positive_int, default=2400, help="generated training images (default 2400)")
    b.add_argument("--align-steps", type=int, default=800, help="steps of the first stage (per-patch word targets)")
    b.add_argument("--lora-rank", type=int, default=8,
                   help="rank of the language model's low-rank adapters trained in the second stage (0: projector only)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--output", help="projector folder (default: the mmvsd cache, which --target smol-llava uses)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvsd", description="Multimodal speculative decoding toolkit.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_train(sub)
    _add_prepare(sub)
    _add_lab(sub)
    _add_adapters(sub)
    add_export_parser(sub)
    add_bench_parser(sub)
    return parser


def run_generate(args: argparse.Namespace) -> None:
    """`mmvsd generate`: load target and drafter, decode in batches, print and save the results."""
    import torch

    from mmvsd.decode import DecodeConfig, speculative_generate, vanilla_generate
    from mmvsd.drafter import drafter_from_spec
    from mmvsd.prompts import read_prompt_file
    from mmvsd.targets import load_target
    from mmvsd.tree import TreeShape

    texts = read_prompt_file(args.prompt_file) if args.prompt_file else [args.prompt]
    if any(not t.strip() for t in texts):
        raise UserError("empty prompt")
    missing = [path for path in args.image if not os.path.isfile(path)]
    if missing:
        raise UserError(f"image file not found: {missing[0]}")
    config = DecodeConfig(args.max_new_tokens, args.temperature,
                          TreeShape(args.tree_budget, args.tree_depth, args.tree_topk), args.seed)
    target = load_target(args.target)
    drafter = drafter_from_spec(args.drafter, target, args.seed)
    torch.manual_seed(args.seed)
    prompts = _encode_prompts(target, texts, args)
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


def _encode_prompts(target, texts: list[str], args: argparse.Namespace) -> list:
    """Prompts through the chosen modality adapter (plain chat-template ids when there is no media)."""
    from pathlib import Path

    from mmvsd.adapter import choose_adapter

    if not args.image and not args.adapter:
        return [target.encode_prompt(t) for t in texts]
    adapter = choose_adapter(target, args.adapter or "", "image" if args.image else "")
    return [adapter.encode(target, text, [Path(p) for p in args.image]) for text in texts]


def run_adapters(args: argparse.Namespace) -> None:
    """`mmvsd adapters list`."""
    from mmvsd.adapter import registered_adapters

    for name, source in registered_adapters().items():
        print(f"{name:<16} {source}")


def _print_record(number: int, record: dict) -> None:
    print(f"=== prompt {number}: {record['prompt'][:70]!r}")
    print(record["text"])
    print(f"--- new tokens {record['new_tokens']} | target forwards {record['target_forwards']} | "
          f"tau {record['tau']:.2f} | {record['wall_seconds']:.2f} s | {record['tokens_per_second']:.1f} tok/s",
          flush=True)


def run_train(args: argparse.Namespace) -> None:
    """`mmvsd train`: resolve the config, train, and say where the drafter is."""
    from mmvsd.train_config import load_train_config
    from mmvsd.trainer import train

    flags = {k: getattr(args, k) for k in ("target", "drafter", "init", "objective", "data", "output")}
    config = load_train_config(args.config, flags, args.overrides)
    out_dir = train(config, resume=args.resume)
    print(f"drafter written to {out_dir}; try: mmvsd generate --target {config.target} --drafter {out_dir} "
          f"--prompt \"...\"")


def run_prepare(args: argparse.Namespace) -> None:
    """`mmvsd prepare`: write the offline feature cache of a run's training examples."""
    from mmvsd.prepare import prepare_feature_cache
    from mmvsd.train_config import load_train_config

    flags = {"target": args.target, "data": args.data, "output": args.output, "features": "offline",
             "feature_cache": args.output}
    config = load_train_config(args.config, flags, args.overrides)
    prepare_feature_cache(config, dtype=args.dtype, assume_yes=args.yes)


def run_lab(args: argparse.Namespace) -> None:
    """`mmvsd lab build-target smol-llava`: train the projector and say where it went."""
    from pathlib import Path

    from mmvsd.lab.projector_training import ProjectorTraining, build_projector
    from mmvsd.lab.smol_llava import built_projector_dir

    if args.minutes <= 0 or args.max_steps < 0 or args.align_steps < 0 or args.lora_rank < 0:
        raise UserError("--minutes must be > 0, --max-steps, --align-steps and --lora-rank >= 0")
    settings = ProjectorTraining(minutes=args.minutes, max_steps=args.max_steps, num_images=args.num_images,
                                 align_steps=args.align_steps, lora_rank=args.lora_rank, seed=args.seed)
    output = Path(args.output) if args.output else built_projector_dir()
    build_projector(settings, output)
    print(f"smol-llava projector written to {output}"
          + ("; --target smol-llava now uses it" if not args.output else ""))


COMMANDS = {"generate": run_generate, "train": run_train, "prepare": run_prepare, "lab": run_lab,
            "adapters": run_adapters, "export": run_export, "bench": run_bench_command}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if len(overrides) != len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]  # key=value after later flags
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
