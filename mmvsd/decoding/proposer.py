"""The one interface every proposer serves decoding through: `Proposer` (what `--drafter` names) and the
`ProposerSession` it opens per batch. A neural drafter (`mmvsd.drafter_base.Drafter`), the n-gram lookup and
the hybrid of both (`mmvsd/drafters/ngram.py`, `mmvsd/drafters/hybrid.py`) implement it; the decode loop, the acceptance
evaluator and the cost profiler know nothing else about them.

Glossary: a session is *advanced* with the pairs the target committed (a feature and the token after it);
it may *defer* them (hold them back, fed in one pass when it next drafts); it proposes the children of the
tree's root (`root_candidates`) and of each frontier (`expand`), and its `light_expander` is the part that
drafts at no model cost (the n-gram lookup), or None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:  # types only
    from mmvsd.decoding.draft_session import DraftInputs
    from mmvsd.drafter_base import Drafter


@runtime_checkable
class ProposerSession(Protocol):
    """A proposer's state while decoding a batch of B rows."""

    def advance(self, inputs: DraftInputs) -> None:
        """Read newly committed pairs (and any deferred ones)."""

    def defer(self, inputs: DraftInputs) -> None:
        """Hold committed pairs back; the next `advance` or draft reads them first."""

    def light_expander(self) -> ProposerSession | None:
        """The part of this session that drafts at no model cost, or None."""

    def root_candidates(self, topk: int) -> tuple[Tensor, Tensor]:
        """Children of each row's root: target token ids, log-probs [B, k]."""

    def expand(self, token_ids: Tensor, parent_slots: Tensor, block_mask: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        """Children of a frontier of K nodes: token_ids [B, K] -> ids, log-probs [B, K, k]."""

    def end_round(self) -> None:
        """Forget the tree drafted since the last `advance` (verification is over)."""

    def select_rows(self, rows: Tensor) -> None:
        """Keep only these rows [B'] (finished sequences leave the batch)."""


@runtime_checkable
class Proposer(Protocol):
    """What decoding drafts with."""

    drafter_type: str  # its kind, as cost profiles and reports name it
    reads_aux: bool  # whether `target_features` needs the target's auxiliary hidden states
    proposes_from_context: bool  # it proposes tokens found in the context (any of the target's vocabulary)
    # and learns their acceptance while decoding, so its statistics belong to one batch

    @property
    def neural(self) -> Drafter | None:
        """The neural drafter whose weights it runs (itself, a hybrid's), or None for a weight-free one."""

    def check_media(self, num_spans: int) -> None:
        """UserError when it cannot draft for a prompt with this many media spans."""

    def target_features(self, aux_hidden: Tensor | None, last_hidden: Tensor) -> Tensor:
        """[B, N, F] what it reads of the target at each position ([B, N, 0] for nothing)."""

    def new_session(self, batch_size: int) -> ProposerSession:
        """A fresh session for a batch of `batch_size` rows."""
