"""The lab's easy-vqa training items for smol-llava: patch words from the shapes' pixels, every question of an
image on its item (the reader itself: tests/test_easy_vqa.py)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from mmvsd_studies.lab.easy_vqa import read_split
from mmvsd_studies.lab.easy_vqa_items import easy_vqa_items, mask_patch_words, shape_mask
from mmvsd_studies.lab.projector_questions import BACKGROUND_WORD, extra_questions, item_patch_words


def test_patch_words_follow_the_shapes_pixels():
    image = Image.new("RGB", (64, 64), (240, 235, 230))
    ImageDraw.Draw(image).rectangle((40, 0, 63, 20), fill=(0, 128, 128))  # top-right corner
    mask = shape_mask(image)
    assert mask.sum() == 24 * 21
    words = mask_patch_words(mask, ("teal", "rectangle"))
    shows = np.array([w != (BACKGROUND_WORD,) for w in words]).reshape(7, 7)
    assert shows[:2, 4:].all() and shows.sum() == 6  # the 2 x 3 cells (9-10 px) it covers by at least 30%
    assert {w for w in words if w != (BACKGROUND_WORD,)} == {("teal", "rectangle")}


def test_items_carry_every_question_of_their_image():
    test_split = read_split("test")
    items, skipped = easy_vqa_items("test", limit=5, seed=3)
    assert len(items) == 5 and skipped == []
    grouped = test_split.by_image()
    for item in items:
        image_id = item.meta["image_id"]
        asked = [(item.question, item.answer), *map(tuple, item.meta["questions"])]
        assert sorted(asked) == sorted((q.question, q.answer) for q in grouped[image_id])
        assert item.image.size == (224, 224)
        assert sorted(extra_questions(item, random.Random(0), 50)) == sorted(asked[1:])
        words = item_patch_words(item)
        assert words is None or (len(words) == 49 and any(w != (BACKGROUND_WORD,) for w in words))
    assert easy_vqa_items("test", limit=5, seed=3)[0][0].item_id == items[0].item_id  # seeded order
    assert Path(test_split.image_paths[items[0].meta["image_id"]]).is_file()
