"""Offline lmms-eval mini tasks: indexing, docs, prompts, scoring, and deterministic data files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest
from lmms_eval.tasks import TaskManager, get_task_dict
from PIL import Image

from mmvsd.errors import UserError
from mmvsd.eval import LONG_SUFFIX, MINI_TASKS, mini_task_dir
from mmvsd.eval.make_mini_tasks import DEFAULT_NUM_ITEMS, MINI_FEATURES, main, write_mini_tasks

LONG_TASKS = [name + LONG_SUFFIX for name in MINI_TASKS]
DATA_DIR = mini_task_dir() / "data"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """All twelve tasks built by lmms-eval offline, from a current directory outside the repository."""
    workdir = tmp_path_factory.mktemp("elsewhere")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setenv("LMMS_EVAL_DATASETS_CACHE", str(workdir / "cache"))
        patch.chdir(workdir)
        # include_defaults=False skips indexing lmms-eval's ~300 built-in task folders (about 10 s).
        manager = TaskManager(include_path=str(mini_task_dir()), include_defaults=False)
        missing = [name for name in [*MINI_TASKS, *LONG_TASKS] if name not in manager.all_tasks]
        assert not missing, f"TaskManager did not index {missing}"
        yield get_task_dict([*MINI_TASKS, *LONG_TASKS], manager)


def wrong_answer(doc: dict[str, Any]) -> str:
    """A plausible answer that differs from the ground truth (another letter, the other of yes/no, ...)."""
    answer = doc["answer"]
    if doc["options"]:
        return "A" if answer != "a" else "B"
    if answer in ("yes", "no"):
        return "no" if answer == "yes" else "yes"
    try:
        return str(float(answer) * 2 + 7)
    except ValueError:
        return "unknown" if answer != "unknown" else "nothing"


@pytest.mark.parametrize("name", list(MINI_TASKS))
def test_docs_prompts_and_images(tasks: dict[str, Any], name: str) -> None:
    task = tasks[name]
    docs = task.test_docs()
    assert len(docs) == DEFAULT_NUM_ITEMS
    assert task.config.dataset_kwargs["data_files"]["test"] == str(DATA_DIR / f"{name}.parquet")
    assert {doc["family"] for doc in docs} == {MINI_TASKS[name]}
    doc = docs[0]
    assert doc["item_id"] == f"{MINI_TASKS[name]}-test-00000"
    (image,) = task.doc_to_visual(doc)
    assert isinstance(image, Image.Image) and image.mode == "RGB"
    text = task.doc_to_text(doc)
    assert doc["question"] in text and text != doc["question"]  # post-prompt appended
    assert task.config.generation_kwargs["max_new_tokens"] <= 32


@pytest.mark.parametrize("name", list(MINI_TASKS))
def test_long_variant(tasks: dict[str, Any], name: str) -> None:
    short, long = tasks[name], tasks[name + LONG_SUFFIX]
    doc = long.test_docs()[0]
    assert long.doc_to_text(doc) == doc["long_prompt"]
    assert long.config.generation_kwargs["max_new_tokens"] == 256
    assert long.config.generation_kwargs["until"] == []
    assert long.config.process_results is not None and len(long.test_docs()) == len(short.test_docs())


@pytest.mark.parametrize("name", list(MINI_TASKS))
def test_scores_truth_right_and_wrong_answer_wrong(tasks: dict[str, Any], name: str) -> None:
    task = tasks[name]
    for doc in task.test_docs():
        truth = doc["answer"].upper() if doc["options"] else doc["answer"]
        right = task.process_results(doc, [truth])
        assert right and all(value == 1.0 for value in right.values()), (doc["item_id"], truth, right)
        wrong = task.process_results(doc, [wrong_answer(doc)])
        assert all(value == 0.0 for value in wrong.values()), (doc["item_id"], wrong_answer(doc), wrong)


@pytest.mark.parametrize(("name", "prediction", "expected"), [
    ("hallusion_bench_image_mini", "Yes, there is.", "yes"),
    ("ai2d_mini", "{letter}. because", None),
    ("scienceqa_img_mini", "{letter}. because", None),
    ("vqav2_val_mini", "  {answer}.", None),
])
def test_scores_answer_variants(tasks: dict[str, Any], name: str, prediction: str, expected: str | None) -> None:
    task = tasks[name]
    doc = next(doc for doc in task.test_docs() if expected is None or doc["answer"] == expected)
    text = prediction.format(letter=doc["answer"].upper(), answer=doc["answer"].capitalize())
    assert all(value == 1.0 for value in task.process_results(doc, [text]).values()), text


def test_unknown_prompt_kind_is_a_user_error(tasks: dict[str, Any]) -> None:
    task = tasks["chartqa_mini"]
    with pytest.raises(UserError, match="prompt kind"):
        task.config.doc_to_text(task.test_docs()[0], {"prompt": "medium"})


def test_committed_files_match_a_fresh_generation(tmp_path: Path) -> None:
    first = write_mini_tasks(tmp_path / "a", num_items=3, seed=0)
    second = write_mini_tasks(tmp_path / "b", num_items=3, seed=0)
    assert [path.name for path in first] == [f"{name}.parquet" for name in MINI_TASKS]
    for path_a, path_b in zip(first, second):
        assert path_a.read_bytes() == path_b.read_bytes(), f"{path_a.name} is not byte-identical across runs"
        committed = pq.read_table(DATA_DIR / path_a.name)
        assert committed.num_rows == DEFAULT_NUM_ITEMS
        assert datasets.Features.from_arrow_schema(committed.schema) == MINI_FEATURES
        assert committed.slice(0, 3).to_pylist() == pq.read_table(path_a).to_pylist(), (
            f"{path_a.name}: committed rows differ from a fresh generation; rerun python -m mmvsd.eval.make_mini_tasks")
    assert not list((tmp_path / "a").glob(".*")), "temporary files left behind"


def test_cli_writes_files_and_rejects_bad_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--num-items", "1", "--seed", "3"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(f"{name}.parquet" for name in MINI_TASKS)
    assert main(["--out", str(tmp_path), "--num-items", "0"]) == 2
    assert "num_items must be a positive integer" in capsys.readouterr().err
