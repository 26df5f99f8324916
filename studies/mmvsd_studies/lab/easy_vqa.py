"""easy-vqa (the `easy-vqa` wheel, MIT): 64 x 64 images of one coloured shape with short questions over 13 answers.

4,000 train and 1,000 test images; 38,575 and 9,673 question-answer pairs. The wheel reads its own files
(`get_train_questions()` returns (texts, answers, image ids)); this module gives them as records,
groups them by image, names each image's colour and shape from its answers, and loads the images with
unreadable ones skipped and counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from PIL import Image, UnidentifiedImageError

from mmvsd.errors import UserError

PACKAGE = "easy-vqa"
INSTALL_HINT = "pip install easy-vqa==1.0"
SPLITS = ("train", "test")
COLORS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
SHAPES = ("circle", "rectangle", "triangle")
NEGATIONS = (" not ", "is no ")  # "is there not a circle?", "is no rectangle present?"


@dataclass(frozen=True)
class EasyVqaQuestion:
    question: str  # lower case, as the data set writes it: "what color is the shape?"
    answer: str  # one of the 13 answers
    image_id: int


@dataclass(frozen=True)
class EasyVqaSplit:
    name: str  # "train" or "test"
    questions: tuple[EasyVqaQuestion, ...]
    image_paths: dict[int, Path]
    answers: tuple[str, ...]  # the answer vocabulary

    def by_image(self) -> dict[int, list[EasyVqaQuestion]]:
        """Questions of each image, in the data set's order."""
        grouped: dict[int, list[EasyVqaQuestion]] = defaultdict(list)
        for question in self.questions:
            grouped[question.image_id].append(question)
        return dict(grouped)


def easy_vqa_package() -> ModuleType:
    try:
        import easy_vqa  # optional data package: only the runs that ask for easy-vqa need it
    except ImportError:
        raise UserError(f"easy-vqa data needs the {PACKAGE!r} package: {INSTALL_HINT}") from None
    return easy_vqa


def read_split(split: str) -> EasyVqaSplit:
    """Questions, image paths and answer vocabulary of one split."""
    if split not in SPLITS:
        raise UserError(f"unknown easy-vqa split {split!r}; choose one of {', '.join(SPLITS)}")
    package = easy_vqa_package()
    texts, answers, image_ids = getattr(package, f"get_{split}_questions")()
    paths = getattr(package, f"get_{split}_image_paths")()
    questions = tuple(EasyVqaQuestion(t, a, int(i)) for t, a, i in zip(texts, answers, image_ids, strict=True))
    return EasyVqaSplit(split, questions, {int(k): Path(v) for k, v in paths.items()}, tuple(package.get_answers()))


def load_images(split: EasyVqaSplit, image_ids: list[int], size: int | None = None
                ) -> tuple[dict[int, Image.Image], list[int]]:
    """(RGB images, resized to size x size if given; ids of the images that could not be read: skipped)."""
    images, skipped = {}, []
    for image_id in image_ids:
        try:
            with Image.open(split.image_paths[image_id]) as image:
                image = image.convert("RGB")
                images[image_id] = image.resize((size, size), Image.Resampling.BICUBIC) if size else image
        except (KeyError, OSError, UnidentifiedImageError, ValueError):
            skipped.append(image_id)
    return images, skipped


def shape_labels(questions: list[EasyVqaQuestion]) -> tuple[str | None, str | None]:
    """(colour, shape) of an image as its answers name them (None where none does): an answer that is a
    colour or a shape, or the colour or shape in a question answered so that it is present."""
    found: dict[str, str] = {}
    for q in questions:
        words = q.question.rstrip("?").split()
        negated = any(n in f" {q.question} " for n in NEGATIONS)
        named = [w for w in words if w in COLORS or w in SHAPES]
        if q.answer in COLORS or q.answer in SHAPES:
            found.setdefault("color" if q.answer in COLORS else "shape", q.answer)
        elif q.answer in ("yes", "no") and (q.answer == "yes") != negated and len(named) == 1:
            found.setdefault("color" if named[0] in COLORS else "shape", named[0])
    return found.get("color"), found.get("shape")
