"""The benchmarks' prompt sets (their items' first user turns; images through a modality adapter), registered
into the core's registry `mmvsd.prompts` when this plugin is imported (pyproject's `mmvsd.plugins`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mmvsd.adapter_base import Prompt
from mmvsd.eval.media_writer import MediaWriter
from mmvsd.eval.suites import BENCHMARKS, load_items
from mmvsd.prompts import PromptSetLoader, register_prompt_set
from mmvsd.target import Target


def text_prompts(name: str) -> PromptSetLoader:
    """A text benchmark's first turns through the target's chat template."""

    def load(target: Target, limit: int, adapter: str) -> list[Prompt]:
        return [Prompt(target.encode_prompt(item.turns[0])) for item in load_items(name, limit)]

    return load


def image_prompts(name: str) -> PromptSetLoader:
    """An image benchmark's first turns (an lmms-eval task, e.g. the offline `vqav2_val_mini_long`) with their
    images, through the modality adapter `adapter` (or the first that can feed the target)."""

    def load(target: Target, limit: int, adapter: str) -> list[Prompt]:
        prompts = []
        with tempfile.TemporaryDirectory(prefix="mmvsd-eval-") as folder:  # the adapter reads image files
            media = MediaWriter(Path(folder), adapter)
            for item in load_items(name, limit):
                feeder, paths = media.files(target, item)
                prompts.append(feeder.encode(target, item.turns[0], paths))
        return prompts

    return load


for _name, _benchmark in BENCHMARKS.items():  # every benchmark registered when this plugin loads
    register_prompt_set(_name, image_prompts(_name) if _benchmark.images else text_prompts(_name))
