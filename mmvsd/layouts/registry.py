"""The checkpoint-layout registry: every layout by name (ours, `hf`, and those the plugins register: the built-in
drafters' from `mmvsd/drafters/*_layout.py`), recognising a folder's layout, and loading through a layout with a hint
when a folder is in another. The interface is `mmvsd.layouts.base`; reading the folders is `mmvsd.checkpoints`;
`--init` is `mmvsd.training.drafter_init`; `mmvsd export` is `mmvsd.layouts.export`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mmvsd.checkpoints import CONFIG_FILE, read_config, read_keys
from mmvsd.drafter_base import Drafter, load_drafter
from mmvsd.errors import UserError
from mmvsd.layouts.base import Layout, NotThisLayout
from mmvsd.plugins import load_plugins

if TYPE_CHECKING:
    from mmvsd.target import Target

LAYOUTS: dict[str, Layout] = {}


class HFLayout(Layout):
    """Our own folder: config.json with `mmvsd_drafter_type` + model.safetensors (`save_pretrained`)."""

    name = "hf"

    def export(self, drafter: Drafter, out_dir: Path) -> None:
        drafter.save_pretrained(out_dir)

    def load(self, path: Path, target: Target) -> Drafter:
        return load_drafter(path, target)

    def detect(self, config: dict, keys: set[str]) -> bool:
        return bool(config.get("mmvsd_drafter_type"))


def register_layout(layout: Layout) -> Layout:
    """Make `layout` usable by name in `--init` and `mmvsd export`."""
    if not layout.name or ":" in layout.name:
        raise ValueError(f"layout name must be non-empty and without ':', got {layout.name!r}")
    known = LAYOUTS.get(layout.name)
    if known is not None and type(known) is not type(layout):
        raise ValueError(f"layout {layout.name!r} is already registered by {type(known).__name__}")
    LAYOUTS[layout.name] = layout
    return layout


def layout_names() -> list[str]:
    """Names of all registered layouts (the plugins' included)."""
    load_plugins()
    return sorted(LAYOUTS)


def layout(name: str) -> Layout:
    """The registered layout called `name` (clear error listing the known ones)."""
    names = layout_names()
    if name not in names:
        raise UserError(f"unknown checkpoint layout {name!r}; registered: {', '.join(names)}")
    return LAYOUTS[name]


def identify_layout(config: dict, keys: set[str], exclude: tuple[str, ...] = ()) -> str | None:
    """The name of the first registered layout (outside `exclude`) that recognises a checkpoint; layouts
    that a config.json marker identifies for sure (`detect_first`) are asked before the key-pattern ones."""
    for name in sorted(layout_names(), key=lambda n: not LAYOUTS[n].detect_first):
        if name not in exclude and LAYOUTS[name].detect(config, keys):
            return name
    return None


register_layout(HFLayout())


def load_with(chosen: Layout, path: Path, target: Target) -> Drafter:
    """`chosen.load(path, target)`; a folder in another layout is one error that names the layout it is in."""
    try:
        return chosen.load(path, target)
    except NotThisLayout as err:
        other = identify_layout(err.config, err.keys, exclude=(chosen.name,))
        if other is not None:
            raise UserError(f"{err}; it looks like the {other!r} layout (use --init {other}:PATH)") from None
        raise UserError(f"{err}; it looks like {err.looks_like}" if err.looks_like else str(err)) from None


def folder_layout(path: Path) -> Layout:
    """The layout of a folder given as plain PATH: ours, else the registered layout that detects it."""
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        return LAYOUTS["hf"]  # our loader gives its usual "has no config.json" error
    config = read_config(path)
    if LAYOUTS["hf"].detect(config, set()):
        return LAYOUTS["hf"]
    name = identify_layout(config, read_keys(path), exclude=("hf",))
    if name is None:
        raise UserError(f"{config_file} does not name an mmvsd drafter type (key 'mmvsd_drafter_type') and no "
                        f"registered layout ({', '.join(layout_names())}) recognises {path}; "
                        f"pass LAYOUT:PATH to say which it is")
    return LAYOUTS[name]


def layouts_for(drafter_type: str) -> list[str]:
    """Names of the registered layouts that can hold a drafter of `drafter_type` (hf holds every one)."""
    return [name for name in layout_names() if LAYOUTS[name].drafter_type in ("", drafter_type)]
