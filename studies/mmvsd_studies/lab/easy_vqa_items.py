"""easy-vqa images as smol-llava items: upsampled to the tower's input size, with all their questions and
the words each of the tower's 7 x 7 patches shows (the shape's colour and kind where its pixels are, the
background elsewhere), read off the image's own pixels.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image

from mmvsd.data.images import ImageItem
from mmvsd.targets.efficientnet import IMAGE_SIZE
from mmvsd_studies.lab import easy_vqa
from mmvsd_studies.lab.projector_questions import BACKGROUND_WORD, EASY_VQA_FAMILY, PATCH_GRID

SHAPE_DISTANCE = 60  # an RGB channel this far from the background colour belongs to the shape
SHAPE_SHARE = 0.3  # a patch shows the shape when this share of its pixels does


def shape_mask(image: Image.Image) -> np.ndarray:
    """[H, W] bool: pixels that differ from the background (the most common corner colour)."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    corners = [tuple(pixels[y, x]) for y in (0, -1) for x in (0, -1)]
    background = np.array(max(set(corners), key=corners.count), dtype=np.int16)
    return np.abs(pixels - background).max(-1) > SHAPE_DISTANCE


def mask_patch_words(mask: np.ndarray, words: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Per patch of the 7 x 7 grid (row-major): `words` where the shape covers SHAPE_SHARE of it, the
    background word elsewhere; the most covered patch always shows the shape."""
    rows = np.array_split(np.arange(mask.shape[0]), PATCH_GRID)
    columns = np.array_split(np.arange(mask.shape[1]), PATCH_GRID)
    share = np.array([[mask[np.ix_(r, c)].mean() for c in columns] for r in rows]).reshape(-1)  # [49]
    shows = share >= SHAPE_SHARE
    shows[share.argmax()] = True
    return [words if s else (BACKGROUND_WORD,) for s in shows]


def easy_vqa_items(split: str, limit: int = 0, seed: int = 0) -> tuple[list[ImageItem], list[int]]:
    """(one item per image, the first `limit` images in a seeded order (0: all); ids of unreadable images,
    skipped). An item's own question is one of its image's questions, the rest are in meta["questions"]."""
    data = easy_vqa.read_split(split)
    grouped = data.by_image()
    image_ids = sorted(grouped)
    random.Random(seed).shuffle(image_ids)
    if limit:
        image_ids = image_ids[:limit]
    originals, skipped = easy_vqa.load_images(data, image_ids)
    rng = random.Random(seed)
    items = []
    for image_id in image_ids:
        if image_id not in originals:
            continue
        questions = [(q.question, q.answer) for q in grouped[image_id]]
        rng.shuffle(questions)
        color, shape = easy_vqa.shape_labels(grouped[image_id])
        words = tuple(w for w in (color, shape) if w)
        image = originals[image_id].resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
        meta = {"image_id": image_id, "questions": questions[1:],
                "patch_words": mask_patch_words(shape_mask(originals[image_id]), words) if words else None}
        items.append(ImageItem(image=image, question=questions[0][0], answer=questions[0][1], long_prompt="",
                               family=EASY_VQA_FAMILY, split=split, item_id=f"easy-vqa-{split}-{image_id:05d}",
                               options=(), meta=meta,
                               description=f"A {color} {shape} on a plain background." if color and shape else ""))
    return items, skipped
