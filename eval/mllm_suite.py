"""The multimodal benchmarks of `mmvsd bench`, read through lmms-eval's own task definitions.

The suite `mllm` is the six benchmarks the paper reports. Each runs as the real lmms-eval task
(`vqav2_val`, `ai2d`, `chartqa`, `textvqa_val`, `scienceqa_img`, `hallusion_bench_image`) when its
dataset is already on this machine, else as mmvsd's offline `<task>_mini_long` task (synthetic
images, long-answer prompts as the paper's speed evaluation uses). Naming a real task explicitly
never falls back: a missing dataset is an error that names the offline task to use instead.
Prompts, images and scoring all come from lmms-eval (`doc_to_text`, `doc_to_visual`,
`process_results`), so `mmvsd bench` and `lmms_eval --model mmvsd` share the task files.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from mmvsd.errors import UserError
from mmvsd.eval import LONG_SUFFIX, MINI_TASKS, mini_task_dir

REAL_TASKS = tuple(name.removesuffix("_mini") for name in MINI_TASKS)  # vqav2_val, ai2d, chartqa, ...
MINI_NAMES = tuple(MINI_TASKS) + tuple(name + LONG_SUFFIX for name in MINI_TASKS)
IMAGE_MARKER = "<image>"
LOCAL_BUILDERS = {"json", "parquet", "csv", "arrow", "text", "imagefolder"}


def is_task(name: str) -> bool:
    return name in REAL_TASKS or name in MINI_NAMES


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No network while lmms-eval loads a dataset: a dataset that is not cached fails at once."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@functools.cache
def _task_manager():
    from lmms_eval.tasks import TaskManager

    return TaskManager(include_path=str(mini_task_dir()))


@functools.cache
def load_task(name: str):
    """The lmms-eval task object (its dataset loaded offline); UserError if that is impossible."""
    from lmms_eval.tasks import get_task_dict

    try:
        with _offline():
            return get_task_dict([name], _task_manager())[name]
    except Exception as err:  # noqa: BLE001  lmms-eval and datasets raise many types for a missing dataset
        mini = f"{name}_mini"
        hint = f"; use the offline {mini} / {mini}{LONG_SUFFIX}, or --suite mllm (falls back to them)" \
            if name in REAL_TASKS else ""
        raise UserError(f"lmms-eval task {name!r} cannot be loaded on this machine ({type(err).__name__}: "
                        f"{str(err)[:160]}){hint}") from None


def _dataset_on_disk(name: str) -> bool:
    """Cheap first check: the task's dataset is a local file builder or folder, or in the HF hub cache."""
    from huggingface_hub import snapshot_download

    from mmvsd.layouts import hf_hub_cache

    path = str(_task_manager()._get_config(name).get("dataset_path", ""))
    if path in LOCAL_BUILDERS or Path(path).expanduser().exists():
        return True
    try:
        snapshot_download(path, repo_type="dataset", cache_dir=hf_hub_cache(), local_files_only=True)
    except Exception:  # noqa: BLE001  not cached (huggingface_hub raises several types)
        return False
    return True


def available(name: str) -> bool:
    """Whether lmms-eval can load task `name` here, without the network."""
    if not _dataset_on_disk(name):
        return False
    try:
        load_task(name)
    except UserError:
        return False
    return True


def suite_tasks() -> list[str]:
    """The `mllm` suite: each real task if its data is here, else its offline long-answer mini task."""
    return [real if available(real) else f"{real}_mini{LONG_SUFFIX}" for real in REAL_TASKS]


@functools.cache
def task_docs(name: str):
    """The task's evaluation documents (a list or a datasets.Dataset: indexed by position, never copied)."""
    task = load_task(name)
    return task.test_docs() if task.has_test_docs() else task.validation_docs()


def task_items(name: str, limit: int = 0) -> list:
    """BenchItems of an lmms-eval task: the prompt text (image marker removed) and the PIL images."""
    from mmvsd.eval.suites import BenchItem

    task = load_task(name)
    docs = task_docs(name)
    items = []
    for index in range(min(limit, len(docs)) if limit > 0 else len(docs)):
        doc = docs[index]
        text = str(task.doc_to_text(doc)).replace(IMAGE_MARKER, "").strip()
        images = tuple(image.convert("RGB") for image in task.doc_to_visual(doc) or [])
        items.append(BenchItem(name, str(index), (text,), {"doc_index": index}, images))
    return items


def task_score(name: str, answer: str, reference: dict) -> float:
    """The task's first metric for one answer, from lmms-eval's own process_results."""
    task = load_task(name)
    doc = task_docs(name)[reference["doc_index"]]
    metrics = task.process_results(doc, [answer])
    first = next(iter(metrics.values()))
    if isinstance(first, dict):  # some tasks return a per-sample record; its score field is the metric
        first = first.get("score", first.get("accuracy", 0.0))
    return float(first)
