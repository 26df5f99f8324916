"""Plain-shape items: one large shape in the generator's colours on a plain background.

The generated shape scenes draw shapes at most a quarter of the canvas wide, and easy-vqa's large shapes
come in its own palette (no purple, no orange), so without these a large purple shape reads as blue. The
projector trains on them (`plain_shape_items(..., split="train")`) and the quality benchmark asks their
test split "What color is the shape?"; the two splits come from different seeds and never share an item.
"""

from __future__ import annotations

import random

from mmvsd.data.image_families import CANVAS_SIZE, SHAPE_COLORS, SHAPE_KINDS, draw_shape, light_color, new_canvas
from mmvsd.data.images import ImageItem

PLAIN_FAMILY = "plain"
COLOR_QUESTION = "What color is the shape?"


def plain_shape_item(index: int, split: str, seed: int = 0) -> ImageItem:
    """Item `index` of a split: the colours take turns, the kind, size (40-70% of the width), position
    (near the middle) and background (white, grey or pale) are drawn from a generator seeded by all three."""
    rng = random.Random(f"plain-{split}-{seed}-{index}")
    color = list(SHAPE_COLORS)[index % len(SHAPE_COLORS)]
    kind = rng.choice(SHAPE_KINDS)
    background = rng.choice([[255, 255, 255], [200, 200, 200], light_color(rng)])
    image, draw = new_canvas(background)
    size = rng.uniform(0.4, 0.7) * CANVAS_SIZE
    x, y = (CANVAS_SIZE / 2 + rng.uniform(-0.1, 0.1) * CANVAS_SIZE for _ in range(2))
    draw_shape(draw, kind, x, y, size, SHAPE_COLORS[color])
    shape = {"kind": kind, "color": color, "x": x, "y": y, "size": size}
    return ImageItem(image=image, question=COLOR_QUESTION, answer=color, long_prompt="", family=PLAIN_FAMILY,
                     split=split, item_id=f"plain-{split}-{index:05d}", options=(),
                     meta={"background": background, "shapes": [shape]},
                     description=f"A {color} {kind} on a plain background.")


def plain_shape_items(count: int, split: str, seed: int = 0) -> list[ImageItem]:
    return [plain_shape_item(index, split, seed) for index in range(count)]
