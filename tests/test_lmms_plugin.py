"""The lmms-eval model `mmvsd`: found through lmms-eval's entry-point registry, runs a mini task from
lmms-eval's own command line offline, and answers losslessly (drafter none == random at temperature 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmms_eval.api.instance import Instance
from PIL import Image

from conftest import fit_drafter_to_target, save_tiny_llava
from mmvsd.errors import UserError
from mmvsd.eval import mini_task_dir
from mmvsd.eval.lmms_plugin import MmvsdLmms
from mmvsd.target_loader import load_target

SMALL_TREE = "tree_budget=12,tree_depth=3,tree_topk=3"  # model_args: keeps the random drafter fast on the CPU
TASK, SPLIT = "handmade", "test"
IMAGE_CONTEXT, TEXT_CONTEXT = "<image>\nw1 w2 w3", "w4 w5 w6 what"  # for doc 0 (image) and doc 1


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava(tmp_path_factory.mktemp("lmms-tiny-llava"))


@pytest.fixture(scope="module")
def fitted_drafter_folder(llava_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-3 drafter folder overfitted to the text request's greedy answer, so that drafts get accepted."""
    target = load_target(str(llava_folder))
    drafter = fit_drafter_to_target(target, [target.encode_prompt(TEXT_CONTEXT)], steps=20)
    folder = tmp_path_factory.mktemp("fitted") / "drafter"
    drafter.save_pretrained(folder)
    return folder


def build_model(folder: Path, model_args: str, tree: str = SMALL_TREE) -> MmvsdLmms:
    """The model as lmms-eval builds it (model_args string plus its batch_size/device config), over two docs:
    doc 0 shows an image, doc 1 is text only."""
    model = MmvsdLmms.create_from_arg_string(f"target={folder},{tree},{model_args}", {"batch_size": 1})
    image = Image.fromarray((np.random.default_rng(0).random((40, 60, 3)) * 255).astype("uint8"))
    model.task_dict = {TASK: {SPLIT: [{"image": image}, {"image": None}]}}
    return model


def doc_images(doc: dict[str, Any]) -> list[Image.Image]:
    return [doc["image"]] if doc["image"] is not None else []


def request(doc_id: int, context: str, until: list[str] | None = None, max_new_tokens: int = 8) -> Instance:
    gen_kwargs = {"max_new_tokens": max_new_tokens, "temperature": 0, "do_sample": False, "until": until or []}
    return Instance("generate_until", (context, gen_kwargs, doc_images, doc_id, TASK, SPLIT), idx=0,
                    metadata={"task": TASK, "doc_id": doc_id, "repeats": 1})


def texts(model: MmvsdLmms, requests: list[Instance]) -> list[str]:
    return [answer.text for answer in model.generate_until(requests)]


@pytest.fixture(scope="module")
def plain(llava_folder: Path) -> MmvsdLmms:
    return build_model(llava_folder, "drafter=none")


RESOLVE = """
import mmvsd.eval.lmms_plugin as plugin  # first: lmms-eval's entry-point scan must not find it half-imported
from lmms_eval.models import MODEL_REGISTRY_V2, get_model

assert get_model("mmvsd") is plugin.MmvsdLmms
print(MODEL_REGISTRY_V2.resolve("mmvsd"))
"""


def test_entry_point_resolves_to_the_plugin_in_a_fresh_process() -> None:
    done = subprocess.run([sys.executable, "-c", RESOLVE], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "class_path='mmvsd.eval.lmms_plugin.MmvsdLmms'" in done.stdout and "Failed" not in done.stdout


def test_lmms_eval_command_line_runs_a_mini_task_offline(llava_folder: Path, tmp_path: Path) -> None:
    records = tmp_path / "records.jsonl"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "LMMS_EVAL_DATASETS_CACHE": str(tmp_path / "cache")}
    command = [
        sys.executable, "-m", "lmms_eval", "--model", "mmvsd",
        "--model_args", f"target={llava_folder},drafter=random,records={records},{SMALL_TREE}",
        "--tasks", "chartqa_mini", "--include_path", str(mini_task_dir()), "--limit", "2",
        "--gen_kwargs", "max_new_tokens=6", "--predict_only", "--output_path", str(tmp_path / "out"),
    ]
    done = subprocess.run(command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(row["task"], row["doc_id"]) for row in rows] == [("chartqa_mini", 0), ("chartqa_mini", 1)]
    assert all(row["tau"] >= 1 and 1 <= row["new_tokens"] <= 6 and row["wall_seconds"] > 0 for row in rows)
    (samples_file,) = (tmp_path / "out").rglob("*samples_chartqa_mini.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert [s["token_counts"][0]["output_tokens"] for s in samples] == [row["new_tokens"] for row in rows]


@pytest.mark.parametrize("drafter", ["random", "fitted"])
def test_speculative_answers_equal_plain_decoding(
    drafter: str, llava_folder: Path, fitted_drafter_folder: Path, plain: MmvsdLmms, tmp_path: Path
) -> None:
    records = tmp_path / "tau.jsonl"
    spec = fitted_drafter_folder if drafter == "fitted" else drafter
    speculative = build_model(llava_folder, f"drafter={spec},records={records}")
    requests = [request(0, IMAGE_CONTEXT), request(1, TEXT_CONTEXT)]
    expected = texts(plain, requests)
    assert texts(speculative, requests) == expected
    assert all(expected)
    assert [(r["doc_id"], r["new_tokens"]) for r in speculative.records] == [(0, 8), (1, 8)]
    assert all(r["tau"] >= 1 and r["target_forwards"] <= 8 for r in speculative.records)
    assert [json.loads(line) for line in records.read_text().splitlines()] == speculative.records
    assert {r["tau"] for r in plain.records} == {1.0}
    if drafter == "fitted":  # accepted drafts: the answer went through the verifier's accept path
        assert speculative.records[1]["tau"] > 1


def test_auto_tree_by_default_is_lossless_and_learns_across_requests(
    llava_folder: Path, fitted_drafter_folder: Path, plain: MmvsdLmms
) -> None:
    model = build_model(llava_folder, f"drafter={fitted_drafter_folder}", tree="seed=0")  # no tree argument
    assert model.tree == "auto"
    requests = [request(0, IMAGE_CONTEXT), request(1, TEXT_CONTEXT)]
    assert texts(model, requests) == texts(plain, requests)
    assert model.tree_generate.stats[0.0].rank_tried.sum() > 0  # what the plan learnt is kept for the next request


@pytest.mark.parametrize(("args", "message"), [
    ("tree=auto,tree_budget=12", "two ways to say one thing"),
    ("tree=60/7", "expected auto, paper or BUDGET/DEPTH/TOPK"),
])
def test_bad_tree_model_args_fail_clearly(llava_folder: Path, args: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        MmvsdLmms.create_from_arg_string(f"target={llava_folder},drafter=none,{args}")


def test_image_is_read_and_placeholder_replaced(plain: MmvsdLmms) -> None:
    with_image = texts(plain, [request(0, IMAGE_CONTEXT)])
    assert texts(plain, [request(0, "w1 w2 w3")]) == with_image  # the adapter puts the image in itself
    assert texts(plain, [request(1, IMAGE_CONTEXT)]) != with_image  # doc 1 has no image


def test_until_cuts_the_answer_at_the_first_stop_string(plain: MmvsdLmms) -> None:
    (full,) = texts(plain, [request(1, "w7 w8")])
    words = full.split()
    assert len(words) >= 4
    stops = [words[3], words[2]]
    (cut,) = texts(plain, [request(1, "w7 w8", until=stops)])
    assert cut == full[: min(full.index(stop) for stop in stops)]


def test_unsupported_requests_and_model_args_fail_clearly(plain: MmvsdLmms) -> None:
    with pytest.raises(NotImplementedError, match="loglikelihood"):
        plain.loglikelihood([])
    with pytest.raises(NotImplementedError, match="multi-round"):
        plain.generate_until_multi_round([])
    with pytest.raises(UserError, match="unknown model_args for --model mmvsd: tree_size"):
        MmvsdLmms.create_from_arg_string("target=smol-llava,tree_size=3")
    with pytest.raises(UserError, match="needs model_args target="):
        MmvsdLmms.create_from_arg_string("drafter=none")
