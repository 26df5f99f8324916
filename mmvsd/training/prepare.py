"""`mmvsd prepare`: capture the target features of a run's training examples into an offline cache."""

from __future__ import annotations

import sys
from pathlib import Path

from mmvsd.errors import UserError
from mmvsd.training.config import TrainConfig
from mmvsd.training.feature_cache import plan_feature_cache, write_feature_cache
from mmvsd.training.sources import config_examples, data_settings
from mmvsd.training.trainer import load_training_target
from mmvsd.training.training_data import resolve_training_data

DTYPES = {"auto": None, "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def prepare_feature_cache(config: TrainConfig, dtype: str = "auto", assume_yes: bool = False,
                          device: str = "cpu") -> Path:
    """Render the same training examples `mmvsd train` would, print the size, then write the cache (the target
    on `device`; the features are stored from the CPU)."""
    config = resolve_training_data(config)  # data=auto, as `mmvsd train` resolves it
    out_dir = Path(config.feature_cache)
    target = load_training_target(config, device)
    split = config_examples(config, target)
    if any(example.media for example in split.train):
        raise UserError("offline feature caches hold text examples only; train on data with images with "
                        "features=online")
    plan = plan_feature_cache(target, split.train, dtype=DTYPES[dtype])
    print(plan.describe(out_dir), flush=True)
    if not assume_yes and sys.stdin.isatty() and input("proceed? [y/N] ").strip().lower() not in ("y", "yes"):
        raise UserError("cancelled; nothing written")
    write_feature_cache(target, split.train, out_dir, settings=data_settings(config), dtype=DTYPES[dtype],
                        progress=config.progress)
    print(f"feature cache ready: train with features=offline feature_cache={out_dir}")
    return out_dir
