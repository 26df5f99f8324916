"""The drafter interface, the drafter registry, and the decoding session every drafter shares.

EAGLE-family drafters read "pairs": at committed position t they see a feature of position t
(the target's auxiliary hidden states, or their own output hidden state inside a draft tree) and
the embedding of token t+1, and predict token t+2. A `DraftSession` keeps a drafter's own ragged
KV cache in step with the target's and implements the tree builder's `TreeExpander` protocol.

Media reach a drafter as `PairMedia`: for every pair, the target's input embedding of the pair's
next token (the projected media embedding inside a media span) and which span that token is in.
Drafters that do not read media (EAGLE-3) embed the placeholder token ids instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from mmvsd.checkpoints import read_config
from mmvsd.errors import UserError
from mmvsd.files import atomic_dir
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
class PairMedia:
    """Media seen by pairs: what the target reads at each pair's next token."""

    embeds: Tensor  # [B, Q, H] target input embeddings of the next token (projected media in spans)
    span_ids: Tensor  # [B, Q] long: -1 where the next token is text, else its media span (0, 1, ... per row)

    @classmethod
    def from_tokens(cls, token_embeds: Tensor, token_span_ids: Tensor) -> PairMedia:
        """Pairs of a token sequence ([B, T, H], [B, T]): pair t's next token is token t+1 (last: text)."""
        embeds = torch.cat([token_embeds[:, 1:], torch.zeros_like(token_embeds[:, :1])], dim=1)
        span_ids = torch.cat([token_span_ids[:, 1:], torch.full_like(token_span_ids[:, :1], -1)], dim=1)
        return cls(embeds, span_ids)

    @property
    def mask(self) -> Tensor:
        """[B, Q] bool: the next token is a media token."""
        return self.span_ids >= 0


@dataclass(frozen=True)
class DraftInputs:
    """Positions newly committed by the target, to be fed to the drafter as pairs."""

    features: Tensor  # [B, A, F] target features at each committed position (`Drafter.target_features`)
    next_ids: Tensor  # [B, A] the token that follows each position
    num_new: Tensor  # [B] valid pairs per row (rows are right-padded)
    media: PairMedia | None = None  # media at the following tokens (prompts with images), else None


class Drafter(nn.Module):
    """Base class of drafter architectures; subclasses live in `drafters/`, one file each."""

    drafter_type: ClassVar[str] = ""
    media_curriculum: ClassVar[bool] = False  # train text-only first, then more and more media samples
    reads_aux: ClassVar[bool] = True  # whether `target_features` needs the auxiliary layers' hidden states

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, seed: int = 0) -> Drafter:
        """A freshly initialised drafter sized for `target`."""
        raise NotImplementedError

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use `target_ids` [Vd] (e.g. the most frequent training tokens) as the draft vocabulary."""
        raise NotImplementedError

    def init_from_target(self, target) -> None:
        """Copy what can start from the target's own weights (e.g. the LM head); default: nothing."""

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_vocab_target_ids().numel())

    def target_features(self, aux_hidden: Tensor | None, last_hidden: Tensor) -> Tensor:
        """The target features this drafter reads per position: the auxiliary layers' hidden states
        ([.., F]) by default; EAGLE-1-style drafters read the final hidden states ([.., H])."""
        return aux_hidden

    def check_media(self, num_spans: int) -> None:
        """Raise UserError if a sequence with `num_spans` media items is more than this drafter takes."""

    def forward(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache,
        from_target: bool, media: PairMedia | None = None,
    ) -> Tensor:
        """Output hidden states [B, Q, H'] for Q pairs; appends their KV to `cache` as its block.

        hidden [B, Q, F] target features if `from_target`, else [B, Q, H'] own hidden states;
        token_ids [B, Q] target-vocab ids of the next tokens; positions [B, Q];
        attention_mask [B, 1, Q, T] additive; media: what the next tokens are when they are media.
        H' is the drafter's own state width (the tree builder and objectives never look inside).
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

    def new_cache(self, batch_size: int, device: torch.device | str) -> RaggedCache:
        """The drafter's own KV cache (a drafter that keeps more beside its keys and values subclasses it)."""
        return RaggedCache(batch_size, device)


def load_drafter(path: str | Path, target) -> Drafter:
    """Load a drafter directory (config.json + model.safetensors) for `target`."""
    path = Path(path)
    drafter_type = read_config(path).get("mmvsd_drafter_type")
    if not drafter_type:
        raise UserError(f"{path / 'config.json'} does not name an mmvsd drafter type (key 'mmvsd_drafter_type')")
    drafter = drafter_class(drafter_type).from_pretrained(path, target)
    drafter.check_target(target)
    return drafter


def check_fits_target(target, hidden_size: int, vocab_size: int, made_for: str, extra: list[str] = ()) -> None:
    """UserError listing every way a drafter of these sizes (made for `made_for`) does not fit `target`."""
    problems = []
    if hidden_size != target.hidden_size:
        problems.append(f"hidden size {hidden_size} != target's {target.hidden_size}")
    if vocab_size != target.vocab_size:
        problems.append(f"vocabulary {vocab_size} != target's {target.vocab_size}")
    problems += extra
    if problems:
        made_for = f" (made for {made_for!r})" if made_for else ""
        raise UserError(f"drafter does not fit target {target.name!r}{made_for}: " + "; ".join(problems))


def save_drafter_folder(drafter: Drafter, config: dict, out_dir: str | Path) -> None:
    """Write config.json (with `mmvsd_drafter_type`) + model.safetensors atomically."""
    config = {"mmvsd_drafter_type": drafter.drafter_type, "architectures": [type(drafter).__name__], **config}
    tensors = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})


def read_drafter_config(path: str | Path, config_class: type, what: str):
    """The `config_class` dataclass from a drafter folder's config.json (unknown keys are ignored)."""
    path = Path(path)
    raw = read_config(path)
    known = {f.name for f in fields(config_class)}
    try:
        return config_class(**{k: v for k, v in raw.items() if k in known})
    except TypeError as err:
        raise UserError(f"{path / 'config.json'} is not {what} drafter config: {err}") from None


def load_drafter_weights(drafter: Drafter, path: str | Path, what: str) -> None:
    """Load model.safetensors into `drafter`; any missing or unexpected key is an error."""
    path = Path(path)
    try:
        state = load_file(str(path / "model.safetensors"))
    except Exception as err:  # noqa: BLE001  missing or corrupt file: safetensors raises several types
        raise UserError(f"cannot read drafter weights {path / 'model.safetensors'}: {err}") from None
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"drafter weights in {path} do not match the {what} layout: "
                        f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")


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
        hidden = self.drafter(
            inputs.features.to(self.dtype), inputs.next_ids, self.cache.positions(depths),
            self.cache.attention_mask(causal, self.dtype), self.cache, from_target=True, media=inputs.media,
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
