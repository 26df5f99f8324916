"""The `text` adapter: a plain prompt through the target's chat template."""

from __future__ import annotations

from pathlib import Path

from mmvsd.adapter_base import ModalityAdapter, Prompt
from mmvsd.errors import UserError


class TextAdapter(ModalityAdapter):
    """Text only: any target with a tokenizer."""

    name = "text"
    modality = ""

    def accepts(self, target) -> bool:
        return target.tokenizer is not None

    def encode(self, target, text: str, media: list[Path]) -> Prompt:
        if media:
            raise UserError(f"the text adapter takes no media files, got {len(media)}")
        return Prompt(target.encode_prompt(text))
