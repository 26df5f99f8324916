"""The multimodal benchmarks of `mmvsd bench`, read through lmms-eval's own task definitions.

The suite `mllm` (registered in `mmvsd.eval.suites`) is the six benchmarks the paper reports. Each runs as the
real lmms-eval task (`vqav2_val`, `ai2d`, `chartqa`, `textvqa_val`, `scienceqa_img`, `hallusion_bench_image`)
when its dataset is already on this machine, else as mmvsd's offline `<task>_mini_long` task (synthetic
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

from mmvsd.checkpoints import hf_hub_cache
from mmvsd.errors import UserError
from mmvsd.eval import LONG_SUFFIX, MINI_TASKS, mini_task_dir
from mmvsd.eval.bench_item import BenchItem

REAL_TASKS = tuple(name.removesuffix("_mini") for name in MINI_TASKS)  # vqav2_val, ai2d, chartqa, ...
MINI_NAMES = tuple(MINI_TASKS) + tuple(name + LONG_SUFFIX for name in MINI_TASKS)
IMAGE_MARKER = "<image>"
LOCAL_BUILDERS = {"json", "parquet", "csv", "arrow", "text", "imagefolder"}


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No network while lmms-eval loads a dataset: a dataset that is not cached fails at once. Its own log lines
    (loguru: hundreds of DEBUG lines about its task folders) are off meanwhile; a failure becomes one UserError."""
    from loguru import logger  # lmms-eval's logger: only the mllm benchmarks need it

    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    logger.disable("lmms_eval")
    try:
        yield
    finally:
        logger.enable("lmms_eval")
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@functools.cache
def _task_manager():
    from lmms_eval.tasks import TaskManager  # heavy (lmms-eval, datasets): only the mllm benchmarks need it

    return TaskManager(include_path=str(mini_task_dir()))


@functools.cache
def load_task(name: str):
    """The lmms-eval task object (its dataset loaded offline); UserError if that is impossible."""
    from lmms_eval.tasks import get_task_dict  # heavy (lmms-eval, datasets): only the mllm benchmarks need it

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
    """Whether the task's dataset is here: a local file builder or folder, or in the HF hub cache. Only
    'not cached' answers False; any other failure of the cache lookup is an error."""
    from huggingface_hub import snapshot_download  # heavy (~0.2 s): only a real task's dataset is looked up
    from huggingface_hub.errors import LocalEntryNotFoundError  # likewise

    with _offline():
        path = str(_task_manager()._get_config(name).get("dataset_path", ""))
    if path in LOCAL_BUILDERS or Path(path).expanduser().exists():
        return True
    try:
        snapshot_download(path, repo_type="dataset", cache_dir=hf_hub_cache(), local_files_only=True)
    except LocalEntryNotFoundError:
        return False
    except Exception as err:  # noqa: BLE001  a broken cache must not pass for 'absent'
        raise UserError(f"the HF cache entry of {name}'s dataset {path!r} cannot be read ({type(err).__name__}: "
                        f"{str(err)[:160]}); repair or delete it") from None
    return True


def available(name: str) -> bool:
    """Whether task `name`'s data is on this machine (False only when it is not cached); a dataset that is
    cached but does not load is a UserError, never a silent fallback."""
    if not _dataset_on_disk(name):
        return False
    load_task(name)
    return True


@functools.cache
def task_docs(name: str):
    """The task's evaluation documents (a list or a datasets.Dataset: indexed by position, never copied)."""
    task = load_task(name)
    return task.test_docs() if task.has_test_docs() else task.validation_docs()


def task_items(name: str, limit: int = 0) -> list:
    """BenchItems of an lmms-eval task: the prompt text (image marker removed) and the PIL images."""
    task = load_task(name)
    docs = task_docs(name)
    items = []
    for index in range(min(limit, len(docs)) if limit > 0 else len(docs)):
        doc = docs[index]
        text = str(task.doc_to_text(doc)).replace(IMAGE_MARKER, "").strip()
        images = tuple(image.convert("RGB") for image in task.doc_to_visual(doc) or [])
        items.append(BenchItem(name, str(index), (text,), {"doc_index": index}, images))
    return items


def filtered_answer(task, doc, answer: str):
    """`answer` after the task's first filter pipeline (lmms-eval's `filter_list`, e.g. AI2D's option-letter
    extraction; `take_first` when the task has none), in the shape lmms-eval hands to process_results."""
    ensembles = getattr(task, "_filters", None) or []
    if not ensembles:
        return answer
    responses = [[answer]]  # one instance, one response
    for step in ensembles[0].filters:
        responses = list(step.apply(responses, [doc]))
    return responses[0]


def metric_value(name: str, metric: str, value) -> float | None:
    """One sample's score from a process_results value: a number, or None for a per-sample record (a dict
    without a score field) that only the task's aggregation can score (e.g. HallusionBench's GPT judge).
    Any other shape is an error: a silent 0 would pass for a measured accuracy."""
    if isinstance(value, bool | int | float):
        return float(value)
    if isinstance(value, dict):
        for key in ("score", "accuracy", "acc", "exact_match"):
            if isinstance(value.get(key), bool | int | float):
                return float(value[key])
        return None
    raise UserError(f"lmms-eval task {name!r} returned metric {metric!r} as {type(value).__name__} "
                    f"({str(value)[:80]!r}); mmvsd bench scores numbers, or per-sample dicts left to the task's "
                    f"aggregation")


def task_score(name: str, answer: str, reference: dict) -> float | None:
    """The task's first metric for one answer as lmms-eval computes it: filters, then process_results.
    None: the task scores only in aggregate (the table shows no accuracy for it)."""
    task = load_task(name)
    doc = task_docs(name)[reference["doc_index"]]
    metrics = task.process_results(doc, [filtered_answer(task, doc, answer)])
    if not isinstance(metrics, dict) or not metrics:
        raise UserError(f"lmms-eval task {name!r}: process_results returned {type(metrics).__name__}, not a "
                        f"dict of metrics")
    metric, value = next(iter(metrics.items()))
    return metric_value(name, metric, value)
