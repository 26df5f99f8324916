"""Does the image drive smol-llava's answers? Short factual questions on held-out generated images
(validation split), answered by smol-llava with the image and by the same model (its language model
with the trained adapters merged) without it: the baseline knows the one-word answer format, so it
scores what guessing from the question alone gives.

Kinds: colour and shape (which shape is on a side) and count on shape scenes, chart value (the value
of a named bar, point or slice), word (text on signs, plaques, jerseys and tags), plain colour (the
colour of one large shape on a plain background, asked "What color is the shape?": the test split of
`mmvsd_studies.lab.plain_shapes`, whose train split the projector sees), and easy-vqa: a
fixed seeded sample of the easy-vqa test questions (real held-out data; also split into colour, shape
and yes/no questions), with the majority-answer rate of the sample and, per kind, the question prior:
how often the train split's most common answer to the same question text is right, the best a model
that cannot see can do. Greedy decoding,
the short-answer instruction the projector was trained with; an answer is right when lmms-eval's
VQA answer normalisation of the reply equals the reference or starts with it.

    python -m mmvsd_studies.smol_llava_quality [--projector DIR] [--per-kind 40] [--easy-vqa 2000]

Writes studies/results/smol_llava_quality.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mmvsd.data.images import ImageItem, generate_item
from mmvsd.targets.efficientnet import IMAGE_SIZE
from mmvsd.targets.smol_llava import (
    SHIPPED_PROJECTOR_DIR,
    install_projector,
    load_projector,
    new_smol_llava,
    projector_dir,
    read_manifest,
)
from mmvsd_studies import RESULTS_DIR
from mmvsd_studies.lab import easy_vqa
from mmvsd_studies.lab.plain_shapes import plain_shape_items
from mmvsd_studies.lab.short_answers import is_right, short_answers

OWN_KINDS = ("colour", "shape", "count", "chart value", "word")  # "all": the project's own quality benchmark
KINDS = (*OWN_KINDS, "plain colour")  # per-kind items each
EASY_VQA_KINDS = ("easy-vqa colour", "easy-vqa shape", "easy-vqa yes/no")


def question_kind(item: ImageItem) -> str | None:
    """Which checked kind a generated item is (None: not one of the short factual kinds)."""
    meta = item.meta
    if item.family == "vqav2" and meta.get("source") == "shapes":
        return {"color": "colour", "side": "shape", "count": "count", "count_all": "count"}.get(meta["question_type"])
    if item.family == "chartqa" and meta.get("question_type") == "value":
        return "chart value"
    if item.family == "textvqa":
        return "word"
    return None


def held_out_items(per_kind: int, seed: int = 0) -> list[tuple[str, ImageItem]]:
    """The first `per_kind` validation items of each kind."""
    picked: dict[str, list[ImageItem]] = {kind: [] for kind in KINDS}
    for family in ("vqav2", "chartqa", "textvqa"):
        index = 0
        while index < 20 * per_kind and any(len(picked[k]) < per_kind for k in KINDS):
            item = generate_item(family, "validation", index, seed)
            kind = question_kind(item)
            if kind and len(picked[kind]) < per_kind:
                picked[kind].append(item)
            index += 1
    picked["plain colour"] = plain_shape_items(per_kind, "test", seed)
    return [(kind, item) for kind in KINDS for item in picked[kind]]


def easy_vqa_kind(question: easy_vqa.EasyVqaQuestion) -> str:
    if question.answer in easy_vqa.COLORS:
        return EASY_VQA_KINDS[0]
    return EASY_VQA_KINDS[1] if question.answer in easy_vqa.SHAPES else EASY_VQA_KINDS[2]


def easy_vqa_test_items(count: int, seed: int = 0) -> tuple[list[tuple[str, ImageItem]], int, float]:
    """(a seeded sample of `count` easy-vqa test questions (0: all) as (kind, item), images upsampled to the
    tower's input size; unreadable images skipped; the majority answer's share of the sample)."""
    data = easy_vqa.read_split("test")
    questions = list(data.questions)
    if count:
        questions = random.Random(seed).sample(questions, min(count, len(questions)))
    images, skipped = easy_vqa.load_images(data, sorted({q.image_id for q in questions}), IMAGE_SIZE)
    questions = [q for q in questions if q.image_id in images]
    items = [(easy_vqa_kind(q), ImageItem(image=images[q.image_id], question=q.question, answer=q.answer,
                                          long_prompt="", family="easy-vqa", split="test",
                                          item_id=f"easy-vqa-test-{q.image_id:05d}", options=(), meta={},
                                          description="")) for q in questions]
    majority = Counter(q.answer for q in questions).most_common(1)[0][1] / max(1, len(questions))
    return items, len(skipped), majority


def question_prior_rates(items: list[tuple[str, ImageItem]]) -> dict[str, float]:
    """What the question alone can give: per kind (and "easy-vqa" in all), the share of test questions whose
    answer is the train split's most common answer to the same question text (the most common train answer
    for a text never seen in train)."""
    by_text: dict[str, Counter] = {}
    for question in easy_vqa.read_split("train").questions:
        by_text.setdefault(question.question, Counter())[question.answer] += 1
    overall = sum(by_text.values(), Counter()).most_common(1)[0][0]
    right: dict[str, list[bool]] = {"easy-vqa": []}
    for kind, item in items:
        guess = by_text[item.question].most_common(1)[0][0] if item.question in by_text else overall
        right.setdefault(kind, []).append(guess == item.answer)
        right["easy-vqa"].append(guess == item.answer)
    return {kind: round(sum(hits) / max(1, len(hits)), 3) for kind, hits in right.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--projector", type=Path, help="projector folder (default: the one --target smol-llava uses)")
    parser.add_argument("--per-kind", type=int, default=40)
    parser.add_argument("--easy-vqa", type=int, default=2000,
                        help="easy-vqa test questions, a fixed seeded sample (default 2000; 0: all 9,673)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "smol_llava_quality.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, processor = new_smol_llava()
    folder = args.projector or projector_dir()
    install_projector(model, load_projector(folder, model.config.text_config.hidden_size))
    easy_items, skipped, majority = easy_vqa_test_items(args.easy_vqa)
    items = held_out_items(args.per_kind) + easy_items
    rows, started = [], time.monotonic()
    replies = {mode: short_answers(model, processor, [(item.image if mode == "image" else None, item.question)
                                                      for _, item in items])
               for mode in tqdm(("image", "no image"), desc="answering")}
    for number, (kind, item) in enumerate(items):
        rows.append({"kind": kind, "item_id": item.item_id, "question": item.question, "answer": item.answer,
                     **{f"{mode} reply": replies[mode][number] for mode in replies},
                     **{f"{mode} right": is_right(replies[mode][number], item.answer) for mode in replies}})
    summary = {}
    groups = {kind: [r for r in rows if r["kind"] == kind] for kind in (*KINDS, *EASY_VQA_KINDS)}
    groups["all"] = [r for r in rows if r["kind"] in OWN_KINDS]
    groups["easy-vqa"] = [r for r in rows if r["kind"] in EASY_VQA_KINDS]
    for kind, chosen in groups.items():
        summary[kind] = {"n": len(chosen),
                         **{mode: round(sum(r[f"{mode} right"] for r in chosen) / max(1, len(chosen)), 3)
                            for mode in ("image", "no image")}}
    priors = question_prior_rates(easy_items)
    for kind, rate in priors.items():
        summary[kind]["question prior"] = rate
    print(f"{'kind':<16} {'n':>5} {'image':>7} {'no image':>9} {'question prior':>15}")
    for kind, s in summary.items():
        prior = f"{s['question prior']:>15.1%}" if "question prior" in s else ""
        print(f"{kind:<16} {s['n']:>5} {s['image']:>7.1%} {s['no image']:>9.1%} {prior}")
    print(f"easy-vqa: majority answer {majority:.1%} of the sample; {skipped} unreadable images skipped")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    projector = {"sha256": read_manifest(folder)["sha256"], "shipped": folder == SHIPPED_PROJECTOR_DIR}
    easy = {"questions": len(easy_items), "sample_seed": 0, "majority_answer_rate": round(majority, 3),
            "unreadable_images_skipped": skipped}
    args.out.write_text(json.dumps({"projector": projector, "summary": summary, "easy_vqa": easy, "minutes":
                                    round((time.monotonic() - started) / 60, 1), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
