"""Training examples with media: render conversations through a modality adapter, embed per batch.

Rendering (once, when the data is loaded) writes the adapter's placeholder into the first user turn
(replacing the LLaVA-Instruct `<image>` marker, or in front of the text when there is none), renders
the conversation like a text one, and lets the adapter expand each placeholder token into its media
span (loss mask 0 there). Embedding (per batch, no grad) asks the adapter for the target's input
embeddings of each row, so a batch's `TokenBatch` carries `inputs_embeds` and `span_ids`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mmvsd.adapter_base import ModalityAdapter, Prompt, padded_embeds, span_ids
from mmvsd.adapters import choose_adapter
from mmvsd.data.conversations import Conversation, Turn
from mmvsd.data.render import RenderedExample, render_conversation
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.training.features import TokenBatch

LLAVA_MARKER = "<image>"  # how LLaVA-Instruct records mark the image in the user text
MEDIA_MODALITY = "image"  # conversations carry images (Conversation.image)


def media_adapter(target: Target, name: str = "") -> ModalityAdapter:
    """The adapter that feeds `target` the images of training conversations (`name`, or the first that can)."""
    return choose_adapter(target, name, MEDIA_MODALITY)


def with_placeholder(conv: Conversation, placeholder: str) -> Conversation:
    """The conversation with the image written as `placeholder` in its first user turn."""
    turns = list(conv.turns)
    for index, turn in enumerate(turns):
        if turn.role == "user":
            if LLAVA_MARKER in turn.text:
                before, *after = turn.text.split(LLAVA_MARKER)
                text = before + placeholder + "".join(after)  # one image: extra markers are dropped
            else:
                text = f"{placeholder}\n{turn.text}"
            turns[index] = Turn(turn.role, text)
            break
    else:
        raise UserError(f"conversation {conv.conv_id!r} has an image but no user turn to put it in")
    return replace(conv, turns=turns)


def render_media_conversation(
    target: Target, adapter: ModalityAdapter, conv: Conversation, max_length: int
) -> RenderedExample | None:
    """A conversation with an image as a training example (None: nothing to learn, or the image cut off)."""
    text_example = render_conversation(target.tokenizer, with_placeholder(conv, adapter.placeholder(target)),
                                       max_length=1 << 30)
    if text_example is None:
        return None
    expansion = adapter.expand(target, text_example.input_ids)
    if expansion.media_end == 0:
        raise UserError(f"the chat template dropped the image placeholder of conversation {conv.conv_id!r}")
    if expansion.media_end > max_length:
        return None  # truncation would cut the image span
    ids = expansion.token_ids[:max_length]
    mask = [0 if is_media else text_example.loss_mask[source]
            for source, is_media in zip(expansion.source[:max_length], expansion.is_media)]
    if not any(mask):
        return None
    return RenderedExample(ids, mask, (conv.image,))


@torch.no_grad()
def embed_batch(target: Target, adapter: ModalityAdapter, tokens: TokenBatch, examples: list) -> TokenBatch:
    """`tokens` with `inputs_embeds` and `span_ids` filled from the examples' media (unchanged without media)."""
    if not any(getattr(ex, "media", ()) for ex in examples):
        return tokens
    ids = tokens.input_ids.to(target.device)
    prompts = [adapter.embed(target, list(ex.input_ids), list(ex.media)) if ex.media else Prompt(list(ex.input_ids))
               for ex in examples]
    embeds = padded_embeds(target, prompts, ids)  # [B, T, H]
    return replace(tokens.to(target.device), inputs_embeds=embeds, span_ids=span_ids(prompts, ids.shape[1], ids.device))
