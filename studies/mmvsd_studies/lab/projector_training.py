"""Training smol-llava's projector on the CPU, with the vision tower frozen, in two stages: per-patch
word targets on shape scenes (no language model in the loop), then LLaVA-style visual instruction
tuning on generated image question-answer conversations and captions, where the projector and
low-rank adapters on the frozen language model's linear layers learn together.

Each example is a conversation about one image: the user sends the image and a short question with
the short-answer instruction (or asks for a brief description), the assistant answers, then more
questions follow; the loss is the cross-entropy of the answer tokens (and each closing
``<|im_end|>``). Two costs are paid once instead of every step: the tower features of every image,
and (without adapters) the KV cache of the system prompt that starts every example. Tower features
[N, 49, 2382] are kept in float16, standardised per channel: their parts differ in scale by more than
10x (stride-8 and stride-16 maps against the head map), so the projector trains on unit-scale inputs
and the standardisation is folded into its first layer at the end (the saved projector reads raw
tower features).

Shapes: B batch, T tokens after the shared prompt prefix, P = 49 patch tokens, C = 2382, H hidden.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache, LlavaForConditionalGeneration, LlavaProcessor

from mmvsd.adapters.llava import patch_embeddings
from mmvsd.data.images import FAMILIES, ImageItem, answer_sentence, generate_items
from mmvsd.decoding.cost_measure import timed, typical
from mmvsd.targets.lora import add_lora, lora_state, merge_lora
from mmvsd.targets.smol_llava import IMAGE_TOKEN, new_smol_llava, projector, save_projector
from mmvsd_studies.lab.easy_vqa_items import easy_vqa_items
from mmvsd_studies.lab.plain_shapes import PLAIN_FAMILY, plain_shape_items
from mmvsd_studies.lab.projector_questions import (
    ALIGN_WORDS,
    BACKGROUND_WORD,
    EASY_VQA_FAMILY,
    extra_questions,
    item_patch_words,
    patch_targets,
    word_vectors,
)

SHORT_ANSWER = "Answer the question using a single word or phrase."
LETTER_ANSWER = "Answer with the option's letter from the given choices directly."
CAPTION_REQUEST = "Describe the image briefly."
SOURCE_NAMES = {EASY_VQA_FAMILY: "easy-vqa", PLAIN_FAMILY: "plain shapes"}  # other families: "generated"
CPU = torch.device("cpu")


@dataclass(frozen=True)
class ProjectorTraining:
    """Settings of `mmvsd lab build-target smol-llava` (the defaults fit 30 minutes on 2 CPU cores)."""

    minutes: float = 28.0  # wall-clock budget for the whole build: data, features and both stages
    max_steps: int = 0  # stop after this many steps (0: when the time budget runs out)
    batch_size: int = 6  # small: the budget buys few examples, so more optimiser steps of fewer each
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    num_images: int = 2400  # generated training images, shared among families by family_weights
    easy_vqa_images: int = 4000  # easy-vqa train images (all 4000 by default; 0: none), each with all its questions
    plain_images: int = 800  # one large shape in the generator's colours on a plain background (lab.plain_shapes)
    caption_share: float = 0.1  # examples that ask for a brief description instead of questions
    long_share: float = 0.25  # generated items that ask their long prompt, answered by description + answer
    questions_per_image: int = 8  # question turns per example (the item's own, then extras from meta)
    align_steps: int = 800  # first stage: per-patch word targets on shape scenes, no language model
    lora_rank: int = 8  # > 0: low-rank adapters on the language model's linear layers train with the projector
    lora_alpha: float = 16.0
    lora_learning_rate: float = 1e-3
    precision: str = "auto"  # "bf16" (autocast), "fp32", or "auto": bf16 where this CPU multiplies it faster
    seed: int = 0
    family_weights: dict[str, float] = field(default_factory=lambda: {
        "vqav2": 0.55, "hallusion": 0.2, "chartqa": 0.1, "textvqa": 0.1, "ai2d": 0.025, "scienceqa": 0.025})


@dataclass(frozen=True)
class Example:
    """One training conversation: the image's index in the feature table, the tokens after the shared prefix."""

    image_index: int
    token_ids: list[int]  # image tokens, questions, assistant headers, answers, <|im_end|>s
    is_answer: list[bool]  # per token: an answer token (or its closing <|im_end|>), which carries the loss
    turns: tuple[tuple[str, str], ...]  # (user text, assistant text) of each turn
    kind: str  # "questions", "caption" (a brief description) or "long" (the long prompt, answered at length)


def user_text(question: str, options: tuple[str, ...] = ()) -> str:
    """The short-answer instruction LLaVA-1.5 uses (letters for multiple choice)."""
    return f"{question}\n{LETTER_ANSWER if options else SHORT_ANSWER}"


def assistant_text(item: ImageItem) -> str:
    return item.answer.upper() if item.options else item.answer


def chat_messages(turns: tuple[tuple[str, str], ...]) -> list[dict]:
    """A conversation whose first user turn carries the image."""
    messages = []
    for number, (user, answer) in enumerate(turns):
        content = [{"type": "text", "text": user}]
        if number == 0:
            content.insert(0, {"type": "image"})
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    return messages


def chat_ids(processor: LlavaProcessor, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of a conversation (the image token expanded to the 49 patch positions)."""
    text = processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    if not add_generation_prompt:
        text = text.removesuffix("\n")  # keep <|im_end|>, the stop token, as the last label
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    at = ids.index(image_id)
    num_patches = processor.image_processor.size["height"] // processor.patch_size
    return ids[:at] + [image_id] * num_patches**2 + ids[at + 1:]


def conversation_ids(processor: LlavaProcessor, turns: tuple[tuple[str, str], ...]) -> tuple[list[int], list[bool]]:
    """(token ids, answer flags) of a conversation; each answer ends with its <|im_end|>."""
    messages = chat_messages(turns)
    full_ids = chat_ids(processor, messages, add_generation_prompt=False)
    is_answer = [False] * len(full_ids)
    for number in range(len(turns)):
        start = len(chat_ids(processor, messages[:2 * number + 1], add_generation_prompt=True))
        end = len(chat_ids(processor, messages[:2 * number + 2], add_generation_prompt=False))
        is_answer[start:end] = [True] * (end - start)
    return full_ids, is_answer


def example_kind(item: ImageItem, settings: ProjectorTraining, rng: random.Random) -> str:
    """What an example asks: a brief description, the item's long prompt, or short questions."""
    draw = rng.random()
    if draw < settings.caption_share and item.description:
        return "caption"
    if draw < settings.caption_share + settings.long_share and item.description and item.long_prompt:
        return "long"
    return "questions"


def example_turns(item: ImageItem, kind: str, rng: random.Random, limit: int) -> tuple[tuple[str, str], ...]:
    """A caption request; the long prompt (as the `_long` speed tasks ask it), answered by the description and
    the answer sentence, so the model writes at length when asked to; or the item's own question followed by
    extra questions about the same image."""
    if kind == "caption":
        return ((CAPTION_REQUEST, item.description),)
    if kind == "long":
        return ((item.long_prompt, f"{item.description} {answer_sentence(item)}"),)
    own = (user_text(item.question, item.options), assistant_text(item))
    extras = list(extra_questions(item, rng, limit - 1))  # the short-answer instruction was given once, above
    return (own, *extras)


def make_examples(processor: LlavaProcessor, items: list[ImageItem], settings: ProjectorTraining
                  ) -> tuple[list[int], list[Example]]:
    """(shared prefix ids, one example per item)."""
    rng = random.Random(settings.seed)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    examples, prefix = [], None
    for index, item in enumerate(items):
        kind = example_kind(item, settings, rng)
        turns = example_turns(item, kind, rng, settings.questions_per_image)
        full_ids, is_answer = conversation_ids(processor, turns)
        image_at = full_ids.index(image_id)
        prefix = prefix or full_ids[:image_at]
        if full_ids[:image_at] != prefix:
            raise AssertionError("chat template does not give every example the same prefix")
        examples.append(Example(index, full_ids[image_at:], is_answer[image_at:], turns, kind))
    return prefix, examples


def training_items(settings: ProjectorTraining) -> tuple[list[ImageItem], list[int]]:
    """(generated train-split items of each family in proportion to family_weights, the plain-shape items,
    then the easy-vqa train images; ids of the easy-vqa images that could not be read, skipped)."""
    items, skipped = [], []
    total = sum(settings.family_weights.values())
    for family, weight in settings.family_weights.items():
        if family not in FAMILIES:
            raise ValueError(f"unknown image family {family!r}")
        items += generate_items(family, "train", round(settings.num_images * weight / total), settings.seed)
    items += plain_shape_items(settings.plain_images, "train", settings.seed)
    if settings.easy_vqa_images:
        easy, skipped = easy_vqa_items("train", settings.easy_vqa_images, settings.seed)
        items += easy
    return items, skipped


@torch.no_grad()
def image_features(model: LlavaForConditionalGeneration, processor: LlavaProcessor, items: list[ImageItem],
                   batch_size: int = 32) -> Tensor:
    """[N, P, C] float16 tower features of every item's image (the tower is frozen: computed once)."""
    chunks = []
    for start in tqdm(range(0, len(items), batch_size), desc="tower features", unit="batch"):
        images = [item.image for item in items[start:start + batch_size]]
        pixel_values = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
        chunks.append(patch_embeddings(model, pixel_values).half())
    return torch.cat(chunks)


def standardise(features: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(features standardised per channel, mean [C], scale [C]); a near-constant channel keeps a floor scale."""
    values = features.float()  # [N, P, C]
    mean, scale = values.flatten(0, 1).mean(0), values.flatten(0, 1).std(0)
    scale = scale.clamp_min(0.05 * float(scale.median()))
    return ((values - mean) / scale).half(), mean, scale


@torch.no_grad()
def fold_standardisation(layer: torch.nn.Linear, mean: Tensor, scale: Tensor) -> None:
    """Make `layer` on raw inputs x equal what it was on (x - mean) / scale."""
    weight = layer.weight / scale  # [out, C]
    layer.bias -= weight @ mean
    layer.weight.copy_(weight)


@torch.no_grad()
def prefix_cache(model: LlavaForConditionalGeneration, prefix_ids: list[int]) -> DynamicCache:
    """KV cache of the prompt prefix every example shares (system prompt and user header), batch 1."""
    cache = DynamicCache()
    model.model.language_model(input_ids=torch.tensor([prefix_ids]), cache=cache, use_cache=True)
    return cache


def batch_loss(model: LlavaForConditionalGeneration, features: Tensor, examples: list[Example],
               shared_cache: DynamicCache | list[int], image_token_id: int) -> Tensor:
    """Mean answer-token cross-entropy of a batch (gradients reach the projector and any adapters).
    `shared_cache`: the prefix's KV cache, or the prefix ids when the language model trains (adapters)."""
    width = max(len(e.token_ids) for e in examples)
    token_ids = torch.zeros(len(examples), width, dtype=torch.long)  # [B, T], right-padded
    labels = torch.full((len(examples), width), -100)
    for row, example in enumerate(examples):
        ids = torch.tensor(example.token_ids)
        token_ids[row, :len(ids)] = ids
        labels[row, :len(ids)] = torch.where(torch.tensor(example.is_answer), ids, -100)
    embeds = model.get_input_embeddings()(token_ids)  # [B, T, H]
    projected = projector(model)(features[[e.image_index for e in examples]].float())  # [B, P, H]
    is_image = token_ids == image_token_id
    embeds = embeds.masked_scatter(is_image[..., None], projected.to(embeds.dtype))
    if isinstance(shared_cache, DynamicCache):
        cache = copy.deepcopy(shared_cache)
    else:  # the prefix ids: the language model is training too, so its prefix cache is recomputed every step
        cache = DynamicCache()
        model.model.language_model(input_ids=torch.tensor([shared_cache]), cache=cache, use_cache=True)
    cache.batch_repeat_interleave(len(examples))
    # right padding needs no mask: causal attention keeps pad tokens out of every real token's view
    hidden = model.model.language_model(inputs_embeds=embeds, cache=cache, use_cache=True).last_hidden_state
    predicts = labels[:, 1:] != -100  # hidden state t predicts token t + 1
    logits = model.lm_head(hidden[:, :-1][predicts])  # [num answer tokens, V]
    return F.cross_entropy(logits.float(), labels[:, 1:][predicts])


def use_bf16(precision: str, size: int = 768) -> bool:
    """Whether to train under bf16 autocast: as asked, or for "auto" where a bf16 matrix product measures at
    least 1.5x faster than fp32 on this CPU (AMX and AVX-512-bf16 parts; AVX2-only parts emulate it slowly)."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, not {precision!r}")
    if precision != "auto":
        return precision == "bf16"
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        seconds[dtype] = typical([timed(CPU, partial(torch.matmul, a, b)) for _ in range(5)])
    return seconds[torch.float32] >= 1.5 * seconds[torch.bfloat16]


def learning_rate(step: int, progress: float, settings: ProjectorTraining) -> float:
    """Linear warm-up over the first steps, then cosine decay to 10% as `progress` goes from 0 to 1."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    return settings.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def align_projector(model: LlavaForConditionalGeneration, processor: LlavaProcessor, items: list[ImageItem],
                    features: Tensor, settings: ProjectorTraining) -> float:
    """First stage: regress shape-scene patches onto the embeddings of the words they show
    ("red" + "circle" + "left", or "background"); no language model in the loop. Each step takes 1024 patches
    that show a shape and 512 of the background (most patches are background, and all share one target)."""
    embeddings = model.get_input_embeddings().weight.detach()
    vectors = word_vectors(embeddings, processor.tokenizer, set(ALIGN_WORDS))
    norm = float(embeddings.norm(dim=-1).median())
    words = [item_patch_words(item) for item in items]
    scenes = [i for i, w in enumerate(words) if w]
    if not scenes or settings.align_steps == 0:
        return float("nan")
    targets = torch.cat([patch_targets(words[i], vectors, norm) for i in scenes])  # [N * P, H]
    patches = features[scenes].flatten(0, 1)  # [N * P, C]
    background = vectors[BACKGROUND_WORD] * (norm / vectors[BACKGROUND_WORD].norm())
    is_background = torch.isclose(targets, background).all(-1)
    pools = [(torch.nonzero(~is_background)[:, 0], 1024), (torch.nonzero(is_background)[:, 0], 512)]
    optimizer = torch.optim.AdamW(projector(model).parameters(), lr=settings.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed)
    loss = torch.tensor(float("nan"))
    for _ in tqdm(range(settings.align_steps), desc="align projector", unit="step"):
        rows = torch.cat([pool[torch.randint(len(pool), (size,), generator=generator)] for pool, size in pools])
        projected = projector(model)(patches[rows].float())  # [1536, H]
        loss = F.mse_loss(projected, targets[rows]) / norm**2 * projected.shape[-1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def train_projector(model: LlavaForConditionalGeneration, processor: LlavaProcessor,
                    settings: ProjectorTraining) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Train the projector (and low-rank adapters, merged into the model at the end) in place within the time
    budget; return a summary for the manifest and the adapters' factors (empty without adapters)."""
    started = time.monotonic()
    deadline = started + settings.minutes * 60
    torch.manual_seed(settings.seed)
    items, skipped = training_items(settings)
    if skipped:
        print(f"easy-vqa: {len(skipped)} unreadable images skipped")
    bf16 = use_bf16(settings.precision)
    prefix_ids, examples = make_examples(processor, items, settings)
    features, feature_mean, feature_scale = standardise(image_features(model, processor, items))
    # with adapters the prefix's cache changes every step, so batch_loss reruns the prefix ids instead
    shared_cache = prefix_ids if settings.lora_rank else prefix_cache(model, prefix_ids)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in projector(model).parameters():
        parameter.requires_grad_(True)
    align_loss = align_projector(model, processor, items, features, settings)
    groups = [{"params": list(projector(model).parameters()), "lr_scale": 1.0}]
    if settings.lora_rank:
        wrappers = add_lora(model.model.language_model, settings.lora_rank, settings.lora_alpha, settings.seed)
        groups.append({"params": [p for w in wrappers for p in (w.lora_a, w.lora_b)],
                       "lr_scale": settings.lora_learning_rate / settings.learning_rate})
    trainable = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, weight_decay=0.0)
    image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    order = random.Random(settings.seed)
    train_start = time.monotonic()
    losses, step, progress = [], 0, 0.0
    bar = tqdm(total=settings.max_steps or None, desc="projector", unit="step")
    while progress < 1.0:
        batch = order.sample(examples, min(settings.batch_size, len(examples)))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, progress, settings) * group["lr_scale"]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = batch_loss(model, features, batch, shared_cache, image_token_id)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if settings.max_steps:
            progress = step / settings.max_steps
        else:  # the schedule follows the clock, so it ends when the budget does
            progress = (time.monotonic() - train_start) / max(1e-9, deadline - train_start)
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    bar.close()
    for parameter in trainable:
        parameter.requires_grad_(False)
    fold_standardisation(projector(model).linear_1, feature_mean, feature_scale)
    adapters = lora_state(model.model.language_model)
    merge_lora(model.model.language_model)
    summary = {"settings": asdict(settings), "precision": "bf16" if bf16 else "fp32",
               "examples": {**Counter(SOURCE_NAMES.get(i.family, "generated") for i in items),
                            "easy-vqa unreadable, skipped": len(skipped)},
               "align_loss": round(align_loss, 4), "steps": step,
               "examples_seen": step * settings.batch_size, "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
               "minutes": round((time.monotonic() - started) / 60, 2)}
    return summary, adapters


def build_projector(settings: ProjectorTraining, output: Path) -> Path:
    """`mmvsd lab build-target smol-llava`: assemble smol-llava, train its projector, write the projector files."""
    model, processor = new_smol_llava()
    summary, adapters = train_projector(model, processor, settings)
    save_projector(model, output, summary, adapters)
    return output
