"""The decode-time state of one neural drafter over a batch (`DraftSession`): its ragged KV cache and last
outputs, behind the tree builder's `TreeExpander` protocol (`mmvsd.decoding.tree`).

Besides that protocol, every session (neural, n-gram, hybrid) takes committed pairs two ways:
`advance` feeds them now; `defer` commits them at no cost to the neural part, which feeds them all
in one pass when it next drafts (steps that did not need it: plain steps, n-gram-only steps).
`light_expander` is the part of a session that drafts at no measurable cost (a hybrid's n-gram
proposer), or None."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mmvsd.decoding.kv import sequence_block

if TYPE_CHECKING:  # types only: the drafter module creates sessions (`Drafter.new_session`)
    from mmvsd.drafter_base import Drafter, PairMedia


@dataclass(frozen=True)
class DraftInputs:
    """Positions newly committed by the target, to be fed to the drafter as pairs."""

    features: Tensor  # [B, A, F] target features at each committed position (`Drafter.target_features`)
    next_ids: Tensor  # [B, A] the token that follows each position
    num_new: Tensor  # [B] valid pairs per row (rows are right-padded)
    media: PairMedia | None = None  # media at the following tokens (prompts with images), else None
    first_ids: Tensor | None = None  # [B] the token before the first pair (a prompt's first token, at prefill):
    # proposers that read tokens rather than features (a draft model) start their context with it


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
        self.deferred: list[DraftInputs] = []  # committed pairs not fed yet, oldest first

    @torch.no_grad()
    def advance(self, inputs: DraftInputs) -> None:
        """Feed newly committed pairs (after any deferred ones) and commit them to the drafter's cache."""
        if self.deferred:
            inputs = concat_pairs(self.deferred + [inputs])
            self.deferred = []
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

    def defer(self, inputs: DraftInputs) -> None:
        """Commit pairs without feeding them yet: the next `advance` or draft feeds them first."""
        if inputs.media is not None:
            raise ValueError("pairs with media are fed at once (prefill), never deferred")
        self.deferred.append(inputs)

    def light_expander(self) -> None:
        """A neural session has no part that drafts for free."""
        return None

    def root_candidates(self, topk: int) -> tuple[Tensor, Tensor]:
        if self.deferred:  # catch up on the pairs committed while the drafter was idle
            deferred, self.deferred = self.deferred, []
            self.advance(concat_pairs(deferred))
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
        self.deferred = [select_pairs(i, rows) for i in self.deferred]


def select_pairs(inputs: DraftInputs, rows: Tensor) -> DraftInputs:
    """The pairs of batch rows `rows` (media-free pairs: those a session may hold back)."""
    first = None if inputs.first_ids is None else inputs.first_ids[rows]
    return DraftInputs(inputs.features[rows], inputs.next_ids[rows], inputs.num_new[rows], first_ids=first)


def concat_pairs(items: list[DraftInputs]) -> DraftInputs:
    """Several steps' committed pairs as one `DraftInputs`, each row's valid pairs packed in order
    (steps commit ragged numbers of pairs per row, so a plain concatenation would leave gaps)."""
    if len(items) == 1:
        return items[0]
    num_new = torch.stack([i.num_new for i in items]).sum(0)  # [B]
    first = items[0]
    batch, width = first.next_ids.shape[0], int(num_new.max())
    features = first.features.new_zeros(batch, width, first.features.shape[-1])
    next_ids = first.next_ids.new_zeros(batch, width)
    offset = torch.zeros_like(num_new)
    for item in items:
        cols = torch.arange(item.next_ids.shape[1], device=num_new.device)
        rows, src = (cols[None, :] < item.num_new[:, None]).nonzero(as_tuple=True)
        dest = offset[rows] + src
        features[rows, dest] = item.features[rows, src]
        next_ids[rows, dest] = item.next_ids[rows, src]
        offset = offset + item.num_new
    return DraftInputs(features, next_ids, num_new, first_ids=first.first_ids)
