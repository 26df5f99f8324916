"""ViSpec drafter (Kang et al., "ViSpec: Accelerating Vision-Language Models with Vision-Aware
Speculative Decoding"): EAGLE-1 plus an image adaptor and a global image feature.

For each image span of n tokens, the adaptor `imadpt` (num_q learnable queries attending over the
span's projected embeddings) gives num_q outputs:
    - the first num_q - 1 are the drafter's image tokens, placed at the LAST num_q - 1 positions of
      the span (they bypass fc); the span's other positions are dropped (hidden in the drafter's
      KV cache, so no later query sees them, and positions keep counting as in the target);
    - the last is the image's global feature g: every later text pair reads
      fc([embedding ; img_fc([hidden ; g])]) instead of EAGLE-1's fc([embedding ; hidden]); before the
      first image g = 0 (img_fc starts as [I | 0], i.e. plain EAGLE-1).
The drafter's state per pair is [hidden ; g] (2H): draft steps carry the global feature of the
image their anchor follows, and a decoding session keeps each row's latest g in its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mmvsd.decoding.kv import RaggedCache
from mmvsd.drafter_base import PairMedia
from mmvsd.drafters.eagle1 import Eagle1Config, Eagle1Drafter, LayerInput
from mmvsd.errors import UserError

GLOBAL_STATE = "vispec_global"  # RaggedCache.row_state key: each row's latest global feature [B, H]


@dataclass
class ViSpecConfig(Eagle1Config):
    num_q: int = 2  # adaptor queries: num_q - 1 image tokens + 1 global feature per image


class ImageAdaptor(nn.Module):
    """Learnable queries [num_q, heads, head_dim] attending over one image span's embeddings."""

    def __init__(self, config: ViSpecConfig) -> None:
        super().__init__()
        heads, head_dim = config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim = heads, head_dim
        self.q = nn.Parameter(torch.empty(config.num_q, heads, head_dim))
        self.k_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)

    def forward(self, span_embeds: Tensor) -> Tensor:
        """[n, H] projected image embeddings -> [num_q, H]."""
        n = span_embeds.shape[0]
        keys = self.k_proj(span_embeds).view(n, self.num_heads, self.head_dim).transpose(0, 1)  # [heads, n, hd]
        values = self.v_proj(span_embeds).view(n, self.num_heads, self.head_dim).transpose(0, 1)
        queries = self.q.to(span_embeds.dtype).transpose(0, 1)  # [heads, num_q, hd]
        out = nn.functional.scaled_dot_product_attention(queries, keys, values)  # [heads, num_q, hd]
        return self.o_proj(out.transpose(0, 1).reshape(self.q.shape[0], -1))


def span_bounds(span_ids: Tensor) -> list[tuple[int, int, int]]:
    """(row, first, last) index of every media span in [B, Q] span ids, in order along each row."""
    bounds = []
    for row, ids in enumerate(span_ids.cpu()):
        for span in ids[ids >= 0].unique().tolist():
            where = (ids == span).nonzero()[:, 0]
            bounds.append((row, int(where[0]), int(where[-1])))
    return bounds


class ViSpecDrafter(Eagle1Drafter):
    """The ViSpec draft model."""

    drafter_type = "vispec"

    config_class = ViSpecConfig
    display_name = "ViSpec"
    reads_media = True

    def __init__(self, config: ViSpecConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__(config, embed_tokens, lm_head)
        self.imadpt = ImageAdaptor(config)
        self.img_fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.reset_image_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_image_parameters()

    def reset_image_parameters(self) -> None:
        """ViSpec's initialisation: queries ~ N(0, head_dim^-1/2), img_fc = [I | 0] (g ignored at first)."""
        size = self.config.hidden_size
        nn.init.normal_(self.imadpt.q, std=self.config.head_dim**-0.5)
        with torch.no_grad():
            self.img_fc.weight.zero_()
            self.img_fc.weight[:, :size].copy_(torch.eye(size))
            if self.img_fc.bias is not None:
                self.img_fc.bias.zero_()

    def draft_input(self, hidden: Tensor, token_ids: Tensor, attention_mask: Tensor) -> LayerInput:
        """Own states [hidden ; g] of the previous draft step: g rides along unchanged."""
        embeds = self.embed(token_ids, hidden.dtype)
        return LayerInput(self.fc(torch.cat([embeds, self.img_fc(hidden)], dim=-1)), attention_mask,
                          extra_state=hidden[..., self.config.hidden_size:])

    def target_input(
        self, features: Tensor, token_ids: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
        media: PairMedia | None,
    ) -> LayerInput:
        size = self.config.hidden_size
        embeds = self.embed(token_ids, features.dtype)
        batch, num_pairs, _ = features.shape
        prior = cache.row_state.get(GLOBAL_STATE) if cache is not None else None
        if prior is None:
            prior = features.new_zeros(batch, size)
        global_feature = prior[:, None].expand(-1, num_pairs, -1).to(features.dtype)
        has_images = media is not None and bool(media.mask.any())
        if has_images:
            image_inputs, dropped, global_feature = self.adapt_images(media, global_feature)
        x = self.fc(torch.cat([embeds, self.img_fc(torch.cat([features, global_feature], dim=-1))], dim=-1))
        if not has_images:
            return LayerInput(x, attention_mask, extra_state=global_feature)
        if cache is not None:
            cache.row_state[GLOBAL_STATE] = global_feature[:, -1].detach()
        x = torch.where(media.mask[..., None], image_inputs, x)
        return LayerInput(x, hide_in_block(attention_mask, dropped), hide=dropped, extra_state=global_feature)

    def adapt_images(self, media: PairMedia, global_feature: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per pair: adaptor image tokens [B, Q, H], dropped span positions [B, Q], global feature [B, Q, H]."""
        num_tokens = self.config.num_q - 1
        image_inputs = torch.zeros_like(global_feature)
        dropped = torch.zeros_like(media.span_ids, dtype=torch.bool)
        global_feature = global_feature.clone()
        for row, first, last in span_bounds(media.span_ids):
            if last - first + 1 < num_tokens:
                raise UserError(f"an image span of {last - first + 1} tokens is shorter than ViSpec's "
                                f"{num_tokens} image tokens")
            adapted = self.imadpt(media.embeds[row, first : last + 1].to(global_feature.dtype))  # [num_q, H]
            image_inputs[row, last + 1 - num_tokens : last + 1] = adapted[:-1]
            dropped[row, first : last + 1 - num_tokens] = True
            global_feature[row, first:] = adapted[-1].to(global_feature.dtype)
        return image_inputs, dropped, global_feature


def hide_in_block(attention_mask: Tensor, hidden: Tensor) -> Tensor:
    """attention_mask [B, 1, Q, T] with the new entries flagged in hidden [B, Q] masked for the other queries."""
    num_pairs = hidden.shape[1]
    others = hidden[:, None, :] & ~torch.eye(num_pairs, dtype=torch.bool, device=hidden.device)  # [B, Q, Q]
    mask = attention_mask.clone()
    block = mask[..., -num_pairs:]
    mask[..., -num_pairs:] = block.masked_fill(others[:, None].to(block.device), torch.finfo(mask.dtype).min)
    return mask
