"""smol-llava's greedy short answers to image questions, batched, and the lmms-eval VQA check of a reply."""

from __future__ import annotations

import torch
from lmms_eval.tasks._task_utils.vqa_eval_metric import EvalAIAnswerProcessor
from PIL import Image
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from mmvsd_studies.lab.projector_training import user_text

NORMALISE = EvalAIAnswerProcessor()


def is_right(reply: str, answer: str) -> bool:
    """The normalised reply (its first line) equals the reference, or starts with it as whole words."""
    got = NORMALISE(reply.strip().split("\n")[0]).split()
    want = NORMALISE(answer).split()
    return got[:len(want)] == want


@torch.no_grad()
def short_answers(model: LlavaForConditionalGeneration, processor: LlavaProcessor,
                  questions: list[tuple[Image.Image | None, str]], batch_size: int = 16) -> list[str]:
    """Greedy replies to (image or None, question) pairs asked with the short-answer instruction,
    `batch_size` prompts at a time (left-padded)."""
    processor.tokenizer.padding_side = "left"
    replies = []
    for start in range(0, len(questions), batch_size):
        chunk = questions[start:start + batch_size]
        if len({image is None for image, _ in chunk}) > 1:
            raise ValueError("a batch mixes questions with and without an image")
        texts = []
        for image, question in chunk:
            parts = [{"type": "text", "text": user_text(question)}]
            if image is not None:
                parts.insert(0, {"type": "image"})
            texts.append(processor.apply_chat_template([{"role": "user", "content": parts}],
                                                       add_generation_prompt=True))
        images = [image for image, _ in chunk] if chunk[0][0] is not None else None
        inputs = processor(images=images, text=texts, return_tensors="pt", padding=True)
        output = model.generate(**inputs, max_new_tokens=10, do_sample=False)
        replies += processor.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return replies
