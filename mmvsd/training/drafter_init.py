"""What `mmvsd train --init` starts from: a folder and the layout to read it with.

`--init` accepts:
    none          start from a freshly initialised drafter
    PATH          a drafter folder of ours (or a folder a registered layout recognises)
    LAYOUT        the drafter released for the target in that layout, from the local HF cache
    LAYOUT:PATH   a local folder in that layout
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmvsd.checkpoints import hf_cache_snapshot, hf_hub_cache
from mmvsd.errors import UserError
from mmvsd.layouts.base import Layout
from mmvsd.layouts.registry import LAYOUTS, folder_layout, layout_names, load_with
from mmvsd.shipped import default_drafter, list_shipped, resolve_drafter

if TYPE_CHECKING:
    from mmvsd.drafter_base import Drafter
    from mmvsd.target import Target


@dataclass(frozen=True)
class InitSource:
    """Where `--init` points: a folder and the layout to read it with."""

    layout: Layout
    path: Path

    def load(self, target: Target) -> Drafter:
        return load_with(self.layout, self.path, target)


def resolve_init(spec: str, target_name: str) -> InitSource | None:
    """Resolve `--init` (none | PATH | LAYOUT | LAYOUT:PATH | a shipped drafter's name, or default) to a folder and
    layout; None for none."""
    if spec == "none":
        return None
    path = Path(spec).expanduser()
    if path.is_dir():
        return InitSource(folder_layout(path), path)
    names = layout_names()
    name, sep, rest = spec.partition(":")
    if sep and name in LAYOUTS:
        folder = Path(rest).expanduser()
        if not folder.is_dir():
            raise UserError(f"--init {spec}: folder {folder} not found")
        return InitSource(LAYOUTS[name], folder)
    if spec in LAYOUTS:
        return InitSource(LAYOUTS[spec], released_folder(LAYOUTS[spec], target_name))
    shipped = {drafter.name: drafter for drafter in list_shipped() if drafter.target == target_name}
    if spec in shipped or (spec == "default" and default_drafter(target_name) is not None):
        folder = resolve_drafter(spec, target_name)  # verified against its manifest
        return InitSource(folder_layout(folder), folder)
    raise UserError(f"--init {spec!r}: no such folder, and not 'none', a layout name ({', '.join(names)}), "
                    f"LAYOUT:PATH or a shipped drafter of {target_name!r} ({', '.join(shipped) or 'none'})")


def released_folder(layout: Layout, target_name: str) -> Path:
    """The local HF-cache snapshot of the drafter released in `layout` for `target_name`."""
    repo_id = layout.released.get(target_name)
    note = layout.released_notes.get(target_name)
    if note is not None:
        print(f"mmvsd: note: {note}", file=sys.stderr, flush=True)
    if repo_id is None:
        known = ", ".join(sorted(layout.released)) or "none"
        raise UserError(f"no released {layout.name} drafter is known for target {target_name!r} (known targets: "
                        f"{known}); pass --init {layout.name}:PATH for a local folder, or train from scratch")
    folder = hf_cache_snapshot(repo_id)
    if folder is None:
        raise UserError(f"the released {layout.name} drafter for {target_name!r} is {repo_id}, which is not in the "
                        f"local HF cache ({hf_hub_cache()}); download it with `huggingface-cli download {repo_id}` "
                        f"(on a machine with hub access) or pass --init {layout.name}:PATH")
    return folder
