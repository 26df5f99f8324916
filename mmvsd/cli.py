"""The `mmvsd` command line. User errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from mmvsd.errors import UserError
from mmvsd.eval.bench_cli import add_bench_parser, run_bench_command
from mmvsd.eval.regenerate_cli import add_regenerate_parser, run_regenerate_command
from mmvsd.files import atomic_file
from mmvsd.layouts.export_cli import add_export_parser
from mmvsd.placement import (
    add_device_argument,
    add_placement_arguments,
    half_precision_warning,
    placement,
    positive_int,
)
from mmvsd.plugins import add_plugin_commands
from mmvsd.prompts import read_prompt_file
from mmvsd.training.terms import TERMS, objective_help
from mmvsd.tree_options import add_tree_arguments, tree_for_prompts, tree_spec_from_args


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"use on or off, not {text!r}")
    return text == "on"


def add_ngram_argument(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--ngram on|off`, read as True / False (None when not given: the drafter spec's default)."""
    p.add_argument("--ngram", type=_on_off, metavar="on|off", help=help_text)


def _add_generate(sub: argparse._SubParsersAction) -> None:
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


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help=f"train a drafter (objectives over the terms {', '.join(TERMS)})",
                       description="Train a drafter. Settings: defaults < --config YAML < flags < key=value.")
    p.add_argument("--target", help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", help="drafter architecture (default eagle3)")
    p.add_argument("--init", help="none (default) | a drafter folder | a released layout (eagle3) | LAYOUT:PATH")
    p.add_argument("--objective", help=objective_help())
    p.add_argument("--data", help="auto (default: ShareGPT; for an image drafter on an image target ShareGPT + "
                                  "LLaVA-Instruct), sharegpt, sharegpt:PATH, llava-instruct:PATH or a JSON/JSONL file; "
                                  "SPEC+SPEC mixes them")
    p.add_argument("--output", help="output folder: becomes a drafter folder for `mmvsd generate --drafter`")
    p.add_argument("--config", help="YAML file of TrainConfig settings (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (parameters, data, steps, memory per GPU, disk, the accelerate launch "
                        "command) without loading weights or writing anything")
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs the --dry-run plan's command uses (default 8)")
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
    add_device_argument(p)  # where the target runs; its precision is the config's target_dtype
    p.add_argument("overrides", nargs="*", metavar="key=value")


def _add_eval_drafter(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-drafter", help="exact T=0 acceptance (tau) of a drafter on prompts, without a decode loop",
                       description="Replays the target's greedy continuation of each prompt (generated once, cached) "
                                   "with one target forward; tau equals `mmvsd generate`'s at T=0 with the same tree.")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", help="as for generate (default: the target's shipped drafter)")
    p.add_argument("--prompt-file", required=True,
                   help="JSONL file ('prompt' or MT-Bench 'turns' per line), a built-in benchmark: mt_bench, "
                        "humaneval, gsm8k (first user turns), or an image task with its images, e.g. "
                        "vqav2_val_mini_long (an lmms-eval task or one of mmvsd's offline minis)")
    p.add_argument("--adapter", default="", help="modality adapter that feeds image tasks' images (default: the "
                                                 "first registered one that fits the target)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    add_tree_arguments(p, default="paper")
    add_ngram_argument(p, "n-gram branches in the trees, as for generate")
    p.add_argument("--batch-size", type=positive_int,
                   help="prompts replayed together (default 8; 1 with n-gram branches, whose statistics a batch's "
                        "rows share, so that tau is generate's at its default batch size 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="generate the greedy continuations again")
    p.add_argument("--json", help="write the report (per-prompt tau, acceptance by depth, ties) to this file")
    add_placement_arguments(p)


def _add_drafters(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drafters", help="drafters shipped with mmvsd")
    p.add_argument("action", choices=["list"], help="list: targets, names, defaults and measured tau")


def _add_adapters(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapters", help="modality adapters")
    p.add_argument("action", choices=["list"], help="list: show registered adapters and where they come from")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure (or show the cached) target and drafter costs on this machine",
                       description="Time a verify step against the number of tree tokens and the drafter against "
                                   "the frontier width; cached per machine, target, dtype and drafter.")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", default="none",
                   help="none (default), random, ngram, or a drafter folder (as `mmvsd generate --drafter`)")
    add_ngram_argument(p, "as in `mmvsd generate`: profile the neural drafter with (default) or without n-gram "
                          "branches")
    p.add_argument("--batch-size", type=positive_int, action="append", help="batch size to measure (repeatable)")
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--plot", metavar="OUT.png", help="write the cost curves to this PNG file")
    add_placement_arguments(p)


class VersionAction(argparse.Action):
    """`mmvsd --version`: mmvsd's version and torch/transformers/accelerate's in use, with one warning line
    on stderr when any of them differs from what CI tested (mmvsd/constraints.txt)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from mmvsd.versions import version_report  # CLI start-up: only --version reads the constraints

        report, warning = version_report()
        print(report)
        if warning:
            print(warning, file=sys.stderr)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvsd", description="Multimodal speculative decoding toolkit.")
    parser.add_argument("--version", action=VersionAction,
                        help="print the versions of mmvsd, torch, transformers and accelerate, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_train(sub)
    _add_prepare(sub)
    add_regenerate_parser(sub)
    _add_adapters(sub)
    _add_eval_drafter(sub)
    _add_drafters(sub)
    add_export_parser(sub)
    add_bench_parser(sub)
    _add_profile(sub)
    add_plugin_commands(sub)  # commands of other packages (entry points `mmvsd.commands`), e.g. the studies' `lab`
    return parser


def run_generate(args: argparse.Namespace) -> None:
    """`mmvsd generate`: load target and drafter, decode in batches, print and save the results."""
    import torch  # CLI start-up: loaded per command

    from mmvsd.decoding.decode import (  # CLI start-up: loaded per command
        DecodeConfig,
        speculative_generate,
        vanilla_generate,
    )
    from mmvsd.decoding.shape_policy import AcceptanceStats  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import check_ngram_options, drafter_from_spec  # CLI start-up: loaded per command
    from mmvsd.shipped import implicit_drafter_spec  # CLI start-up: loaded per command
    from mmvsd.target_loader import load_target  # CLI start-up: loaded per command

    texts = read_prompt_file(args.prompt_file) if args.prompt_file else [args.prompt]
    if any(not t.strip() for t in texts):
        raise UserError("empty prompt")
    missing = [path for path in args.image if not os.path.isfile(path)]
    if missing:
        raise UserError(f"image file not found: {missing[0]}")
    config = DecodeConfig(args.max_new_tokens, args.temperature, seed=args.seed)  # checked before anything loads
    tree = tree_spec_from_args(args)  # likewise; resolved for the prompts' kind once they are encoded
    args.drafter = args.drafter or implicit_drafter_spec(args.target)
    check_ngram_options(args.drafter, args.ngram)
    target = load_target(args.target, *placement(args.device, args.dtype))
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


def run_eval_drafter(args: argparse.Namespace) -> None:
    """`mmvsd eval-drafter`: greedy continuations (cached), then the replayed acceptance report."""
    from mmvsd.decoding.decode import make_shape  # CLI start-up: loaded per command
    from mmvsd.decoding.tree import TreeShape  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import drafter_from_spec  # CLI start-up: loaded per command
    from mmvsd.prompts import load_eval_prompts  # CLI start-up: loaded per command
    from mmvsd.shipped import implicit_drafter_spec  # CLI start-up: loaded per command
    from mmvsd.target_loader import load_target  # CLI start-up: loaded per command
    from mmvsd.training import acceptance  # CLI start-up: loaded per command

    tree = tree_spec_from_args(args)
    spec = args.drafter or implicit_drafter_spec(args.target)
    if spec == "none":
        raise UserError("--drafter none drafts nothing: there is no acceptance to measure")
    target = load_target(args.target, *placement(args.device, args.dtype))
    drafter = drafter_from_spec(spec, target, args.seed, ngram=args.ngram)
    prompts = load_eval_prompts(target, args.prompt_file, args.limit, args.adapter)
    # the trees auto plans from this machine's costs; its speed guard's plain steps are not replayed
    shape = make_shape(tree_for_prompts(tree, prompts), target, drafter)
    acceptance.check_eval_prompts(target, prompts, args.max_new_tokens, shape)
    start = time.perf_counter()
    make = acceptance.greedy_continuations if args.no_cache else acceptance.cached_greedy_continuations
    continuations = make(target, prompts, args.max_new_tokens, args.batch_size or 8)
    print(f"greedy continuations: {len(prompts)} prompts, {time.perf_counter() - start:.1f} s", flush=True)
    learns = drafter.proposes_from_context or not isinstance(shape, TreeShape)  # statistics shared by a batch
    batch_size = args.batch_size or (1 if learns else 8)
    report = acceptance.evaluate_acceptance(target, drafter, prompts, continuations, shape, batch_size, progress=True)
    print(acceptance.format_report(report))
    if args.json:
        with atomic_file(args.json) as handle:
            json.dump({"target": args.target, "drafter": spec, "prompt_file": args.prompt_file, "limit": args.limit,
                       "max_new_tokens": args.max_new_tokens, **report.to_dict()}, handle, indent=2)


def run_drafters(args: argparse.Namespace) -> None:
    """`mmvsd drafters list`."""
    from mmvsd.shipped import format_shipped  # CLI start-up: loaded per command

    print(format_shipped())


def run_adapters(args: argparse.Namespace) -> None:
    """`mmvsd adapters list`."""
    from mmvsd.adapters import registered_adapters  # CLI start-up: loaded per command

    for name, source in registered_adapters().items():
        print(f"{name:<16} {source}")


def run_export(args: argparse.Namespace) -> None:
    """`mmvsd export`: what --drafter names, in the layout --format names."""
    from mmvsd.drafters.export_spec import run_export as export  # CLI start-up: loaded per command

    export(args)


def run_profile(args: argparse.Namespace) -> None:
    """`mmvsd profile`: load (measuring once) the cost table, print it, optionally plot it."""
    from mmvsd.decoding.cost_cache import cost_table_path, load_cost_table  # CLI start-up: loaded per command
    from mmvsd.decoding.cost_plot import plot_cost_table  # CLI start-up: loaded per command
    from mmvsd.decoding.costs import format_cost_table  # CLI start-up: loaded per command
    from mmvsd.decoding.fingerprints import cost_key  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import drafter_from_spec  # CLI start-up: loaded per command
    from mmvsd.target_loader import load_target  # CLI start-up: loaded per command

    if args.plot and not args.plot.lower().endswith(".png"):
        raise UserError(f"--plot must name a .png file, got {args.plot!r}")
    batch_sizes = tuple(sorted(set(args.batch_size or [1])))
    target = load_target(args.target, *placement(args.device, args.dtype))
    drafter = drafter_from_spec(args.drafter, target, ngram=args.ngram)
    table = load_cost_table(target, drafter, batch_sizes, refresh=args.refresh)
    print(format_cost_table(table))
    print(f"profile cached in {cost_table_path(cost_key(target, drafter, batch_sizes, table.context))}")
    if args.plot:
        plot_cost_table(table, args.plot)
        print(f"plot written to {args.plot}")


def _print_record(number: int, record: dict) -> None:
    print(f"=== prompt {number}: {record['prompt'][:70]!r}")
    print(record["text"])
    print(f"--- new tokens {record['new_tokens']} | target forwards {record['target_forwards']} | "
          f"tau {record['tau']:.2f} | {record['wall_seconds']:.2f} s | {record['tokens_per_second']:.1f} tok/s",
          flush=True)


def run_train(args: argparse.Namespace) -> None:
    """`mmvsd train`: resolve the config, train, and say where the drafter is."""
    from mmvsd.training.config import load_train_config  # CLI start-up: loaded per command
    from mmvsd.training.trainer import train  # CLI start-up: loaded per command

    flags = {k: getattr(args, k) for k in ("target", "drafter", "init", "objective", "data", "output")}
    config = load_train_config(args.config, flags, args.overrides)
    if args.dry_run:
        from mmvsd.training.plan import describe_plan  # CLI start-up: loaded per command

        print(describe_plan(config, args.argv, args.gpus))
        return
    from accelerate import PartialState  # loaded by the trainer already

    out_dir = train(config, resume=args.resume)
    if PartialState().is_main_process:  # once, not once per process of `accelerate launch`
        print(f"drafter written to {out_dir}; try: mmvsd generate --target {config.target} --drafter {out_dir} "
              f"--prompt \"...\"")


def run_prepare(args: argparse.Namespace) -> None:
    """`mmvsd prepare`: write the offline feature cache of a run's training examples."""
    from mmvsd.training.config import load_train_config  # CLI start-up: loaded per command
    from mmvsd.training.prepare import prepare_feature_cache  # CLI start-up: loaded per command

    flags = {"target": args.target, "data": args.data, "output": args.output, "features": "offline",
             "feature_cache": args.output}
    config = load_train_config(args.config, flags, args.overrides)
    prepare_feature_cache(config, dtype=args.dtype, assume_yes=args.yes, device=placement(args.device)[1])


COMMANDS = {"generate": run_generate, "train": run_train, "prepare": run_prepare, "regenerate": run_regenerate_command,
            "adapters": run_adapters, "export": run_export, "bench": run_bench_command, "profile": run_profile,
            "eval-drafter": run_eval_drafter, "drafters": run_drafters}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed (the --dry-run plan repeats it)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if len(overrides) != len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]  # key=value after later flags
    try:
        handler = getattr(args, "handler", None) or COMMANDS[args.command]  # a plugin's command sets its own
        handler(args)
    except UserError as err:
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # a package of an extra that this install left out
        from mmvsd.versions import missing_package_message  # CLI start-up: only on this error

        message = missing_package_message(err)
        if message is None:
            raise
        print(f"mmvsd: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmvsd: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
