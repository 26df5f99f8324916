"""Does the image drive smol-llava's answers? Short factual questions on held-out generated images
(validation split), answered by smol-llava with the image and by the same model (its language model
with the trained adapters merged) without it: the baseline knows the one-word answer format, so it
scores what guessing from the question alone gives.

Kinds: colour and shape (which shape is on a side) and count on shape scenes, chart value (the value
of a named bar, point or slice), word (text on signs, plaques, jerseys and tags). Greedy decoding,
the short-answer instruction the projector was trained with; an answer is right when lmms-eval's
VQA answer normalisation of the reply equals the reference or starts with it.

    python benchmarks/smol_llava_quality.py [--projector DIR] [--per-kind 40]

Writes benchmarks/results/smol_llava_quality.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from lmms_eval.tasks._task_utils.vqa_eval_metric import EvalAIAnswerProcessor
from tqdm.auto import tqdm

from mmvsd.data.images import ImageItem, generate_item
from mmvsd.lab.projector_training import user_text
from mmvsd.lab.smol_llava import (
    SHIPPED_PROJECTOR_DIR,
    install_projector,
    load_projector,
    new_smol_llava,
    projector_dir,
    read_manifest,
)

KINDS = ("colour", "shape", "count", "chart value", "word")
NORMALISE = EvalAIAnswerProcessor()


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
    return [(kind, item) for kind in KINDS for item in picked[kind]]


def is_right(reply: str, answer: str) -> bool:
    """Normalised reply equals the reference, or starts with it as whole words."""
    got = NORMALISE(reply.strip().split("\n")[0]).split()
    want = NORMALISE(answer).split()
    return got[:len(want)] == want


@torch.no_grad()
def answer(model, processor, item: ImageItem, with_image: bool) -> str:
    parts = [{"type": "text", "text": user_text(item.question)}]
    if with_image:
        parts.insert(0, {"type": "image"})
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    inputs = processor(images=item.image if with_image else None, text=text, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    return processor.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--projector", type=Path, help="projector folder (default: the one --target smol-llava uses)")
    parser.add_argument("--per-kind", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "smol_llava_quality.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, processor = new_smol_llava()
    folder = args.projector or projector_dir()
    install_projector(model, load_projector(folder, model.config.text_config.hidden_size))
    items = held_out_items(args.per_kind)
    rows, started = [], time.monotonic()
    for kind, item in tqdm(items, desc="questions"):
        replies = {mode: answer(model, processor, item, mode == "image") for mode in ("image", "no image")}
        rows.append({"kind": kind, "item_id": item.item_id, "question": item.question, "answer": item.answer,
                     **{f"{mode} reply": reply for mode, reply in replies.items()},
                     **{f"{mode} right": is_right(reply, item.answer) for mode, reply in replies.items()}})
    summary = {}
    for kind in (*KINDS, "all"):
        chosen = [r for r in rows if kind in ("all", r["kind"])]
        summary[kind] = {"n": len(chosen), **{mode: round(sum(r[f"{mode} right"] for r in chosen) / len(chosen), 3)
                                              for mode in ("image", "no image")}}
    print(f"{'kind':<12} {'n':>4} {'image':>7} {'no image':>9}")
    for kind, s in summary.items():
        print(f"{kind:<12} {s['n']:>4} {s['image']:>7.1%} {s['no image']:>9.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    projector = {"sha256": read_manifest(folder)["sha256"], "shipped": folder == SHIPPED_PROJECTOR_DIR}
    args.out.write_text(json.dumps({"projector": projector, "summary": summary, "minutes":
                                    round((time.monotonic() - started) / 60, 1), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
