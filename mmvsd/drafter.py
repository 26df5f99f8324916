"""The drafter interface, the drafter registry, and the decoding session every drafter shares.

EAGLE-family drafters read "pairs": at committed position t they see a feature of position t
(the target's auxiliary hidden states, or their own output hidden state inside a draft tree) and
the embedding of token t+1, and predict token t+2. A `DraftSession` keeps a drafter's own ragged
KV cache in step with the target's and implements the tree builder's `TreeExpander` protocol.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from mmvsd.errors import UserError
from mmvsd.kv import RaggedCache, sequence_block

DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter architecture loadable by its `drafter_type` name."""

    def add(cls: type[Drafter]) -> type[Drafter]:
        cls.drafter_type = name
        DRAFTERS[name] = cls
        return cls

    return add


def drafter_class(name: str) -> type[Drafter]:
    """The registered drafter class called `name` (clear error listing the known ones)."""
    import mmvsd.drafters  # noqa: F401  (registers the built-in drafters)

    if name not in DRAFTERS:
        raise UserError(f"unknown drafter type {name!r}; registered: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[name]


@dataclass(frozen=True)
class DraftInputs:
    """Positions newly committed by the target, to be fed to the drafter as pairs."""

    features: Tensor  # [B, A, F] target features at each committed position
    next_ids: Tensor  # [B, A] the token that follows each position
    num_new: Tensor  # [B] valid pairs per row (rows are right-padded)


class Drafter(nn.Module):
    """Base class of drafter architectures; subclasses live in `drafters/`, one file each."""

    drafter_type: ClassVar[str] = ""

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, seed: int = 0) -> Drafter:
        """A freshly initialised drafter sized for `target`."""
        raise NotImplementedError

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use `target_ids` [Vd] (e.g. the most frequent training tokens) as the draft vocabulary."""
        raise NotImplementedError

    def forward(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache,
        from_target: bool,
    ) -> Tensor:
        """Output hidden states [B, Q, H] for Q pairs; appends their KV to `cache` as its block.

        hidden [B, Q, F] target features if `from_target`, else [B, Q, H] own hidden states;
        token_ids [B, Q] target-vocab ids of the next tokens; positions [B, Q];
        attention_mask [B, 1, Q, T] additive.
        """
        raise NotImplementedError

    def draft_logprobs(self, hidden: Tensor) -> Tensor:
        """[..., Vd] float32 log-probabilities over the draft vocabulary."""
        raise NotImplementedError

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids."""
        raise NotImplementedError

    def draft_vocab_target_ids(self) -> Tensor:
        """[Vd] target-vocabulary id of every draft-vocabulary entry, in draft-id order."""
        raise NotImplementedError

    def check_target(self, target) -> None:
        """Raise UserError if this drafter was not made for `target` (sizes, vocabulary)."""
        raise NotImplementedError

    def save_pretrained(self, out_dir: str | Path) -> None:
        raise NotImplementedError

    def new_session(self, batch_size: int) -> DraftSession:
        return DraftSession(self, batch_size)


def load_drafter(path: str | Path, target) -> Drafter:
    """Load a drafter directory (config.json + model.safetensors) for `target`."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"drafter directory {path} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"drafter config {config_file} is not valid JSON: {err}") from None
    drafter_type = config.get("mmvsd_drafter_type")
    if not drafter_type:
        raise UserError(f"{config_file} does not name an mmvsd drafter type (key 'mmvsd_drafter_type')")
    drafter = drafter_class(drafter_type).from_pretrained(path, target)
    drafter.check_target(target)
    return drafter


def target_to_draft_ids(drafter: Drafter, vocab_size: int) -> Tensor:
    """[V] long: the draft id of every target id, -1 where it is outside the draft vocabulary."""
    vocab_ids = drafter.draft_vocab_target_ids()
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab_ids.device)
    index[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
    return index


class DraftSession:
    """One drafter's state while decoding a batch: its ragged KV cache and last outputs."""

    def __init__(self, drafter: Drafter, batch_size: int) -> None:
        self.drafter = drafter
        device = next(drafter.parameters()).device
        self.dtype = next(drafter.parameters()).dtype
        self.cache = RaggedCache(batch_size, device)
        self.last_hidden: Tensor | None = None  # [B, H] output at each row's last committed pair
        self.frontier_hidden: Tensor | None = None  # [B, K, H] outputs of the last expanded frontier
        self.num_expanded = 0

    @torch.no_grad()
    def advance(self, inputs: DraftInputs) -> None:
        """Feed newly committed pairs and commit them to the drafter's cache."""
        batch, width = inputs.next_ids.shape
        device = inputs.next_ids.device
        depths, causal = sequence_block(batch, width, device)
        hidden = self.drafter(
            inputs.features.to(self.dtype), inputs.next_ids, self.cache.positions(depths),
            self.cache.attention_mask(causal, self.dtype), self.cache, from_target=True,
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
        hidden = self.drafter(
            parent_hidden, token_ids, self.cache.positions(depths),
            self.cache.attention_mask(block_mask, self.dtype), self.cache, from_target=False,
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
