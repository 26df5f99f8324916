"""Deterministic synthetic image question-answer sets: offline mini versions of six multimodal
benchmarks (ChartQA, AI2D, TextVQA, ScienceQA, VQAv2, HallusionBench).

Each item is drawn from its own ``random.Random`` seeded by a hash of (seed, family, split, index),
so item ``i`` of a split is the same whatever ``num_items`` is asked for, the same seed gives
byte-identical PNGs, and the three splits never share an item. Answers are computed from the same
parameters the image is drawn from; those parameters are kept in ``meta``.

Glossary: ``question`` is the short factual question (with lettered options for multiple-choice
families); ``long_prompt`` asks the same question for a long, reasoned answer, as the ViSpec / MSD
speed evaluations do; ``description`` is a one- or two-sentence caption for projector training.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from mmvsd.data.image_charts import chartqa_item, render_chart
from mmvsd.data.image_diagrams import ai2d_item, render_ai2d
from mmvsd.data.image_families import (
    LETTERS,
    DrawnItem,
    hallusion_item,
    render_shape_scene,
)
from mmvsd.data.image_photos import render_vqav2, vqav2_item
from mmvsd.data.image_science import render_science_figure, scienceqa_item
from mmvsd.data.image_text import render_text_scene, textvqa_item
from mmvsd.errors import UserError
from mmvsd.files import atomic_file, jsonl_lines

SPLITS = ("train", "validation", "test")
LONG_INSTRUCTION = ("Describe the image in detail and explain your reasoning step by step "
                    "before giving the final answer.")
RECORD_FORMATS = ("json", "jsonl")

FamilyGenerator = Callable[[random.Random, int], DrawnItem]
FamilyRenderer = Callable[[dict[str, Any]], Image.Image]

FAMILIES: dict[str, FamilyGenerator] = {
    "chartqa": chartqa_item,
    "ai2d": ai2d_item,
    "textvqa": textvqa_item,
    "scienceqa": scienceqa_item,
    "vqav2": vqav2_item,
    "hallusion": hallusion_item,
}
# The image of every item is a pure function of its meta: RENDERERS[family](item.meta) redraws it.
RENDERERS: dict[str, FamilyRenderer] = {
    "chartqa": render_chart,
    "ai2d": render_ai2d,
    "textvqa": render_text_scene,
    "scienceqa": render_science_figure,
    "vqav2": render_vqav2,
    "hallusion": render_shape_scene,
}


@dataclass(frozen=True)
class ImageItem:
    """One synthetic image with its question, canonical answer and the parameters it was drawn from."""

    image: Image.Image = field(compare=False, repr=False)  # RGB; compare pixels with png_bytes()
    question: str
    answer: str  # lower-case; the option letter ("a", "b", ...) for multiple-choice families
    long_prompt: str
    family: str
    split: str
    item_id: str  # e.g. "chartqa-test-00017"
    options: tuple[str, ...]  # multiple-choice options in letter order; empty otherwise
    meta: dict[str, Any]  # JSON-serialisable drawing parameters that determine the answer
    description: str


# ----------------------------------------------------------------------------- generation


def item_rng(seed: int, family: str, split: str, index: int) -> random.Random:
    """A generator private to one item: a hash of (seed, family, split, index), stable across runs."""
    digest = hashlib.sha256(f"mmvsd.images/{seed}/{family}/{split}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


def format_question(question: str, options: tuple[str, ...]) -> str:
    """The question followed by lettered options ("A. egg") when there are any."""
    if not options:
        return question
    return question + "\n" + "\n".join(f"{LETTERS[i]}. {option}" for i, option in enumerate(options))


def long_prompt_for(question: str, options: tuple[str, ...]) -> str:
    """The question (and options) asking for a long, step-by-step answer."""
    return format_question(question, options) + ("\n" if options else " ") + LONG_INSTRUCTION


def _check_request(family: str, split: str) -> None:
    if family not in FAMILIES:
        raise UserError(f"unknown image family {family!r}; choose one of {', '.join(FAMILIES)}")
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")


def generate_item(family: str, split: str, index: int, seed: int = 0) -> ImageItem:
    """Item ``index`` of a family's split; independent of how many other items are generated."""
    _check_request(family, split)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise UserError(f"item index must be a non-negative integer, got {index!r}")
    drawn = FAMILIES[family](item_rng(seed, family, split, index), index)
    return ImageItem(image=drawn.image, question=format_question(drawn.question, drawn.options),
                     answer=drawn.answer, long_prompt=long_prompt_for(drawn.question, drawn.options),
                     family=family, split=split, item_id=f"{family}-{split}-{index:05d}",
                     options=tuple(drawn.options), meta=drawn.meta, description=drawn.description)


def generate_items(family: str, split: str, num_items: int, seed: int = 0) -> list[ImageItem]:
    """Items 0 .. num_items - 1 of a family's split, deterministic in ``seed``."""
    _check_request(family, split)
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise UserError(f"num_items must be a non-negative integer, got {num_items!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"seed must be an integer, got {seed!r}")
    return [generate_item(family, split, index, seed) for index in range(num_items)]


# ----------------------------------------------------------------------------- records and files


def png_bytes(image: Image.Image) -> bytes:
    """The PNG encoding of an image, with no metadata: identical images give identical bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def item_record(item: ImageItem, image_path: str | Path) -> dict[str, Any]:
    """A JSON-serialisable record of an item, pointing at its image by (relative) path."""
    return {"image": Path(image_path).as_posix(), "question": item.question, "answer": item.answer,
            "long_prompt": item.long_prompt, "options": list(item.options), "item_id": item.item_id,
            "family": item.family, "split": item.split, "description": item.description, "meta": item.meta}


def answer_sentence(item: ImageItem) -> str:
    """The answer as a short sentence, e.g. 'The answer is (B) tadpole.' or 'Yes.'."""
    if item.options:
        index = LETTERS.lower().index(item.answer)
        return f"The answer is ({item.answer.upper()}) {item.options[index]}."
    if item.answer in ("yes", "no"):
        return item.answer.capitalize() + "."
    return f"The answer is {item.answer}."


def _write_atomic(path: Path, payload: bytes) -> None:
    """Write to a temporary file in the same folder, then rename it over ``path``."""
    with atomic_file(path, "wb") as handle:
        handle.write(payload)


def write_items(items: Iterable[ImageItem], out_dir: Path, fmt: str = "json") -> Path:
    """Write images/<item_id>.png and <family>_<split>.<fmt> records under out_dir; return the records file."""
    items = list(items)
    if fmt not in RECORD_FORMATS:
        raise UserError(f"unknown record format {fmt!r}; choose one of {', '.join(RECORD_FORMATS)}")
    if not items:
        raise UserError("no items to write: generate at least one item first")
    groups = {(item.family, item.split) for item in items}
    if len(groups) != 1:
        raise UserError(f"write_items takes items of one family and split, got {sorted(groups)}")
    family, split = groups.pop()
    out_dir = Path(out_dir)
    try:
        (out_dir / "images").mkdir(parents=True, exist_ok=True)
        records = []
        for item in items:
            relative = Path("images") / f"{item.item_id}.png"
            _write_atomic(out_dir / relative, png_bytes(item.image))
            records.append(item_record(item, relative))
        records_path = out_dir / f"{family}_{split}.{fmt}"
        if fmt == "json":
            text = json.dumps(records, indent=1, ensure_ascii=False) + "\n"
        else:
            text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        _write_atomic(records_path, text.encode("utf-8"))
    except OSError as error:
        raise UserError(f"cannot write image items to {out_dir}: {error}") from error
    return records_path


def read_items(records_path: Path) -> list[ImageItem]:
    """Read items written by write_items (json or jsonl), loading each image as RGB."""
    records_path = Path(records_path)
    try:
        text = records_path.read_text(encoding="utf-8")
        records = json.loads(text) if records_path.suffix == ".json" else [
            json.loads(line) for line in jsonl_lines(text) if line.strip()]
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read image items from {records_path}: {error}") from error
    items = []
    for record in records:
        image_path = records_path.parent / record["image"]
        try:
            with Image.open(image_path) as image:
                rgb = image.convert("RGB")
        except (OSError, UnidentifiedImageError) as error:
            raise UserError(f"cannot read image {image_path} of item {record['item_id']}: {error}") from error
        items.append(ImageItem(image=rgb, question=record["question"], answer=record["answer"],
                               long_prompt=record["long_prompt"], family=record["family"], split=record["split"],
                               item_id=record["item_id"], options=tuple(record["options"]), meta=record["meta"],
                               description=record["description"]))
    return items
