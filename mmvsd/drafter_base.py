"""The drafter interface (`Drafter`, `DraftInputs`, `PairMedia`) and the helpers drafter files share.

EAGLE-family drafters read "pairs": at committed position t they see a feature of position t
(the target's auxiliary hidden states, or their own output hidden state inside a draft tree) and
the embedding of token t+1, and predict token t+2. A `DraftSession` (`mmvsd.decoding.draft_session`) keeps a
drafter's own ragged KV cache in step with the target's while decoding. The registry that loads an
architecture by name is here (`drafter_class`, `load_drafter`); the architectures register themselves from
`mmvsd/drafters/`, one file each.

Media reach a drafter as `PairMedia`: for every pair, the target's input embedding of the pair's
next token (the projected media embedding inside a media span) and which span that token is in.
Drafters that do not read media (EAGLE-3) embed the placeholder token ids instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from mmvsd.checkpoints import read_config
from mmvsd.decoding.draft_session import DraftInputs, DraftSession  # noqa: F401  (DraftInputs: re-exported)
from mmvsd.decoding.kv import RaggedCache
from mmvsd.errors import UserError
from mmvsd.files import atomic_dir
from mmvsd.plugins import load_plugins


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


class Drafter(nn.Module):
    """Base class of drafter architectures; subclasses live in `mmvsd/drafters/`, one file each."""

    drafter_type: ClassVar[str] = ""
    media_curriculum: ClassVar[bool] = False  # train text-only first, then more and more media samples
    reads_media: ClassVar[bool] = False  # reads media embeddings (`PairMedia`): trains on data with media
    reads_aux: ClassVar[bool] = True  # whether `target_features` needs the auxiliary layers' hidden states
    proposes_from_context: ClassVar[bool] = False  # proposes from its draft vocabulary, never from the context
    stacks_layers: ClassVar[bool] = False  # takes draft_layers > 1 and init_layers_from_target (EAGLE-3)
    narrowable: ClassVar[bool] = False  # drafts through the target's head: `restricted` can narrow a trained one

    @property
    def neural(self) -> Drafter:
        """The neural drafter whose weights it runs: itself (the `Proposer` interface)."""
        return self

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, seed: int = 0, num_layers: int = 1) -> Drafter:
        """A freshly initialised drafter sized for `target`, with `num_layers` decoder layers where its kind can
        stack them (UserError where it cannot)."""
        raise NotImplementedError

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use `target_ids` [Vd] (e.g. the most frequent training tokens) as the draft vocabulary."""
        raise NotImplementedError

    def restricted(self, target_ids: Tensor) -> Drafter:
        """A copy of this trained drafter drafting over `target_ids` alone, its weights unchanged (drafters whose
        head is the target's, where a smaller draft vocabulary only cuts the draft step's cost)."""
        raise UserError(not_narrowable(self))

    def init_from_target(self, target) -> None:
        """Copy what can start from the target's own weights (e.g. the LM head); default: nothing."""

    def init_layers_from_target(self, target) -> None:
        """Start the decoder layer(s) from the target's own last layer(s), where shapes allow."""
        raise UserError(f"a {self.drafter_type} drafter cannot start its decoder layers from the target's "
                        f"(init_layers_from_target=false)")

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_vocab_target_ids().numel())

    def target_features(self, aux_hidden: Tensor | None, last_hidden: Tensor) -> Tensor:
        """The target features this drafter reads per position: the auxiliary layers' hidden states
        ([.., F]) by default; EAGLE-1-style drafters read the final hidden states ([.., H])."""
        return aux_hidden

    def check_media(self, num_spans: int) -> None:
        """Raise UserError if a sequence with `num_spans` media items is more than this drafter takes."""

    def read_target(
        self, features: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor,
        cache: RaggedCache | None, media: PairMedia | None = None,
    ) -> Tensor:
        """Output hidden states [B, Q, H'] of Q committed pairs; appends their KV to `cache` as its block.

        features [B, Q, F] the target's (`target_features`); token_ids [B, Q] target-vocab ids of the
        next tokens; positions [B, Q]; attention_mask [B, 1, Q, T] additive; media: what the next tokens
        are when they are media. H' is the drafter's own state width (callers never look inside).
        """
        raise NotImplementedError

    def read_draft(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
    ) -> Tensor:
        """Output hidden states [B, Q, H'] of Q draft pairs inside a tree (or a training-time-test step):
        their feature is the drafter's own output [B, Q, H'] at the parent; otherwise as `read_target`."""
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


def not_narrowable(drafter: Drafter) -> str:
    """Why `drafter` (not `narrowable`) cannot be given a smaller draft vocabulary after training."""
    return (f"a {drafter.drafter_type} drafter drafts through a head of its own, trained over its draft vocabulary "
            f"({drafter.draft_vocab_size} tokens): choose that size when training (draft_vocab_size=N)")


def target_to_draft_ids(drafter: Drafter, vocab_size: int) -> Tensor:
    """[V] long: the draft id of every target id, -1 where it is outside the draft vocabulary."""
    vocab_ids = drafter.draft_vocab_target_ids()
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab_ids.device)
    index[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
    return index


DRAFTERS: dict[str, type[Drafter]] = {}  # drafter_type -> class; filled by the plugins (`mmvsd/drafters/` built in)


def register_drafter(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make a drafter architecture loadable by its `drafter_type`."""
    if not cls.drafter_type:
        raise ValueError(f"{cls.__name__} has no drafter_type")
    DRAFTERS[cls.drafter_type] = cls
    return cls


def drafter_class(name: str) -> type[Drafter]:
    """The drafter class whose `drafter_type` is `name` (clear error listing the known ones)."""
    load_plugins()
    if name not in DRAFTERS:
        raise UserError(f"unknown drafter type {name!r}; registered: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[name]


def load_drafter(path: str | Path, target) -> Drafter:
    """Load a drafter directory (config.json + model.safetensors) for `target`."""
    path = Path(path)
    drafter_type = read_config(path).get("mmvsd_drafter_type")
    if not drafter_type:
        raise UserError(f"{path / 'config.json'} does not name an mmvsd drafter type (key 'mmvsd_drafter_type')")
    drafter = drafter_class(drafter_type).from_pretrained(path, target)
    drafter.check_target(target)
    return drafter
