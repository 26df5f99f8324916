"""The projector's extra questions and per-patch word targets agree with what the generator drew."""

from __future__ import annotations

import random
from collections import Counter

import torch

from mmvsd.data.images import generate_items
from mmvsd.lab.projector_questions import (
    BACKGROUND_WORD,
    PATCH_GRID,
    chart_questions,
    extra_questions,
    patch_targets,
    patch_words,
    shape_questions,
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
    assert extra_questions(generate_items("textvqa", "train", 1)[0], random.Random(0), 3) == []


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


def test_patch_targets_sum_colour_and_kind_at_the_given_norm():
    vectors = {w: torch.randn(8) for w in ("red", "circle", BACKGROUND_WORD)}
    shapes = [{"kind": "circle", "color": "red", "x": 168, "y": 168, "size": 50}]
    targets = patch_targets(shapes, vectors, norm=3.0)
    centre = 3 * PATCH_GRID + 3
    expected = vectors["red"] + vectors["circle"]
    assert torch.allclose(targets[centre], expected * 3.0 / expected.norm())
    assert torch.allclose(targets[0], vectors[BACKGROUND_WORD] * 3.0 / vectors[BACKGROUND_WORD].norm())
