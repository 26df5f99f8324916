"""The modality-adapter interface: raw inputs of one modality plus the prompt text -> what the target reads and
what a drafter may consume. The core only sees `Prompt` values; it never knows which modality made them.

This module is the interface; the built-in adapters and the registry that finds adapters by name
or modality (entry-point group ``mmvsd.adapters`` for other packages) are `mmvsd.adapters`.

Glossary: a *span* is the run of prompt positions one media item occupies (image tokens);
*patch embeddings* are the target encoder's own outputs for it (before any projector);
*projected* embeddings are what the target's language model reads at those positions.
Shapes: T prompt tokens, S span tokens, C encoder width, H target hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class MediaSpan:
    """One media item's place in the prompt and its features."""

    start: int  # prompt index of the span's first token
    patch_embeddings: Tensor  # [S, C] encoder outputs, before the projector
    projected: Tensor  # [S, H] the embeddings the target reads at the span's positions

    @property
    def length(self) -> int:
        return self.projected.shape[0]


@dataclass(frozen=True)
class Prompt:
    """A prompt ready for decoding: token ids, and the input embeddings where media replace tokens."""

    token_ids: list[int]  # placeholders already expanded to one id per span position
    inputs_embeds: Tensor | None = None  # [T, H]; None: the target embeds token_ids itself
    spans: tuple[MediaSpan, ...] = field(default=())


@dataclass(frozen=True)
class Expansion:
    """Token ids of rendered training text with every media placeholder expanded to its span."""

    token_ids: list[int]
    source: list[int]  # per expanded position: index of the original token it came from
    is_media: list[bool]  # per expanded position: inside a media span

    @property
    def media_end(self) -> int:
        """Index just after the last media position (0: no media)."""
        return max((i + 1 for i, flag in enumerate(self.is_media) if flag), default=0)


def has_media(prompts) -> bool:
    """Whether any of these prompts (`Prompt`s or plain token-id lists) carries media embeddings."""
    return any(isinstance(p, Prompt) and p.inputs_embeds is not None for p in prompts)


def padded_embeds(target, prompts: list[Prompt], ids: Tensor) -> Tensor | None:
    """[B, T, H] the target's input embeddings of padded ids [B, T], with each prompt's media embeddings in
    place; None when no prompt carries media (the target then embeds the ids itself)."""
    if all(p.inputs_embeds is None for p in prompts):
        return None
    embeds = target.input_embeddings(ids)
    for row, prompt in enumerate(prompts):
        if prompt.inputs_embeds is not None:
            embeds[row, : prompt.inputs_embeds.shape[0]] = prompt.inputs_embeds.to(embeds.device, embeds.dtype)
    return embeds


def span_ids(prompts: list[Prompt], width: int, device) -> Tensor:
    """[B, width] long: the media span each prompt position belongs to (0, 1, ... per row), -1 for text."""
    ids = torch.full((len(prompts), width), -1, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        for index, span in enumerate(prompt.spans):
            ids[row, span.start : span.start + span.length] = index
    return ids


class ModalityAdapter:
    """Base class: turn a prompt text and media files into a `Prompt` for a target.

    Decoding needs `accepts` and `encode`; training on conversations with media also needs
    `placeholder`, `expand` and `embed` (render the text, expand placeholders, then embed per batch).
    """

    name: ClassVar[str] = ""
    modality: ClassVar[str] = ""  # what --image/--media files it takes, e.g. "image" (empty: none)

    def accepts(self, target) -> bool:
        """Whether this adapter can feed `target`."""
        raise NotImplementedError

    def encode(self, target, text: str, media: list[Path]) -> Prompt:
        """The target's inputs for a user turn made of `media` followed by `text`."""
        raise NotImplementedError

    def placeholder(self, target) -> str:
        """The text that stands for one media item in a conversation (one token once tokenized)."""
        raise NotImplementedError(f"adapter {self.name!r} cannot be used for training")

    def expand(self, target, token_ids: list[int]) -> Expansion:
        """Tokenized conversation text -> ids with each placeholder token expanded to its media span."""
        raise NotImplementedError(f"adapter {self.name!r} cannot be used for training")

    def embed(self, target, token_ids: list[int], media: list[Path]) -> Prompt:
        """The `Prompt` of expanded ids (from `expand`) with `media` in its spans, in order."""
        raise NotImplementedError(f"adapter {self.name!r} cannot be used for training")
