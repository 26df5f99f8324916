"""`mmvsd train`: the training recipe (`mmvsd.training.trainer.train`) with evaluation's validation-tau monitor
(`mmvsd.eval.acceptance.tau_monitor`), composed here, above both. Light to import: the trainer loads when the
command runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mmvsd.placement import positive_int
from mmvsd.training.terms import objective_help


class ShownHelp(str):
    """A help text made when argparse shows it (`mmvsd train --help`), not when the parser is built: it lists the
    registry with the plugins' entries, and no other command line loads the plugins for it."""

    make: Callable[[], str]

    def __new__(cls, make: Callable[[], str]) -> ShownHelp:  # noqa: PYI034  (typing.Self is 3.11+; we run on 3.10)
        text = super().__new__(cls, "(made when shown)")
        text.make = make
        return text

    def __mod__(self, params: object) -> str:
        return self.make() % params


def add_train_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd train` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("train", help="train a drafter (objectives over the registered terms: `mmvsd train --help`)",
                       description="Train a drafter. Settings: defaults < --config YAML < flags < key=value.")
    p.add_argument("--target", help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", help="drafter architecture (default eagle3)")
    p.add_argument("--init", help="none (default) | a drafter folder | a released layout (eagle3) | LAYOUT:PATH | a "
                                  "shipped drafter of the target (e.g. eagle3-ce, or default)")
    p.add_argument("--objective", help=ShownHelp(objective_help))
    p.add_argument("--data", help="auto (default: ShareGPT; for an image drafter on an image target ShareGPT + "
                                  "LLaVA-Instruct), sharegpt, sharegpt:PATH, llava-instruct:PATH or a JSON/JSONL file; "
                                  "SPEC+SPEC mixes them")
    p.add_argument("--output", help="output folder: becomes a drafter folder for `mmvsd generate --drafter`")
    p.add_argument("--config", help="YAML file of TrainConfig settings (see mmvsd/configs/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (parameters, data, steps, memory per GPU, disk, the accelerate launch "
                        "command) without loading weights or writing anything")
    p.add_argument("--gpus", type=positive_int, help="GPUs the --dry-run plan is for (default: this machine's, "
                                                      "or one process on its CPU when it has none)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. max_steps=100 loss.num_samples=8")
    p.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> None:
    """`mmvsd train`: resolve the config, train, and say where the drafter is."""
    from mmvsd.eval.acceptance import tau_monitor  # CLI start-up: loaded per command
    from mmvsd.training.config import load_train_config  # CLI start-up: loaded per command
    from mmvsd.training.trainer import train  # CLI start-up: loaded per command

    flags = {k: getattr(args, k) for k in ("target", "drafter", "init", "objective", "data", "output")}
    config = load_train_config(args.config, flags, args.overrides)
    if args.dry_run:
        import torch  # loaded by the plan already

        from mmvsd.training.plan import describe_plan  # CLI start-up: loaded per command

        print(describe_plan(config, args.argv, args.gpus or torch.cuda.device_count()))
        return
    from accelerate import PartialState  # loaded by the trainer already

    out_dir = train(config, resume=args.resume, validation=tau_monitor)
    if PartialState().is_main_process:  # once, not once per process of `accelerate launch`
        print(f"drafter written to {out_dir}; try: mmvsd generate --target {config.target} --drafter {out_dir} "
              f"--prompt \"...\"")
