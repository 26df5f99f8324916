"""What `data=auto` (the default) trains on: ShareGPT, or the LLaVA mixture for an image drafter on an image target.

A drafter that reads media (`Drafter.reads_media`: MSD, ViSpec) on a target with a vision tower trains as the
paper's MLLM drafters do, on ShareGPT plus LLaVA-Instruct-150K with its COCO train2017 images. Their default place
is the `datasets/` folder of mmvsd's cache (`$MMVSD_CACHE`); when they are not there (or under `image_root`),
`mmvsd train` and its `--dry-run` stop with one message that says what to download and where, or which keys name
other paths. Any other drafter or target trains on the bundled ShareGPT. A multimodal drafter given data without
images on an image target trains on text alone, and the plan and the run say so (`text_only_warning`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import mmvsd.configs
from mmvsd.drafter_base import drafter_class
from mmvsd.errors import UserError
from mmvsd.files import cache_root
from mmvsd.target_loader import builtin_targets, resolve_target_folder

if TYPE_CHECKING:
    from mmvsd.target import Target
    from mmvsd.training.config import TrainConfig

AUTO = "auto"
LLAVA_INSTRUCT_JSON = "llava_instruct_150k.json"
COCO_IMAGES = Path("coco") / "train2017"
LLAVA_INSTRUCT_DOWNLOAD = "huggingface-cli download liuhaotian/LLaVA-Instruct-150K llava_instruct_150k.json " \
                          "--repo-type dataset --local-dir"
COCO_DOWNLOAD = "http://images.cocodataset.org/zips/train2017.zip"
TARGET_CONFIGS = Path(mmvsd.configs.__file__).parent / "targets"  # full-size configs of the LLaVA-1.5 names


def default_data_dir() -> Path:
    """Where `data=auto` looks for LLaVA-Instruct and the COCO images: the mmvsd cache's `datasets/` folder."""
    return cache_root() / "datasets"


def target_config_path(spec: str) -> Path:
    """A config.json for `spec` without loading weights: shipped (LLaVA-1.5 names), a folder's, a GGUF built-in's."""
    builtin = builtin_targets().get(spec)
    names = [spec] + ([builtin.hf_id] if builtin is not None and builtin.hf_id else [])
    for name in names:
        shipped = TARGET_CONFIGS / f"{name.rsplit('/', 1)[-1].removesuffix('-hf')}.json"
        if shipped.is_file():
            return shipped
    return resolve_target_folder(spec) / "config.json"  # a clear error for an unknown name or a folder without one


def is_image_target(target: Target | str) -> bool:
    """Whether a target (loaded, on the meta device, or named) has a vision tower: its config has a vision_config."""
    if isinstance(target, str):
        return "vision_config" in json.loads(target_config_path(target).read_text())
    return getattr(target.model.config, "vision_config", None) is not None


def trains_on_images(config: TrainConfig, target: Target | None = None) -> bool:
    """Whether the run's drafter reads media and its target has a vision tower (`target`: loaded, else by name)."""
    return drafter_class(config.drafter).reads_media and is_image_target(config.target if target is None else target)


def resolve_training_data(config: TrainConfig, target: Target | None = None) -> TrainConfig:
    """`config` with `data=auto` made explicit (module docstring); UserError when the LLaVA mixture it needs is
    not on disk. Any other `data` is returned as it is."""
    if config.data != AUTO:
        return config
    if not trains_on_images(config, target):
        return dataclasses.replace(config, data="sharegpt")
    instruct = default_data_dir() / LLAVA_INSTRUCT_JSON
    images = Path(config.image_root).expanduser() if config.image_root else default_data_dir() / COCO_IMAGES
    if not instruct.is_file() or not images.is_dir():
        raise UserError(missing_mixture_message(config, instruct, images))
    return dataclasses.replace(config, data=f"sharegpt+llava-instruct:{instruct}", image_root=str(images))


def missing_mixture_message(config: TrainConfig, instruct: Path, images: Path) -> str:
    """What `data=auto` needs for an image drafter and is not there: what to download, where, or what to set."""
    missing = [f"LLaVA-Instruct-150K's {LLAVA_INSTRUCT_JSON} (not at {instruct})"] if not instruct.is_file() else []
    missing += [f"the COCO train2017 images (no folder {images})"] if not images.is_dir() else []
    return (f"a {config.drafter} drafter for the image target {config.target} trains on the LLaVA mixture (ShareGPT "
            f"+ LLaVA-Instruct-150K with its COCO images, data=auto), and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on disk. "
            f"Download them there: `{LLAVA_INSTRUCT_DOWNLOAD} {instruct.parent}`, and unzip {COCO_DOWNLOAD} "
            f"(118k images, 18 GB) into {images.parent}. Or name where they are: "
            f"data=sharegpt+llava-instruct:DIR/{LLAVA_INSTRUCT_JSON} image_root=DIR/train2017 (docs/gpu-llava.md)")


def text_only_warning(config: TrainConfig, target: Target, num_images: int) -> str:
    """A warning when an image drafter on an image target trains on no image at all ("" otherwise)."""
    if num_images or not trains_on_images(config, target):
        return ""
    return (f"a {config.drafter} drafter for the image target {config.target} trains on text alone here "
            f"(data={config.data}{', offline features' if config.features == 'offline' else ''}: no example has "
            f"an image); data=auto trains it on ShareGPT + LLaVA-Instruct with images (docs/gpu-llava.md)")
