"""Training signal for smol-llava's projector, computed from the generator's drawing parameters:
extra questions about the same image (more answers per language-model pass) and per-patch word
targets for shape scenes (the projector's cheap first stage, no language model in the loop): a shape's
colour, its kind and, away from the middle column, the side of the image it is on.

Every question and answer here uses the generator's own phrasing and is computed from ``meta``.
"""

from __future__ import annotations

import random
from collections import Counter

import torch
from torch import Tensor

from mmvsd.data.image_charts import chart_answer, chart_question
from mmvsd.data.image_families import CANVAS_SIZE, SHAPE_COLORS, SHAPE_KINDS, plural
from mmvsd.data.image_text import text_answer, text_question
from mmvsd.data.images import ImageItem
from mmvsd_studies.lab import easy_vqa

EASY_VQA_FAMILY = "easy-vqa"  # the family of items read from the easy-vqa data set (mmvsd_studies.lab.easy_vqa_items)
PATCH_GRID = 7  # the tower's 7 x 7 head map over the whole (resized, uncropped) canvas
BACKGROUND_WORD = "background"
SIDE_WORDS = ("left", "right")
ALIGN_WORDS = frozenset({*SHAPE_COLORS, *SHAPE_KINDS, *easy_vqa.COLORS, *easy_vqa.SHAPES, *SIDE_WORDS,
                         BACKGROUND_WORD})  # every word a patch target uses


def shape_questions(shapes: list[dict], rng: random.Random) -> list[tuple[str, str]]:
    """Count, colour and existence questions that the scene's shapes answer."""
    counts = Counter((s["color"], s["kind"]) for s in shapes)
    questions = [("How many shapes are there?", str(len(shapes)))]
    questions += [(f"How many {color} {plural(kind, 2)} are there?", str(n)) for (color, kind), n in counts.items()]
    for kind in SHAPE_KINDS:
        colors = {color for color, k in counts if k == kind}
        if len(colors) == 1:
            questions.append((f"What color is the {kind}?", colors.pop()))
    present = rng.choice(sorted(counts))
    absent = [(c, k) for c in SHAPE_COLORS for k in SHAPE_KINDS if (c, k) not in counts]
    questions.append((f"Is there {_article(present[0])} {present[0]} {present[1]} in the image?", "yes"))
    if absent:
        color, kind = rng.choice(absent)
        questions.append((f"Is there {_article(color)} {color} {kind} in the image?", "no"))
    return questions + side_questions(shapes)


def side_questions(shapes: list[dict]) -> list[tuple[str, str]]:
    """Which shape is on the left and on the right, asked (as the generator does) only of two shapes of
    different kinds on either side of the image's middle."""
    if len(shapes) != 2 or shapes[0]["kind"] == shapes[1]["kind"]:
        return []
    left, right = sorted(shapes, key=lambda s: s["x"])
    if not left["x"] < CANVAS_SIZE / 2 < right["x"]:
        return []
    return [("What shape is on the left?", left["kind"]), ("What shape is on the right?", right["kind"])]


def text_questions(meta: dict) -> list[tuple[str, str]]:
    """The scene's text and, where it shows one, the jersey's or the product's name."""
    asks = ["text", "name"] if meta.get("name") else ["text"]
    return [(text_question({**meta, "ask": ask}), text_answer({**meta, "ask": ask})) for ask in asks]


def chart_questions(meta: dict) -> list[tuple[str, str]]:
    """The value of every category, and the highest / lowest one."""
    asks = [{"question_type": "value", "targets": [c]} for c in meta["categories"]]
    asks += [{"question_type": "max", "targets": []}, {"question_type": "min", "targets": []}]
    return [(chart_question({**meta, **ask}), chart_answer({**meta, **ask})) for ask in asks]


def extra_questions(item: ImageItem, rng: random.Random, limit: int) -> list[tuple[str, str]]:
    """Up to `limit` more (question, answer) pairs about the item's image, other than its own question."""
    if "shapes" in item.meta:  # shape scenes and plain shapes
        pool = shape_questions(item.meta["shapes"], rng)
    elif item.family == "chartqa":
        pool = chart_questions(item.meta)
    elif item.family == "textvqa":
        pool = text_questions(item.meta)
    elif item.family == EASY_VQA_FAMILY:
        pool = list(item.meta["questions"])
    else:
        return []
    pool = [(q, a) for q, a in pool if q != item.question]
    rng.shuffle(pool)
    return pool[:limit]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def patch_words(shapes: list[dict]) -> list[tuple[str, ...]]:
    """For each of the 7 x 7 patches (row-major), the words of the shape it shows, or the background word."""
    cell = CANVAS_SIZE / PATCH_GRID
    words: list[tuple[str, ...]] = []
    for index in range(PATCH_GRID * PATCH_GRID):
        cx, cy = (index % PATCH_GRID + 0.5) * cell, (index // PATCH_GRID + 0.5) * cell
        near = [(max(abs(s["x"] - cx), abs(s["y"] - cy)), s) for s in shapes]
        near = [(d, s) for d, s in near if d <= s["size"] / 2 + cell / 4]
        if near:
            shape = min(near, key=lambda pair: pair[0])[1]
            words.append((shape["color"], shape["kind"]))
        else:
            words.append((BACKGROUND_WORD,))
    for shape in shapes:  # a shape between patch centres still gets its nearest patch
        nearest = min(range(PATCH_GRID * PATCH_GRID), key=lambda i: (i % PATCH_GRID + 0.5 - shape["x"] / cell) ** 2
                      + (i // PATCH_GRID + 0.5 - shape["y"] / cell) ** 2)
        if words[nearest] == (BACKGROUND_WORD,):
            words[nearest] = (shape["color"], shape["kind"])
    return words


def word_vectors(embeddings: Tensor, tokenizer, words: set[str]) -> dict[str, Tensor]:
    """The input embedding of each word as it appears mid-sentence (mean over its tokens)."""
    vectors = {}
    for word in words:
        ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        vectors[word] = embeddings[ids].mean(0)
    return vectors


def patch_side(index: int) -> tuple[str, ...]:
    """The side word of a patch (row-major index): left of the middle column, right of it, or none."""
    column = index % PATCH_GRID
    middle = PATCH_GRID // 2
    return () if column == middle else (SIDE_WORDS[0] if column < middle else SIDE_WORDS[1],)


def item_patch_words(item: ImageItem) -> list[tuple[str, ...]] | None:
    """The words each patch of the item's image shows (None: not known for this item)."""
    if "shapes" in item.meta:
        return patch_words(item.meta["shapes"])
    return item.meta.get("patch_words")


def patch_targets(words_per_patch: list[tuple[str, ...]], vectors: dict[str, Tensor], norm: float) -> Tensor:
    """[49, H] target embeddings: the sum of a shape's colour, kind and side words (rescaled to `norm`)."""
    rows = []
    for index, words in enumerate(words_per_patch):
        if words != (BACKGROUND_WORD,):
            words = words + patch_side(index)
        vector = torch.stack([vectors[w] for w in words]).sum(0)
        rows.append(vector * (norm / vector.norm()))
    return torch.stack(rows)
