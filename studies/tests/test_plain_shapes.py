"""Plain-shape items: one large shape where meta says, in each generator colour in turn, train and test
splits that never share an image, and questions and patch words that the drawn shape answers."""

from __future__ import annotations

import random

import numpy as np

from mmvsd.data.image_families import CANVAS_SIZE, SHAPE_COLORS
from mmvsd_studies.lab.plain_shapes import COLOR_QUESTION, plain_shape_item, plain_shape_items
from mmvsd_studies.lab.projector_questions import BACKGROUND_WORD, PATCH_GRID, extra_questions, item_patch_words


def test_one_large_shape_of_each_colour_in_turn_drawn_where_meta_says():
    items = plain_shape_items(12, "train")
    assert [item.answer for item in items] == list(SHAPE_COLORS) * 2
    for item in items:
        (shape,) = item.meta["shapes"]
        assert item.question == COLOR_QUESTION and shape["color"] == item.answer
        assert 0.4 * CANVAS_SIZE <= shape["size"] <= 0.7 * CANVAS_SIZE
        pixels = np.asarray(item.image)
        assert tuple(pixels[round(shape["y"]), round(shape["x"])]) == SHAPE_COLORS[item.answer]
        assert tuple(pixels[0, 0]) == tuple(item.meta["background"])
        covered = (np.abs(pixels.astype(int) - pixels[0, 0]).max(-1) > 0).mean()
        assert covered > 0.08  # large: a quarter-width shape of the shape scenes covers at most about 6%


def test_splits_and_seeds_never_share_an_image_and_are_deterministic():
    train, test = plain_shape_items(6, "train"), plain_shape_items(6, "test")
    for a, b in zip(train, test):
        assert a.item_id != b.item_id and a.image.tobytes() != b.image.tobytes()
    again = plain_shape_item(3, "train")
    assert again.image.tobytes() == train[3].image.tobytes() and again.meta == train[3].meta
    assert plain_shape_item(3, "train", seed=1).image.tobytes() != train[3].image.tobytes()


def test_questions_and_patch_words_come_from_the_drawn_shape():
    for item in plain_shape_items(6, "train"):
        (shape,) = item.meta["shapes"]
        questions = dict(extra_questions(item, random.Random(0), 20))
        assert questions["How many shapes are there?"] == "1"
        assert questions[f"What color is the {shape['kind']}?"] == shape["color"]
        words = item_patch_words(item)
        centre = (PATCH_GRID // 2) * PATCH_GRID + PATCH_GRID // 2
        assert words[centre] == (shape["color"], shape["kind"]) and words[0] == (BACKGROUND_WORD,)
