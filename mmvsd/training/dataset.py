"""From a dataset spec to training examples: read, split by seed, optionally regenerate, render.

Shared by `mmvsd train` (online features) and `mmvsd prepare` (offline feature cache), so both
see exactly the same examples for the same settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mmvsd.data.conversations import load_conversations, log_load_stats, parse_dataset_spec
from mmvsd.data.render import RenderedExample, render_conversation, split_conversations
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.training.media import media_adapter, render_media_conversation
from mmvsd.training.regenerate import regenerate_conversations

logger = logging.getLogger(__name__)


@dataclass
class ExampleSplit:
    """Rendered train and validation examples plus what rendering dropped."""

    train: list[RenderedExample]
    validation: list[RenderedExample]
    num_dropped: int  # conversations with no loss token left after rendering / truncation


def render_all(
    target: Target, conversations: list, max_length: int, adapter_name: str = ""
) -> tuple[list[RenderedExample], int]:
    """Render conversations through the target's chat template (images through a modality adapter);
    count those with nothing to learn."""
    if target.tokenizer is None:
        raise UserError(f"target {target.name!r} has no tokenizer: cannot render conversations")
    examples, dropped, adapter = [], 0, None
    for conv in conversations:
        if conv.image is not None:
            adapter = adapter or media_adapter(target, adapter_name)
            example = render_media_conversation(target, adapter, conv, max_length)
        else:
            example = render_conversation(target.tokenizer, conv, max_length)
        if example is None or len(example.input_ids) < 3:
            dropped += 1
        else:
            examples.append(example)
    return examples, dropped


def data_specs(data: str) -> list[str]:
    """The dataset specs of a mixture `SPEC+SPEC+...` (e.g. ShareGPT plus LLaVA-Instruct, as MLLM drafters train).
    A spec naming a file that exists is one spec, a "+" in its path included."""
    try:
        whole = parse_dataset_spec(data)[1]
    except UserError:
        whole = None
    if whole is not None and whole.exists():
        return [data.strip()]
    specs = [spec.strip() for spec in data.split("+")]
    if not all(specs):
        raise UserError(f"empty dataset in the mixture {data!r} (write SPEC+SPEC)")
    return specs


def load_examples(
    target: Target, data: str, *, num_conversations: int, max_length: int, validation_fraction: float, seed: int,
    regenerate: str = "none", regenerate_max_new_tokens: int = 512, regenerate_cache: Path | None = None,
    regenerate_batch_size: int = 64, progress: bool = True, adapter: str = "", image_root: str = "",
    read: dict[str, tuple] | None = None,
) -> ExampleSplit:
    """Read `data` (relative image paths under `image_root`, else each file's folder; `read`: {spec: (conversations,
    LoadStats)} already read the same way, e.g. by the trainer's checks), split it deterministically by `seed`,
    regenerate answers if asked, render."""
    root = image_root or None

    def conversations_of(spec: str) -> list:
        if read is not None and spec in read:
            found, stats = read[spec]
            log_load_stats(stats)
            return found
        return load_conversations(spec, limit=num_conversations or None, image_root=root)

    conversations = [conv for spec in data_specs(data) for conv in conversations_of(spec)]
    train_convs, validation_convs = split_conversations(conversations, validation_fraction, seed)
    if regenerate != "none":
        images = any(conv.image is not None for conv in train_convs)
        train_convs = regenerate_conversations(  # answers past max_length would be cut off: not generated
            target, train_convs, cache_path=regenerate_cache, temperature=0.0 if regenerate == "greedy" else 1.0,
            max_new_tokens=regenerate_max_new_tokens, max_prompt_tokens=max_length, batch_size=regenerate_batch_size,
            seed=seed, progress=progress, adapter=media_adapter(target, adapter) if images else None,
        )
    train, dropped = render_all(target, train_convs, max_length, adapter)
    validation, dropped_validation = render_all(target, validation_convs, max_length, adapter)
    if not train:
        raise UserError(f"no training example left from {data!r} after rendering with max_length={max_length}")
    logger.info("%d train / %d validation examples (%d dropped: nothing to learn after truncation)",
                len(train), len(validation), dropped + dropped_validation)
    return ExampleSplit(train, validation, dropped + dropped_validation)


def token_frequencies(examples: list, vocab_size: int) -> Tensor:
    """[V] how often each target token is a loss (assistant) token in `examples`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        ids = torch.as_tensor(ex.input_ids, dtype=torch.long)
        mask = torch.as_tensor(ex.loss_mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab_from_counts(counts: Tensor, draft_vocab_size: int) -> Tensor:
    """[Vd] target ids of the draft vocabulary: the most frequent tokens, ties by lower id.

    Tokens never seen fill the remainder in id order, so the size is always `draft_vocab_size`.
    """
    if draft_vocab_size > counts.numel():
        raise UserError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary {counts.numel()}")
    return torch.sort(-counts, stable=True).indices[:draft_vocab_size]
