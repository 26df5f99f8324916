"""The easy-vqa reader (counts, answers, images, labels, bad input); its smol-llava training items are the
lab's (studies/tests/test_easy_vqa_items.py)."""

from __future__ import annotations

import sys

import pytest
from PIL import Image

from mmvsd.errors import UserError
from mmvsd_studies.lab import easy_vqa
from mmvsd_studies.lab.easy_vqa import EasyVqaQuestion, EasyVqaSplit, load_images, read_split, shape_labels


@pytest.fixture(scope="module")
def splits() -> dict[str, EasyVqaSplit]:
    return {name: read_split(name) for name in easy_vqa.SPLITS}


def test_counts_answers_and_image_paths(splits):
    train, test = splits["train"], splits["test"]
    assert (len(train.questions), len(test.questions)) == (38_575, 9_673)
    assert (len(train.image_paths), len(test.image_paths)) == (4_000, 1_000)
    assert set(train.answers) == {*easy_vqa.COLORS, *easy_vqa.SHAPES, "yes", "no"} and len(train.answers) == 13
    assert {q.answer for q in test.questions} == set(test.answers)
    assert set(train.by_image()) == set(train.image_paths)
    assert sum(len(v) for v in test.by_image().values()) == len(test.questions)
    assert all(path.suffix == ".png" and path.is_file() for path in list(test.image_paths.values())[:20])


def test_labels_agree_with_every_answer_of_their_image(splits):
    """The colour and shape read off an image's answers never contradict any other answer about it."""
    labelled = 0
    for questions in splits["test"].by_image().values():
        color, shape = shape_labels(questions)
        labelled += bool(color and shape)
        for q in questions:
            named = [w for w in q.question.rstrip("?").split() if w in easy_vqa.COLORS or w in easy_vqa.SHAPES]
            if q.answer in easy_vqa.COLORS:
                assert q.answer == color
            elif q.answer in easy_vqa.SHAPES:
                assert q.answer == shape
            elif len(named) == 1 and color and shape:
                negated = " not " in q.question or q.question.startswith("is no ")
                assert (q.answer == "yes") == ((named[0] in (color, shape)) != negated), q
    assert labelled > 700


def test_labels_from_yes_no_questions():
    questions = [EasyVqaQuestion("is there not a red shape?", "no", 1),
                 EasyVqaQuestion("does the image contain a circle?", "yes", 1),
                 EasyVqaQuestion("is there a blue shape?", "no", 1)]
    assert shape_labels(questions) == ("red", "circle")
    assert shape_labels([EasyVqaQuestion("is there a blue shape?", "no", 1)]) == (None, None)


def test_unreadable_images_are_skipped_and_counted(tmp_path, splits):
    good, bad = tmp_path / "1.png", tmp_path / "2.png"
    Image.new("RGB", (64, 64), (255, 0, 0)).save(good)
    bad.write_bytes(b"not a png")
    split = EasyVqaSplit("test", (), {1: good, 2: bad, 3: tmp_path / "missing.png"}, splits["test"].answers)
    images, skipped = load_images(split, [1, 2, 3, 4], size=224)
    assert list(images) == [1] and images[1].size == (224, 224) and images[1].mode == "RGB"
    assert skipped == [2, 3, 4]


def test_missing_package_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "easy_vqa", None)  # import easy_vqa now raises ImportError
    with pytest.raises(UserError, match="easy-vqa"):
        read_split("train")


def test_unknown_split():
    with pytest.raises(UserError, match="train, test"):
        read_split("validation")
