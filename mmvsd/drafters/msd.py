"""MSD drafter (Lin et al., "Speculative Decoding Reimagined for Multimodal LLMs"): EAGLE-1 whose
image tokens skip fc.

At a pair whose next token is text the layer reads fc([embedding ; target hidden]) as EAGLE-1 does;
at a pair whose next token is an image token it reads that token's projected image embedding (what
the target's language model reads there) directly, so visual and textual tokens are handled apart.

Training uses MSD's two-stage curriculum (`media_curriculum`): text-only samples first, then a share
of multimodal samples rising linearly to all of them.

One departure, for targets whose projected image embeddings are far from the text inputs' scale (the
layer has no input norm): `media_rms` rescales each image embedding to that root mean square before it
enters (smol-llava's projector emits RMS ~58 where fc's text inputs sit near 1, and a drafter fed them
raw trained to losses ~50x the text ones). New drafters use 1.0; None keeps MSD's raw embeddings, which
is what MSD's released LLaVA-1.5 drafters expect (loading one in the `msd` layout gives None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmvsd.decoding.kv import RaggedCache
from mmvsd.drafter_base import PairMedia
from mmvsd.drafters.eagle1 import Eagle1Config, Eagle1Drafter, LayerInput


@dataclass
class MSDConfig(Eagle1Config):
    media_rms: float | None = 1.0  # each image embedding rescaled to this RMS; None: as the target reads it


def rescaled_rms(x: Tensor, rms: float, eps: float = 1e-6) -> Tensor:
    """x [..., H] with every row rescaled to root mean square `rms` (float32 arithmetic)."""
    x32 = x.float()
    return x32 * (rms * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


class MSDDrafter(Eagle1Drafter):
    """The MSD draft model."""

    drafter_type = "msd"

    config_class = MSDConfig

    display_name = "MSD"
    default_max_images = 1  # MSD's released drafters and decoding code take one image per prompt
    media_curriculum = True
    reads_media = True

    def target_input(
        self, features: Tensor, token_ids: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
        media: PairMedia | None,
    ) -> LayerInput:
        entry = self.draft_input(features, token_ids, attention_mask)  # one fc reads target features and own states
        if media is not None:
            embeds = (media.embeds if self.config.media_rms is None
                      else rescaled_rms(media.embeds, self.config.media_rms))
            entry.x = torch.where(media.mask[..., None], embeds.to(entry.x.dtype), entry.x)
        return entry

    def draft_input(self, hidden: Tensor, token_ids: Tensor, attention_mask: Tensor) -> LayerInput:
        return LayerInput(self.fc(torch.cat([self.embed(token_ids, hidden.dtype), hidden], dim=-1)), attention_mask)
