"""The projector's extra questions and per-patch word targets agree with what the generator drew."""

from __future__ import annotations

import random
from collections import Counter

import torch

from mmvsd.data.images import generate_items
from mmvsd_studies.lab.projector_questions import (
    BACKGROUND_WORD,
    PATCH_GRID,
    chart_questions,
    extra_questions,
    patch_targets,
    patch_words,
    shape_questions,
    side_questions,
    text_questions,
)


def shape_scenes(num: int) -> list:
    items = generate_items("vqav2", "train", 3 * num) + generate_items("hallusion", "train", num)
    return [item for item in items if "shapes" in item.meta][:num]


def test_shape_questions_are_answered_by_the_drawn_shapes():
    for item in shape_scenes(20):
        shapes = item.meta["shapes"]
        counts = Counter((s["color"], s["kind"]) for s in shapes)
        for question, answer in shape_questions(shapes, random.Random(0)):
            words = question.rstrip("?").split()
            if question == "How many shapes are there?":
                assert answer == str(len(shapes))
            elif question.startswith("How many"):
                color, kind = words[2], words[3].removesuffix("s")
                assert answer == str(counts[(color, kind)])
            elif question.startswith("What color"):
                kind = words[-1]
                assert {s["color"] for s in shapes if s["kind"] == kind} == {answer}
            elif question.startswith("What shape"):
                side = words[-1]
                assert [s for s in shapes if s["kind"] == answer] == [min(shapes, key=lambda s: s["x"] * (
                    1 if side == "left" else -1))]
            else:
                color, kind = words[3], words[4]
                assert answer == ("yes" if (color, kind) in counts else "no")


def test_chart_questions_read_the_drawn_values():
    for item in generate_items("chartqa", "train", 10):
        values = dict(zip(item.meta["categories"], item.meta["values"]))
        pairs = chart_questions(item.meta)
        assert len(pairs) == len(values) + 2
        for category, value in values.items():
            matching = [a for q, a in pairs if f" {category} " in q or q.endswith(f" {category}?")]
            assert matching and float(matching[0]) == value


def test_extra_questions_skip_the_items_own_question():
    for item in shape_scenes(10) + generate_items("chartqa", "train", 5):
        extras = extra_questions(item, random.Random(1), 3)
        assert 0 < len(extras) <= 3 and item.question not in [q for q, _ in extras]


def test_side_questions_only_for_two_shapes_of_different_kinds_either_side_of_the_middle():
    circle = {"kind": "circle", "color": "red", "x": 60, "y": 100, "size": 40}
    square = {"kind": "square", "color": "blue", "x": 280, "y": 90, "size": 40}
    assert side_questions([square, circle]) == [("What shape is on the left?", "circle"),
                                                ("What shape is on the right?", "square")]
    assert side_questions([circle, {**square, "x": 120}]) == []  # both on the left
    assert side_questions([circle, {**circle, "x": 280}]) == []  # same kind
    assert side_questions([circle, square, {**square, "kind": "triangle", "x": 170}]) == []
    side_items = [i for i in generate_items("vqav2", "train", 80) if i.meta.get("question_type") == "side"]
    assert side_items
    for item in side_items:  # the generator's own side question is among them, with its answer
        assert (item.question, item.answer) in side_questions(item.meta["shapes"])


def test_text_questions_read_the_drawn_text_and_name():
    items = generate_items("textvqa", "train", 60)
    for item in items:
        pairs = dict(text_questions(item.meta))
        assert pairs[item.question] == item.answer
        assert len(pairs) == (2 if item.meta["name"] else 1)
        if item.meta["scene"] == "price_tag":
            assert pairs["What product is the price tag for?"] == item.meta["name"].lower()
            assert pairs["What is the price on the tag?"] == item.meta["text"].lower()
    with_name = next(i for i in items if i.meta["name"])
    assert extra_questions(with_name, random.Random(0), 3) == [
        pair for pair in text_questions(with_name.meta) if pair[0] != with_name.question]


def test_every_shape_owns_a_patch_and_the_rest_is_background():
    for item in shape_scenes(20):
        words = patch_words(item.meta["shapes"])
        assert len(words) == PATCH_GRID * PATCH_GRID
        drawn = {(s["color"], s["kind"]) for s in item.meta["shapes"]}
        assert {w for w in words if w != (BACKGROUND_WORD,)} == drawn
        cell = 336 / PATCH_GRID
        for shape in item.meta["shapes"]:  # the patch under the shape's centre shows it
            index = int(shape["y"] // cell) * PATCH_GRID + int(shape["x"] // cell)
            assert words[index] != (BACKGROUND_WORD,)


def test_patch_targets_sum_colour_kind_and_side_at_the_given_norm():
    vectors = {w: torch.randn(8) for w in ("red", "circle", "blue", "square", "left", "right", BACKGROUND_WORD)}
    shapes = [{"kind": "circle", "color": "red", "x": 168, "y": 168, "size": 50},  # middle column: no side
              {"kind": "square", "color": "blue", "x": 24, "y": 24, "size": 30}]  # top-left patch
    targets = patch_targets(patch_words(shapes), vectors, norm=3.0)
    centre = 3 * PATCH_GRID + 3
    expected = vectors["red"] + vectors["circle"]
    assert torch.allclose(targets[centre], expected * 3.0 / expected.norm())
    expected = vectors["blue"] + vectors["square"] + vectors["left"]
    assert torch.allclose(targets[0], expected * 3.0 / expected.norm())
    last = PATCH_GRID * PATCH_GRID - 1
    assert torch.allclose(targets[last], vectors[BACKGROUND_WORD] * 3.0 / vectors[BACKGROUND_WORD].norm())
    # top-right patch
    shifted = patch_targets(patch_words([{**shapes[1], "x": 336 - 24}]), vectors, norm=3.0)[PATCH_GRID - 1]
    expected = vectors["blue"] + vectors["square"] + vectors["right"]
    assert torch.allclose(shifted, expected * 3.0 / expected.norm())
