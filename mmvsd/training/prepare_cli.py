"""`mmvsd prepare`: the offline feature cache a training run reads. Light to import: the cache writer loads when
the command runs."""

from __future__ import annotations

import argparse

from mmvsd.placement import add_device_argument, placement


def add_prepare_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd prepare` (entry point `mmvsd.commands`)."""
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
    p.set_defaults(handler=run_prepare)


def run_prepare(args: argparse.Namespace) -> None:
    """`mmvsd prepare`: write the offline feature cache of a run's training examples."""
    from mmvsd.training.config import load_train_config  # CLI start-up: loaded per command
    from mmvsd.training.prepare import prepare_feature_cache  # CLI start-up: loaded per command

    flags = {"target": args.target, "data": args.data, "output": args.output, "features": "offline",
             "feature_cache": args.output}
    config = load_train_config(args.config, flags, args.overrides)
    prepare_feature_cache(config, dtype=args.dtype, assume_yes=args.yes, device=placement(args.device)[1])
