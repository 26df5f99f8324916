"""Hybrid drafting: a neural drafter's proposals and n-gram continuations in one draft tree.

The hybrid composes two tree expanders; the tree builder and the verifier see one expander and
never learn which proposer a node came from. Every frontier node is fed to both: the neural
session computes hidden states for n-gram-proposed nodes too (so a neural branch can grow under
an n-gram branch), and the n-gram session follows its trie under any node whose tokens are on it.
Per node the children are the union: k = k_neural + k_ngram columns, where a token proposed by both
appears once with the higher score and the other column is -inf, as are absent n-gram proposals.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmvsd.decoding.draft_session import DraftSession
from mmvsd.drafter_base import Drafter, DraftInputs
from mmvsd.drafters.ngram import NEG_INF, NgramConfig, NgramDrafter, NgramSession


class HybridDrafter:
    """A neural drafter plus n-gram branches; decoding uses it like any drafter."""

    proposes_from_context = True  # its n-gram branches

    def __init__(self, neural: Drafter, ngram: NgramDrafter) -> None:  # neural: or a `DraftModel`
        self.neural = neural
        self.ngram = ngram
        self.drafter_type = f"{neural.drafter_type}+ngram"
        self.reads_aux = neural.reads_aux

    def check_media(self, num_spans: int) -> None:
        self.neural.check_media(num_spans)

    def target_features(self, aux_hidden: Tensor | None, last_hidden: Tensor) -> Tensor:
        return self.neural.target_features(aux_hidden, last_hidden)

    def new_session(self, batch_size: int) -> HybridSession:
        return HybridSession(self.neural.new_session(batch_size), self.ngram.new_session(batch_size))


def with_ngram(drafter: Drafter, config: NgramConfig | None = None) -> HybridDrafter:
    """`drafter` whose draft trees also hold n-gram (prompt-lookup) continuations."""
    return HybridDrafter(drafter, NgramDrafter(config))


def merge_proposals(
    neural_ids: Tensor, neural_logprobs: Tensor, ngram_ids: Tensor, ngram_logprobs: Tensor
) -> tuple[Tensor, Tensor]:
    """Union of two proposal sets per node: ids, log-probs [..., kn + kg] from [..., kn] and [..., kg].

    A token in both keeps the higher score in its neural column; its n-gram column becomes -inf."""
    if ngram_ids.shape[-1] == 0:
        return neural_ids, neural_logprobs
    same = ngram_ids[..., :, None] == neural_ids[..., None, :]  # [..., kg, kn]
    ngram_best = torch.where(same, ngram_logprobs[..., :, None], NEG_INF).amax(-2)  # [..., kn]
    merged_neural = torch.maximum(neural_logprobs, ngram_best)
    merged_ngram = ngram_logprobs.masked_fill(same.any(-1), NEG_INF)
    return torch.cat([neural_ids, ngram_ids], -1), torch.cat([merged_neural, merged_ngram], -1)


class HybridSession:
    """One neural `DraftSession` and one `NgramSession` behind the `TreeExpander` protocol."""

    def __init__(self, neural: DraftSession, ngram: NgramSession) -> None:
        self.neural = neural
        self.ngram = ngram

    def advance(self, inputs: DraftInputs) -> None:
        self.neural.advance(inputs)
        self.ngram.advance(inputs)

    def defer(self, inputs: DraftInputs) -> None:
        """The n-gram histories take the pairs now (free); the neural drafter when it next drafts."""
        self.neural.defer(inputs)
        self.ngram.advance(inputs)

    def light_expander(self) -> NgramSession:
        """The n-gram proposer alone: a draft tree that costs no drafter time."""
        return self.ngram

    def root_candidates(self, topk: int) -> tuple[Tensor, Tensor]:
        neural_ids, neural_logprobs = self.neural.root_candidates(topk)  # [B, kn]
        limit = self.ngram.config.num_continuations
        ngram_ids, ngram_logprobs = self.ngram.root_proposals(limit, min_width=0)  # [B, kg]
        return merge_proposals(neural_ids, neural_logprobs, ngram_ids, ngram_logprobs)

    def expand(self, token_ids: Tensor, parent_slots: Tensor, block_mask: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        neural_ids, neural_logprobs = self.neural.expand(token_ids, parent_slots, block_mask, topk)  # [B, K, kn]
        limit = self.ngram.config.num_continuations
        ngram_ids, ngram_logprobs = self.ngram.expand_proposals(token_ids, parent_slots, limit, min_width=0)
        return merge_proposals(neural_ids, neural_logprobs, ngram_ids, ngram_logprobs)

    def end_round(self) -> None:
        self.neural.end_round()
        self.ngram.end_round()

    def select_rows(self, rows: Tensor) -> None:
        self.neural.select_rows(rows)
        self.ngram.select_rows(rows)
