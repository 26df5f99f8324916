"""Offline lmms-eval tasks: mini versions of six multimodal benchmarks on synthetic images.

`mini_task_dir()` is the folder to pass to lmms-eval as `include_path` (`--include_path` on the
command line, `TaskManager(include_path=...)` in Python). It holds one YAML per task, the
`mini_tasks.py` module their `!function` entries point at, and `data/<task>.parquet` written by
`mmvsd.eval.make_mini_tasks` from the test split of `mmvsd.data.images`.
"""

from __future__ import annotations

from pathlib import Path

# lmms-eval task name -> mmvsd.data.images family. Each task also has a "<name>_long" variant.
MINI_TASKS: dict[str, str] = {
    "vqav2_val_mini": "vqav2",
    "ai2d_mini": "ai2d",
    "chartqa_mini": "chartqa",
    "textvqa_val_mini": "textvqa",
    "scienceqa_img_mini": "scienceqa",
    "hallusion_bench_image_mini": "hallusion",
}
LONG_SUFFIX = "_long"


def mini_task_dir() -> Path:
    """The folder holding the mini task YAMLs, for lmms-eval's include_path."""
    return Path(__file__).resolve().parent / "tasks"
