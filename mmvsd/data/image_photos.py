"""Real photos for the VQAv2-style family: the sample photos that ship offline with scikit-image
(``skimage/data``) and matplotlib (``mpl-data/sample_data``), each with hand-written true
questions, answers and a caption. Each item is a random crop (90-100 % of each side) letterboxed
onto the square canvas, so no two items share image bytes, but the photos themselves repeat across
splits: filter on ``meta["source"] == "photo"`` where that matters.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

from PIL import Image

from mmvsd.data.image_families import (
    CANVAS_SIZE,
    DrawnItem,
    render_shape_scene,
    vqav2_shapes_item,
)
from mmvsd.errors import UserError

PHOTO_SHARE = 0.25  # fraction of vqav2 items that are real photos; the rest are shape scenes

# name -> (file name, package that ships it, caption, [(question, answer), ...])
PHOTOS: dict[str, tuple[str, str, str, list[tuple[str, str]]]] = {
    "astronaut": ("astronaut.png", "skimage",
                  "A portrait of a smiling astronaut in an orange spacesuit, with an American flag on the left "
                  "and a model of a space shuttle on the right.",
                  [("What color is the spacesuit?", "orange"), ("What is the person's job?", "astronaut"),
                   ("What flag is in the background?", "american"), ("Is the person smiling?", "yes"),
                   ("What kind of model is on the right?", "space shuttle")]),
    "chelsea": ("chelsea.png", "skimage", "A close-up photo of a tabby cat with green eyes and a pink nose.",
                [("What animal is in the picture?", "cat"), ("What color are the cat's eyes?", "green"),
                 ("Is the animal asleep?", "no"), ("What color is the cat's nose?", "pink")]),
    "coffee": ("coffee.png", "skimage",
               "A photo of a cup of coffee on a red saucer with a metal spoon, on a wooden table.",
               [("What drink is in the cup?", "coffee"), ("What is next to the cup on the saucer?", "spoon"),
                ("What is the table made of?", "wood"), ("How many cups are there?", "1"),
                ("What is the cup sitting on?", "saucer")]),
    "rocket": ("rocket.jpg", "skimage",
               "A photo of a white rocket on its launch pad at dusk, between tall lattice towers, with bright "
               "lights below a deep blue sky.",
               [("What is on the launch pad?", "rocket"), ("How many rockets are there?", "1"),
                ("What color is the rocket?", "white"), ("What color is the sky?", "blue"),
                ("Are the lights on?", "yes")]),
    "motorcycle": ("motorcycle_left.png", "skimage",
                   "A photo of a red motorcycle with a black seat parked inside a garage, with shelves and boxes "
                   "behind it.",
                   [("What vehicle is shown?", "motorcycle"), ("What color is the motorcycle?", "red"),
                    ("Is the motorcycle indoors or outdoors?", "indoors"),
                    ("How many wheels does the motorcycle have?", "2"), ("What color is the seat?", "black")]),
    "grace_hopper": ("grace_hopper.jpg", "matplotlib",
                     "A portrait of an older woman in a dark navy uniform and cap, wearing glasses and a white "
                     "shirt, in front of an American flag.",
                     [("Is the person wearing glasses?", "yes"), ("What is the person wearing on her head?", "hat"),
                      ("What flag is in the background?", "american"), ("What color is her shirt?", "white"),
                      ("Is the person a man or a woman?", "woman")]),
}


def photo_path(name: str) -> Path:
    """Where the installed scikit-image or matplotlib keeps a sample photo."""
    if name not in PHOTOS:
        raise UserError(f"unknown sample photo {name!r}; choose one of {', '.join(PHOTOS)}")
    file_name, package, _, _ = PHOTOS[name]
    if package == "skimage":
        import skimage  # a large package read here only for its bundled photo files: the photo items alone need it

        return Path(skimage.__file__).parent / "data" / file_name
    import matplotlib  # slow to import (~0.3 s): only its data folder is needed

    return Path(matplotlib.get_data_path()) / "sample_data" / file_name


@functools.lru_cache(maxsize=len(PHOTOS))
def load_photo(name: str) -> Image.Image:
    """The sample photo as RGB (cached; callers must not modify it)."""
    path = photo_path(name)
    if not path.is_file():
        raise UserError(f"sample photo {path} is missing: the vqav2 family needs the photos bundled with "
                        f"scikit-image and matplotlib")
    with Image.open(path) as image:
        return image.convert("RGB")


def render_photo(params: dict[str, Any]) -> Image.Image:
    """Crop the photo to ``crop`` and letterbox it onto the square canvas."""
    photo = load_photo(params["photo"])
    left, top, right, bottom = params["crop"]
    if not (0 <= left < right <= photo.width and 0 <= top < bottom <= photo.height):
        raise UserError(f"crop box {params['crop']} is outside the {photo.width}x{photo.height} photo")
    cropped = photo.crop((left, top, right, bottom))
    scale = CANVAS_SIZE / max(cropped.size)
    size = (max(1, round(cropped.width * scale)), max(1, round(cropped.height * scale)))
    canvas = Image.new("RGB", (CANVAS_SIZE, CANVAS_SIZE), tuple(params["pad_color"]))
    canvas.paste(cropped.resize(size, Image.Resampling.LANCZOS),
                 ((CANVAS_SIZE - size[0]) // 2, (CANVAS_SIZE - size[1]) // 2))
    return canvas


def photo_item(rng: random.Random) -> DrawnItem:
    """A real sample photo with one of its hand-written questions."""
    name = rng.choice(sorted(PHOTOS))
    _, _, caption, questions = PHOTOS[name]
    question_index = rng.randrange(len(questions))
    photo = load_photo(name)
    width, height = round(photo.width * rng.uniform(0.9, 1.0)), round(photo.height * rng.uniform(0.9, 1.0))
    left, top = rng.randint(0, photo.width - width), rng.randint(0, photo.height - height)
    gray = rng.randint(0, 255)
    params = {"source": "photo", "photo": name, "question_index": question_index,
              "crop": [left, top, left + width, top + height], "pad_color": [gray, gray, gray]}
    question, answer = questions[question_index]
    return DrawnItem(render_photo(params), question, answer, caption, params)


def render_vqav2(params: dict[str, Any]) -> Image.Image:
    """Render a VQAv2-style item (photo or shape scene) from its parameters."""
    return render_photo(params) if params.get("source") == "photo" else render_shape_scene(params)


def vqav2_item(rng: random.Random, index: int) -> DrawnItem:
    """A VQAv2-style item: a real sample photo a quarter of the time, otherwise a shape scene."""
    return photo_item(rng) if rng.random() < PHOTO_SHARE else vqav2_shapes_item(rng)
