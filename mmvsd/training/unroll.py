"""Training-time test (EAGLE-3): unroll a drafter over whole sequences as it runs when decoding.

Anchor t is the last committed pair (target feature of position t, token t+1). Step 0 predicts
token t+2 from target features, as the drafter's first draft does; step i > 0 feeds the drafter's
own step i-1 output at the same anchor with token t+1+i, at position t+i, and predicts t+2+i, as
a depth-(i+1) tree node does. Step i at anchor t sees step-0 entries of anchors <= t (the
committed context) and the entries of steps 1..i at anchor t (its own draft path).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmvsd.drafter_base import Drafter, PairMedia


def shifted(token_ids: Tensor, shift: int, fill: int = 0) -> Tensor:
    """token_ids [B, T] moved left by `shift` positions, padded with `fill` at the end."""
    if shift == 0:
        return token_ids
    pad = torch.full_like(token_ids[:, :shift], fill)
    return torch.cat([token_ids[:, shift:], pad], dim=1)[:, : token_ids.shape[1]]


def unroll_draft_steps(drafter: Drafter, features: Tensor, next_ids: Tensor, num_steps: int,
                       media: PairMedia | None = None) -> list[Tensor]:
    """Hidden outputs [B, T, H] of each of `num_steps` unrolled draft steps.

    features [B, T, F]: target features per position; next_ids [B, T]: token t+1 at position t;
    media: the sequence's media, read by step 0 (later steps draft text).
    Labels for step i are the tokens at t+2+i, i.e. `shifted(next_ids, i + 1)`.
    """
    batch, length = next_ids.shape
    device = next_ids.device
    dtype = next(drafter.parameters()).dtype
    cache = drafter.new_cache(batch, device)
    anchors = torch.arange(length, device=device)
    causal = (anchors[None, :] <= anchors[:, None]).expand(batch, length, length)
    diagonal = torch.eye(length, dtype=torch.bool, device=device).expand(batch, length, length)
    outputs = []
    hidden, block = features, causal
    for step in range(num_steps):
        positions = (anchors + step).expand(batch, length)
        mask = cache.attention_mask(block, dtype)
        if step == 0:
            hidden = drafter.read_target(hidden, next_ids, positions, mask, cache, media=media)
        else:
            hidden = drafter.read_draft(hidden, shifted(next_ids, step), positions, mask, cache)
        outputs.append(hidden)
        block = torch.cat([block, diagonal], dim=2)
    return outputs
