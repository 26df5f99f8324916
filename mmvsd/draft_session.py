"""The decode-time state of one neural drafter over a batch (`DraftSession`): its ragged KV cache and last
outputs, behind the tree builder's `TreeExpander` protocol (`mmvsd.tree`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mmvsd.kv import sequence_block

if TYPE_CHECKING:  # types only: the drafter module creates sessions (`Drafter.new_session`)
    from mmvsd.drafter_base import Drafter, DraftInputs


class DraftSession:
    """One drafter's state while decoding a batch: its ragged KV cache and last outputs."""

    def __init__(self, drafter: Drafter, batch_size: int) -> None:
        self.drafter = drafter
        device = next(drafter.parameters()).device
        self.dtype = next(drafter.parameters()).dtype
        self.cache = drafter.new_cache(batch_size, device)
        self.last_hidden: Tensor | None = None  # [B, H] output at each row's last committed pair
        self.frontier_hidden: Tensor | None = None  # [B, K, H] outputs of the last expanded frontier
        self.num_expanded = 0

    @torch.no_grad()
    def advance(self, inputs: DraftInputs) -> None:
        """Feed newly committed pairs and commit them to the drafter's cache."""
        batch, width = inputs.next_ids.shape
        device = inputs.next_ids.device
        depths, causal = sequence_block(batch, width, device)
        hidden = self.drafter.read_target(
            inputs.features.to(self.dtype), inputs.next_ids, self.cache.positions(depths),
            self.cache.attention_mask(causal, self.dtype), self.cache, media=inputs.media,
        )
        rows = torch.arange(batch, device=device)
        self.last_hidden = hidden[rows, inputs.num_new - 1]
        self.cache.keep(depths, inputs.num_new)

    def root_candidates(self, topk: int) -> tuple[Tensor, Tensor]:
        logprobs = self.drafter.draft_logprobs(self.last_hidden)  # [B, Vd]
        top = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
        self.frontier_hidden = self.last_hidden[:, None]
        self.num_expanded = 0
        return self.drafter.draft_to_target(top.indices), top.values

    @torch.no_grad()
    def expand(self, token_ids: Tensor, parent_slots: Tensor, block_mask: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        parent_hidden = self.frontier_hidden.gather(
            1, parent_slots[:, :, None].expand(-1, -1, self.frontier_hidden.shape[-1])
        )
        depths = torch.full_like(token_ids, self.num_expanded)
        hidden = self.drafter.read_draft(
            parent_hidden, token_ids, self.cache.positions(depths), self.cache.attention_mask(block_mask, self.dtype),
            self.cache,
        )
        self.frontier_hidden = hidden
        self.num_expanded += 1
        logprobs = self.drafter.draft_logprobs(hidden)  # [B, K, Vd]
        top = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
        return self.drafter.draft_to_target(top.indices), top.values

    def end_round(self) -> None:
        self.cache.drop_block()
        self.frontier_hidden = None

    def select_rows(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (finished sequences leave the batch)."""
        self.cache.select_rows(rows)
        self.last_hidden = self.last_hidden[rows]
