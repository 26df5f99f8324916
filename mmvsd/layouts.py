"""Checkpoint layouts: drafters read from and written to other projects' formats.

A `Layout` ties one of our drafter architectures to a folder layout that someone else publishes or
serves (vLLM / SGLang EAGLE-3, MSD, ViSpec, ...): `export` writes it, `load` reads it back into our
drafter (what the layout leaves out, such as token embeddings, comes from the target), `detect`
recognises it from config.json and the weight names, and `released` maps a target name to the HF
repo id of the drafter published for that target. Layouts live beside their drafter in `drafters/`
and call `register_layout`; `hf` is our own `save_pretrained` folder, so exporting to it round-trips.

Reading the folders is `mmvsd.checkpoints`; `--init` is `mmvsd.drafter_init`; `mmvsd export` is
`mmvsd.export`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from mmvsd.checkpoints import CONFIG_FILE, read_config, read_keys
from mmvsd.drafter import Drafter, load_drafter
from mmvsd.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

    from mmvsd.target import Target

LAYOUTS: dict[str, Layout] = {}


class Layout:
    """One way of storing a drafter architecture on disk; subclasses register an instance."""

    name: ClassVar[str] = ""
    drafter_type: ClassVar[str] = ""  # our drafter architecture it holds ("" for any of ours)
    released: ClassVar[dict[str, str]] = {}  # target name -> HF repo id of the released drafter

    serving_note: ClassVar[str] = ""  # who reads this layout, said when a drafter cannot be exported to it
    detect_first: ClassVar[bool] = False  # `detect` relies on an unambiguous config.json marker

    def export(self, drafter: Drafter, out_dir: Path) -> None:
        """Write `drafter` into the existing empty folder `out_dir`."""
        raise NotImplementedError

    def export_for(self, drafter: Drafter, out_dir: Path, target: Target) -> None:
        """Write `drafter`, made for `target`, into `out_dir` (layouts that record target facts override it)."""
        self.export(drafter, out_dir)

    def load(self, path: Path, target: Target) -> Drafter:
        """Read the folder `path` into our drafter, made for `target` (UserError if it does not fit)."""
        raise NotImplementedError

    def detect(self, config: dict, keys: set[str]) -> bool:
        """Whether a checkpoint with this config.json and these weight names is in this layout."""
        raise NotImplementedError


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
    """Names of all registered layouts (the built-in drafters' layouts included)."""
    import mmvsd.drafters  # noqa: F401  (registers the built-in drafters and their layouts)

    return sorted(LAYOUTS)


def layout(name: str) -> Layout:
    """The registered layout called `name` (clear error listing the known ones)."""
    names = layout_names()
    if name not in LAYOUTS:
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


def load_checked_state(drafter: Drafter, state: dict[str, Tensor], target: Target) -> Drafter:
    """Load an already checked state (cast to the drafter's dtypes) and hand the drafter over for `target`."""
    dtypes = {k: v.dtype for k, v in drafter.state_dict().items()}
    drafter.load_state_dict({k: v.to(dtypes[k]) for k, v in state.items()})
    drafter.check_target(target)
    return drafter.to(device=target.device, dtype=target.dtype).eval()


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
