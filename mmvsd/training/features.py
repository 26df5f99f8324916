"""Training batches and the target features a drafter learns from.

A `TokenBatch` is a right-padded batch of rendered examples. `capture_features` runs the target
over it once (no grad) and returns a `FeatureBatch`: the auxiliary hidden states the drafter reads,
the target's final hidden states (its logits are `target.logits(target_hidden)`, so an offline
cache need not store [T, V] logits), and optionally the target's KV cache of the whole batch, which
the VSD E-step reuses to score draft paths that branch off any prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mmvsd.decoding.kv import RaggedCache, sequence_block
from mmvsd.drafter_base import Drafter, PairMedia
from mmvsd.target import Target, TargetOutput
from mmvsd.training.unroll import shifted


@dataclass(frozen=True)
class TokenBatch:
    """Right-padded token ids with the loss mask of the positions the drafter learns."""

    input_ids: Tensor  # [B, T] (padding: 0)
    loss_mask: Tensor  # [B, T] bool, True on assistant tokens (never on padding)
    lengths: Tensor  # [B] unpadded lengths
    inputs_embeds: Tensor | None = None  # [B, T, H] what the target reads where media replace tokens, or None
    span_ids: Tensor | None = None  # [B, T] long: media span of each token (0, 1, ... per row), -1 for text

    @property
    def valid(self) -> Tensor:
        """[B, T] bool: True on real (unpadded) positions."""
        positions = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return positions[None, :] < self.lengths[:, None]

    def to(self, device: torch.device | str) -> TokenBatch:
        def move(value: Tensor | None) -> Tensor | None:
            return None if value is None else value.to(device)

        return TokenBatch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device),
                          move(self.inputs_embeds), move(self.span_ids))

    def pair_media(self) -> PairMedia | None:
        """What the drafter's pairs see of the batch's media (None for text-only batches)."""
        if self.inputs_embeds is None:
            return None
        return PairMedia.from_tokens(self.inputs_embeds, self.span_ids)


def collate(examples: Sequence) -> TokenBatch:
    """Right-pad examples with `input_ids` / `loss_mask` lists into one `TokenBatch`."""
    width = max(len(ex.input_ids) for ex in examples)
    input_ids = torch.zeros(len(examples), width, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for row, ex in enumerate(examples):
        input_ids[row, : len(ex.input_ids)] = torch.as_tensor(ex.input_ids, dtype=torch.long)
        loss_mask[row, : len(ex.loss_mask)] = torch.as_tensor(ex.loss_mask, dtype=torch.bool)
    lengths = torch.tensor([len(ex.input_ids) for ex in examples], dtype=torch.long)
    return TokenBatch(input_ids, loss_mask, lengths)


@dataclass
class FeatureBatch:
    """A token batch with the target's view of it."""

    tokens: TokenBatch
    features: Tensor  # [B, T, F] auxiliary hidden states (the drafter's input at each position)
    target_hidden: Tensor  # [B, T, H] final normed hidden states: target logits = target.logits(.)
    target_cache: RaggedCache | None = None  # KV of every position, rows committed to `lengths`


def _causal_forward(target: Target, tokens: TokenBatch, need_aux: bool) -> tuple[RaggedCache, TargetOutput]:
    """One causal target forward over the batch (no logits); the cache's rows end at their lengths."""
    batch, width = tokens.input_ids.shape
    cache = target.new_cache(batch)
    depths, causal = sequence_block(batch, width, target.device)
    no_logits = torch.zeros(batch, 0, dtype=torch.long, device=target.device)
    out = target.forward(cache, tokens.input_ids, depths, causal, need_aux=need_aux, logit_positions=no_logits,
                         inputs_embeds=tokens.inputs_embeds)
    cache.keep(depths, tokens.lengths)
    return cache, out


@torch.no_grad()
def capture_features(target: Target, tokens: TokenBatch, keep_cache: bool = False) -> FeatureBatch:
    """Online feature capture: one causal target forward over the batch."""
    tokens = tokens.to(target.device)
    cache, out = _causal_forward(target, tokens, need_aux=True)
    return FeatureBatch(tokens, out.aux_hidden, out.last_hidden, cache if keep_cache else None)


def draft_step0_inputs(drafter: Drafter, batch: FeatureBatch) -> tuple[Tensor, Tensor, PairMedia | None]:
    """The drafter's first-step inputs for every position: its target features, next ids and media."""
    dtype = next(drafter.parameters()).dtype
    features = drafter.target_features(batch.features, batch.target_hidden).to(dtype)
    return features, shifted(batch.tokens.input_ids, 1), batch.tokens.pair_media()


@torch.no_grad()
def prefix_cache(target: Target, tokens: TokenBatch) -> RaggedCache:
    """The target's KV cache of a batch (for batches whose features came from an offline cache)."""
    return _causal_forward(target, tokens.to(target.device), need_aux=False)[0]
