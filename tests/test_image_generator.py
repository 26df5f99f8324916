"""Synthetic image QA generator: determinism, split disjointness, answers recomputed from meta and
checked against pixels, file round trips, the LLaVA record format and user errors."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from mmvsd.data.image_families import CANVAS_SIZE, SHAPE_COLORS
from mmvsd.data.image_photos import PHOTOS
from mmvsd.data.images import (
    FAMILIES,
    RENDERERS,
    SPLITS,
    ImageItem,
    answer_sentence,
    generate_item,
    generate_items,
    item_record,
    png_bytes,
    read_items,
    write_items,
)
from mmvsd.errors import UserError

NUM_ITEMS = 40
LETTERS = "abcd"


@pytest.fixture(scope="module")
def items_by_family() -> dict[str, list]:
    return {family: generate_items(family, "test", NUM_ITEMS, seed=0) for family in FAMILIES}


def _pixels(item) -> np.ndarray:
    return np.asarray(item.image)


def _chosen(item) -> str:
    """The option text that the letter answer points at."""
    return item.options[LETTERS.index(item.answer)]


def test_registry_has_the_six_benchmark_families():
    assert set(FAMILIES) == {"chartqa", "ai2d", "textvqa", "scienceqa", "vqav2", "hallusion"}
    assert SPLITS == ("train", "validation", "test")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_seed_gives_identical_bytes_and_records(family):
    first, second = generate_items(family, "validation", 10, seed=3), generate_items(family, "validation", 10, seed=3)
    assert [png_bytes(i.image) for i in first] == [png_bytes(i.image) for i in second]
    assert [item_record(i, "x.png") for i in first] == [item_record(i, "x.png") for i in second]
    other = generate_items(family, "validation", 10, seed=4)
    assert all(a.image.tobytes() != b.image.tobytes() for a, b in zip(first, other))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_item_does_not_depend_on_how_many_are_asked_for(family):
    short, long = generate_items(family, "train", 3, seed=1), generate_items(family, "train", 9, seed=1)
    assert [png_bytes(i.image) for i in short] == [png_bytes(i.image) for i in long[:3]]
    assert long[7] == generate_item(family, "train", 7, seed=1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_splits_share_no_items(family):
    by_split = {split: generate_items(family, split, 30, seed=0) for split in SPLITS}
    for a, b in [("train", "test"), ("train", "validation"), ("validation", "test")]:
        assert not {i.item_id for i in by_split[a]} & {i.item_id for i in by_split[b]}
        assert not {i.image.tobytes() for i in by_split[a]} & {i.image.tobytes() for i in by_split[b]}
    assert len({i.image.tobytes() for i in by_split["train"]}) == 30


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_item_fields_are_well_formed(family, items_by_family):
    items = items_by_family[family]
    for index, item in enumerate(items):
        assert item.item_id == f"{family}-test-{index:05d}" and item.family == family and item.split == "test"
        assert item.image.mode == "RGB" and item.image.size == (CANVAS_SIZE, CANVAS_SIZE)
        assert item.answer and item.answer == item.answer.strip().lower()
        assert item.long_prompt.startswith(item.question) and "step by step" in item.long_prompt
        assert len(item.description) > 20
        json.dumps(item.meta)  # JSON-serialisable
        if family in ("ai2d", "scienceqa"):
            assert 2 <= len(item.options) <= 4 and item.answer in LETTERS[:len(item.options)]
            assert re.search(r"\nA\. .+\nB\. ", item.question)
        else:
            assert item.options == ()
    # answers vary: a generator stuck on one answer (or one letter) fails here
    assert len(Counter(i.answer for i in items)) >= (3 if family != "hallusion" else 2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_meta_redraws_the_same_image(family, items_by_family):
    for item in items_by_family[family][:15]:
        assert png_bytes(render_meta(family, json.loads(json.dumps(item.meta)))) == png_bytes(item.image)


# ----------------------------------------------------------------------------- answers from meta and pixels


def _bar_areas(item) -> list[int]:
    """Pixel area of each bar, in axis order, found from the bar colour alone."""
    mask = (_pixels(item) == np.array(item.meta["colors"][0])).all(axis=2)
    vertical = item.meta["orientation"] == "vertical"
    present = mask.any(axis=0) if vertical else mask.any(axis=1)
    labels, count = ndimage.label(present)
    return [int((mask[:, labels == k] if vertical else mask[labels == k, :]).sum()) for k in range(1, count + 1)]


def test_chartqa_answers_follow_values_and_bar_sizes(items_by_family):
    checked_bars = 0
    for item in items_by_family["chartqa"]:
        meta = item.meta
        value = dict(zip(meta["categories"], meta["values"]))
        targets = meta["targets"]
        expected = {"max": max(value, key=value.get).lower(), "min": min(value, key=value.get).lower(),
                    "value": str(value[targets[0]]) if targets else None,
                    "diff": str(abs(value[targets[0]] - value[targets[-1]])) if targets else None,
                    "sum": str(value[targets[0]] + value[targets[-1]]) if targets else None}[meta["question_type"]]
        assert item.answer == expected
        assert all(target in item.question for target in targets)
        if meta["chart_type"] == "pie":
            assert sum(meta["values"]) == 100
        if meta["chart_type"] == "bar":  # bar areas (pixels) rank exactly as the values do
            areas = _bar_areas(item)
            assert len(areas) == len(meta["values"])
            assert np.argsort(areas).tolist() == np.argsort(meta["values"]).tolist()
            checked_bars += 1
    assert checked_bars >= 5


def test_pie_largest_slice_has_most_pixels(items_by_family):
    candidates = items_by_family["chartqa"] + generate_items("chartqa", "train", 40)
    pies = [i for i in candidates if i.meta["chart_type"] == "pie"]
    assert len(pies) >= 5
    for item in pies:
        colors = item.meta["colors"][:len(item.meta["values"])]
        areas = [(_pixels(item) == np.array(c)).all(axis=2).sum() for c in colors]
        assert int(np.argmax(areas)) == int(np.argmax(item.meta["values"]))


def test_ai2d_letter_answers_point_at_the_drawn_fact(items_by_family):
    kinds = Counter()
    for item in items_by_family["ai2d"] + generate_items("ai2d", "train", 40):
        meta, qtype = item.meta, item.meta["question_type"]
        kinds[qtype] += 1
        if qtype in ("after", "before"):
            stages = meta["stages"]
            step = 1 if qtype == "after" else -1
            assert _chosen(item) == stages[(stages.index(meta["target"]) + step) % len(stages)]
        elif qtype == "count":
            assert _chosen(item) == str(len(meta["stages"]))
        elif qtype == "part_of_number":
            assert _chosen(item) == meta["target"] and f"labelled {meta['labels'][meta['target']]}?" in item.question
        else:
            assert _chosen(item) == str(meta["labels"][meta["target"]])
        assert len(set(item.options)) == len(item.options)
    assert len(kinds) == 5


def test_textvqa_answer_is_the_written_text(items_by_family):
    for item in items_by_family["textvqa"]:
        meta = item.meta
        written = meta["name"] if meta["ask"] == "name" else meta["text"]
        assert item.answer == written.lower() and meta["text"] in item.description


def test_scienceqa_answers_follow_physics_arrows_and_pixels(items_by_family):
    figures = Counter()
    for item in items_by_family["scienceqa"] + generate_items("scienceqa", "train", 40):
        meta = item.meta
        figures[meta["figure"]] += 1
        if meta["figure"] == "magnets":
            same = meta["left"][1] == meta["right"][0]
            assert _chosen(item) == ("repel" if same else "attract")
        elif meta["figure"] == "balance":
            rows = {side: np.nonzero((_pixels(item) == SHAPE_COLORS[meta[f"{side}_color"]]).all(axis=2))[0].mean()
                    for side in ("left", "right")}
            heavier = max(rows, key=rows.get)  # the heavier block hangs lower (larger row index)
            assert _chosen(item) == f"the {meta[f'{heavier}_color']} block"
        elif meta["figure"] == "particles":
            assert _chosen(item) == meta["state"]
            gaps = [np.hypot(a[0] - b[0], a[1] - b[1]) for i, a in enumerate(meta["particles"])
                    for b in meta["particles"][i + 1:]]
            assert min(gaps) >= (3.5 if meta["state"] == "gas" else 2) * meta["radius"]
        else:
            chain, target = meta["chain"], meta["target"]
            expected = {"producer": chain[0], "top": chain[-1]}.get(meta["question_type"])
            if meta["question_type"] == "eats":
                expected = chain[chain.index(target) - 1]
            elif meta["question_type"] == "eaten_by":
                expected = chain[chain.index(target) + 1]
            assert _chosen(item) == expected
    assert set(figures) == {"magnets", "balance", "particles", "food_chain"}


def _check_shapes_on_pixels(item) -> None:
    """Each shape's centre has its colour, and each colour has as many blobs as shapes."""
    pixels = _pixels(item)
    for shape in item.meta["shapes"]:
        assert tuple(pixels[shape["y"], shape["x"]]) == SHAPE_COLORS[shape["color"]]
    for color, count in Counter(s["color"] for s in item.meta["shapes"]).items():
        assert ndimage.label((pixels == SHAPE_COLORS[color]).all(axis=2))[1] == count


def test_vqav2_answers_match_shapes_and_photos(items_by_family):
    sources = Counter()
    for item in items_by_family["vqav2"] + generate_items("vqav2", "train", 40):
        meta = item.meta
        sources[meta.get("question_type", meta["source"])] += 1
        if meta["source"] == "photo":
            assert (item.question, item.answer) == PHOTOS[meta["photo"]][3][meta["question_index"]]
            continue
        _check_shapes_on_pixels(item)
        shapes, target = meta["shapes"], meta["target"]
        if meta["question_type"] == "count":
            assert int(item.answer) == sum(s["color"] == target["color"] and s["kind"] == target["kind"]
                                           for s in shapes)
        elif meta["question_type"] == "count_all":
            assert int(item.answer) == len(shapes)
        elif meta["question_type"] == "color":
            (only,) = [s for s in shapes if s["kind"] == target["kind"]]
            assert item.answer == only["color"]
            assert tuple(_pixels(item)[only["y"], only["x"]]) == SHAPE_COLORS[item.answer]
        else:
            pick = min if target["side"] == "left" else max
            assert item.answer == pick(shapes, key=lambda s: s["x"])["kind"]
    assert set(sources) == {"photo", "count", "count_all", "color", "side"}


def test_hallusion_is_balanced_and_answers_match_the_scene():
    items = generate_items("hallusion", "test", 100, seed=5)
    answers = Counter(item.answer for item in items)
    assert set(answers) == {"yes", "no"} and 40 <= answers["yes"] <= 60
    for item in items:
        _check_shapes_on_pixels(item)
        query = item.meta["query"]
        present = any(s["kind"] == query["kind"] and query["color"] in (None, s["color"]) for s in item.meta["shapes"])
        assert item.answer == ("yes" if present else "no")
        assert query["kind"] in item.question and (query["color"] is None or query["color"] in item.question)


# ----------------------------------------------------------------------------- files and formats


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_write_items_round_trips(tmp_path, fmt):
    items = generate_items("ai2d", "validation", 5, seed=2)
    path = write_items(items, tmp_path, fmt=fmt)
    assert path == tmp_path / f"ai2d_validation.{fmt}"
    text = path.read_text()
    records = json.loads(text) if fmt == "json" else [json.loads(line) for line in text.splitlines()]
    assert [r["image"] for r in records] == [f"images/ai2d-validation-0000{i}.png" for i in range(5)]
    keys = {"image", "question", "answer", "long_prompt", "options", "item_id", "description", "meta"}
    assert keys <= set(records[0])
    assert (tmp_path / records[0]["image"]).read_bytes() == png_bytes(items[0].image)
    again = read_items(path)
    assert again == items
    assert [png_bytes(i.image) for i in again] == [png_bytes(i.image) for i in items]
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]
    assert not leftovers


def test_to_llava_instruct_format():
    mc = generate_item("scienceqa", "train", 0)
    record = to_llava_instruct(mc, "images/scienceqa-train-00000.png")
    assert record["id"] == "scienceqa-train-00000" and record["image"] == "images/scienceqa-train-00000.png"
    human, gpt = record["conversations"]
    assert human == {"from": "human", "value": "<image>\n" + mc.question}
    assert gpt["from"] == "gpt" and f"({mc.answer.upper()}) {_chosen(mc)}" in gpt["value"]
    short = next(i for i in generate_items("textvqa", "train", 5))
    assert to_llava_instruct(short, "a.png")["conversations"][1]["value"] == f"The answer is {short.answer}."
    yes_no = generate_item("hallusion", "train", 0)
    assert to_llava_instruct(yes_no, "b.png")["conversations"][1]["value"] == yes_no.answer.capitalize() + "."


def test_bad_input_raises_user_error(tmp_path):
    with pytest.raises(UserError, match="chartqa.*hallusion"):
        generate_items("coco", "test", 1)
    with pytest.raises(UserError, match="split"):
        generate_items("ai2d", "dev", 1)
    with pytest.raises(UserError, match="num_items"):
        generate_items("ai2d", "test", -1)
    assert generate_items("ai2d", "test", 0) == []
    with pytest.raises(UserError, match="no items"):
        write_items([], tmp_path)
    with pytest.raises(UserError, match="format"):
        write_items(generate_items("ai2d", "test", 1), tmp_path, fmt="csv")
    mixed = generate_items("ai2d", "test", 1) + generate_items("vqav2", "test", 1)
    with pytest.raises(UserError, match="one family"):
        write_items(mixed, tmp_path)
    with pytest.raises(UserError, match="cannot read"):
        read_items(tmp_path / "missing.json")


def test_chart_renderer_rejects_undrawable_parameters():
    good = generate_item("chartqa", "test", 0).meta
    for change, message in [({"categories": [], "values": []}, "at least one category"),
                            ({"values": [-5] + good["values"][1:]}, "non-negative"),
                            ({"values": good["values"][:-1]}, "values for"),
                            ({"chart_type": "radar"}, "chart type"),
                            ({"categories": [f"c{i}" for i in range(9)], "values": [1] * 9}, "at most")]:
        with pytest.raises(UserError, match=message):
            render_meta("chartqa", {**good, **change})


# test-only helpers: redraw an item from its meta; an item as a LLaVA-Instruct record


def render_meta(family: str, meta: dict[str, Any]) -> Image.Image:
    """Redraw an item's image from its meta (the renderers check the parameters)."""
    return RENDERERS[family](meta)


def to_llava_instruct(item: ImageItem, image_path: str | Path) -> dict[str, Any]:
    """A LLaVA-Instruct conversation record: the question with an <image> token, and the answer."""
    return {"id": item.item_id, "image": Path(image_path).as_posix(),
            "conversations": [{"from": "human", "value": "<image>\n" + item.question},
                              {"from": "gpt", "value": answer_sentence(item)}]}
