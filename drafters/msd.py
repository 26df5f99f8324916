"""MSD drafter (Lin et al., "Speculative Decoding Reimagined for Multimodal LLMs"): EAGLE-1 whose
image tokens skip fc.

At a pair whose next token is text the layer reads fc([embedding ; target hidden]) as EAGLE-1 does;
at a pair whose next token is an image token it reads that token's projected image embedding (what
the target's language model reads there) directly, so visual and textual tokens are handled apart.
Training uses MSD's two-stage curriculum (`media_curriculum`): text-only samples first, then a share
of multimodal samples rising linearly to all of them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmvsd.drafter_base import PairMedia
from mmvsd.drafters.eagle1 import Eagle1Drafter, LayerInput
from mmvsd.kv import RaggedCache


class MSDDrafter(Eagle1Drafter):
    """The MSD draft model."""

    drafter_type = "msd"

    display_name = "MSD"
    default_max_images = 1  # MSD's released drafters and decoding code take one image per prompt
    media_curriculum = True

    def target_input(
        self, features: Tensor, token_ids: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
        media: PairMedia | None,
    ) -> LayerInput:
        entry = self.draft_input(features, token_ids, attention_mask)  # one fc reads target features and own states
        if media is not None:
            entry.x = torch.where(media.mask[..., None], media.embeds.to(entry.x.dtype), entry.x)
        return entry

    def draft_input(self, hidden: Tensor, token_ids: Tensor, attention_mask: Tensor) -> LayerInput:
        return LayerInput(self.fc(torch.cat([self.embed(token_ids, hidden.dtype), hidden], dim=-1)), attention_mask)
