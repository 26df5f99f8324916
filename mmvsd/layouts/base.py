"""The checkpoint-layout interface: `Layout` (one way of storing a drafter on disk) and what layouts share.

A `Layout` ties one of our drafter architectures to a folder layout that someone else publishes or
serves (vLLM / SGLang EAGLE-3, MSD, ViSpec, ...): `export` writes it, `load` reads it back into our
drafter (what the layout leaves out, such as token embeddings, comes from the target), `detect`
recognises it from config.json and the weight names, and `released` maps a target name to the HF
repo id of the drafter published for that target. Layouts live beside their drafter in `mmvsd/drafters/`;
the registry that names them is `mmvsd.layouts.registry`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from mmvsd.drafter_base import Drafter
from mmvsd.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

    from mmvsd.target import Target


class NotThisLayout(UserError):
    """A checkpoint read with a layout it is not in; the registry (`mmvsd.layouts.registry.load_with`) adds which
    registered layout it looks like, else `looks_like` (the layout's own guess, may be empty)."""

    def __init__(self, message: str, config: dict, keys: set[str], looks_like: str = "") -> None:
        super().__init__(message)
        self.config, self.keys, self.looks_like = config, keys, looks_like


class Layout:
    """One way of storing a drafter architecture on disk; the registry (`mmvsd.layouts.registry`) holds one instance
    of each subclass."""

    name: ClassVar[str] = ""
    drafter_type: ClassVar[str] = ""  # our drafter architecture it holds ("" for any of ours)
    released: ClassVar[dict[str, str]] = {}  # target name -> HF repo id of the released drafter
    # target name -> what to tell a user whose target's entry in `released` was made for another target
    released_notes: ClassVar[dict[str, str]] = {}

    serving_note: ClassVar[str] = ""  # who reads this layout, said when a drafter cannot be exported to it
    detect_first: ClassVar[bool] = False  # `detect` relies on an unambiguous config.json marker
    single_file: ClassVar[str] = ""  # the one file this layout writes into its folder ("": a folder of files)

    def export(self, drafter: Drafter, out_dir: Path) -> None:
        """Write `drafter` into the existing empty folder `out_dir`."""
        raise NotImplementedError

    def export_for(self, drafter: Drafter, out_dir: Path, target: Target, **options) -> None:
        """Write `drafter`, made for `target`, into `out_dir` (layouts that record target facts override it);
        `options` are a layout's own settings (gguf: `out_type`)."""
        self.export(drafter, out_dir)

    def load(self, path: Path, target: Target) -> Drafter:
        """Read the folder `path` into our drafter, made for `target` (UserError if it does not fit)."""
        raise NotImplementedError

    def detect(self, config: dict, keys: set[str]) -> bool:
        """Whether a checkpoint with this config.json and these weight names is in this layout."""
        raise NotImplementedError


def load_checked_state(drafter: Drafter, state: dict[str, Tensor], target: Target) -> Drafter:
    """Load an already checked state (cast to the drafter's dtypes) and hand the drafter over for `target`."""
    dtypes = {k: v.dtype for k, v in drafter.state_dict().items()}
    drafter.load_state_dict({k: v.to(dtypes[k]) for k, v in state.items()})
    drafter.check_target(target)
    return drafter.to(device=target.device, dtype=target.dtype).eval()
