"""Checkpoint layouts: drafters read from and written to other projects' formats.

A `Layout` ties one of our drafter architectures to a folder layout that someone else publishes or
serves (vLLM / SGLang EAGLE-3, MSD, ViSpec, ...): `export` writes it, `load` reads it back into our
drafter (what the layout leaves out, such as token embeddings, comes from the target), `detect`
recognises it from config.json and the weight names, and `released` maps a target name to the HF
repo id of the drafter published for that target. Layouts live beside their drafter in `drafters/`
and call `register_layout`; `hf` is our own `save_pretrained` folder, so exporting to it round-trips.

`--init` (see `resolve_init`) accepts:
    none          start from a freshly initialised drafter
    PATH          a drafter folder of ours (or a folder a registered layout recognises)
    LAYOUT        the drafter released for the target in that layout, from the local HF cache
    LAYOUT:PATH   a local folder in that layout
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from mmvsd.errors import UserError
from mmvsd.files import atomic_dir

if TYPE_CHECKING:
    from torch import Tensor

    from mmvsd.drafter import Drafter
    from mmvsd.target import Target

LAYOUTS: dict[str, Layout] = {}
CONFIG_FILE = "config.json"
# weight files a layout may use, in the order they are looked for
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


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
        from mmvsd.drafter import load_drafter

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


# ---- reading checkpoint folders (shared by every layout) ----

def load_checked_state(drafter: Drafter, state: dict[str, Tensor], target: Target) -> Drafter:
    """Load an already checked state (cast to the drafter's dtypes) and hand the drafter over for `target`."""
    dtypes = {k: v.dtype for k, v in drafter.state_dict().items()}
    drafter.load_state_dict({k: v.to(dtypes[k]) for k, v in state.items()})
    drafter.check_target(target)
    return drafter.to(device=target.device, dtype=target.dtype).eval()


def read_config(path: Path) -> dict:
    """config.json of the checkpoint folder `path` as a dict (UserError if absent or invalid)."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise UserError(f"checkpoint folder {path} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} does not hold a JSON object")
    return config


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint folder (single file or the shards an index names)."""
    path = Path(path)
    for name in WEIGHT_FILES:
        found = path / name
        if not found.is_file():
            continue
        if not name.endswith(".index.json"):
            return [found]
        try:
            shards = sorted(set(json.loads(found.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise UserError(f"{found} is not a valid weight index: {err}") from None
        return [path / shard for shard in shards]
    raise UserError(f"{path} holds no weights (looked for {', '.join(WEIGHT_FILES)})")


def _read_errors() -> tuple[type[Exception], ...]:
    """What reading a missing, truncated or corrupt weight file raises (safetensors, torch.load)."""
    import pickle

    from safetensors import SafetensorError

    return (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError)


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder by name, on the CPU, as stored (safetensors or .bin)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Tensor] = {}
    for file in weight_files(path):
        try:
            if file.suffix == ".safetensors":
                part = load_file(str(file))
            else:
                part = torch.load(file, map_location="cpu", weights_only=True)
        except _read_errors() as err:
            raise UserError(f"cannot read weights {file}: {type(err).__name__}: {err}") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise UserError(f"{file} does not hold a flat mapping of tensor names to tensors")
        tensors.update(part)
    return tensors


def read_keys(path: Path) -> set[str]:
    """Tensor names of a checkpoint folder, without reading safetensors data."""
    from safetensors import safe_open

    files = weight_files(path)
    if all(f.suffix == ".safetensors" for f in files):
        try:
            keys: set[str] = set()
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    keys.update(handle.keys())
            return keys
        except _read_errors() as err:
            raise UserError(f"cannot read weights in {path}: {type(err).__name__}: {err}") from None
    return set(read_tensors(path))


# ---- --init ----

@dataclass(frozen=True)
class InitSource:
    """Where `--init` points: a folder and the layout to read it with."""

    layout: Layout
    path: Path

    def load(self, target: Target) -> Drafter:
        return self.layout.load(self.path, target)


def resolve_init(spec: str, target_name: str) -> InitSource | None:
    """Resolve `--init` (none | PATH | LAYOUT | LAYOUT:PATH) to a folder and layout; None for none."""
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
    raise UserError(f"--init {spec!r}: no such folder, and not 'none', a layout name ({', '.join(names)}) "
                    f"or LAYOUT:PATH")


def load_init(spec: str, target: Target) -> Drafter | None:
    """The drafter `--init` names, loaded for `target` (None for none)."""
    source = resolve_init(spec, target.name)
    return None if source is None else source.load(target)


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


def released_folder(layout: Layout, target_name: str) -> Path:
    """The local HF-cache snapshot of the drafter released in `layout` for `target_name`."""
    repo_id = layout.released.get(target_name)
    if repo_id is None:
        known = ", ".join(sorted(layout.released)) or "none"
        raise UserError(f"no released {layout.name} drafter is known for target {target_name!r} (known targets: "
                        f"{known}); pass --init {layout.name}:PATH for a local folder, or train from scratch")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir = hf_hub_cache()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise UserError(f"the released {layout.name} drafter for {target_name!r} is {repo_id}, which is not in the "
                        f"local HF cache ({cache_dir}); download it with `huggingface-cli download {repo_id}` "
                        f"(on a machine with hub access) or pass --init {layout.name}:PATH") from None


def hf_hub_cache() -> str:
    """The HF hub cache folder, read from the environment now (not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


# ---- export ----

def export_drafter(
    drafter_dir: str | Path, fmt: str, out_dir: str | Path, target_spec: str | None = None, *,
    target: Target | None = None, force: bool = False,
) -> Path:
    """Write our drafter folder `drafter_dir` to `out_dir` in layout `fmt`, atomically; returns `out_dir`.

    The drafter is loaded for `target` (or the target `target_spec` names, default: the one its
    config records), since some architectures borrow the target's embeddings.
    """
    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    chosen = layout(fmt)
    config = read_config(drafter_dir)
    drafter_type = config.get("mmvsd_drafter_type")
    if not drafter_type:
        raise UserError(f"{drafter_dir} is not an mmvsd drafter folder (no 'mmvsd_drafter_type' in its config.json)")
    if chosen.drafter_type and chosen.drafter_type != drafter_type:
        note = f" ({chosen.serving_note})" if chosen.serving_note else ""
        raise UserError(f"--format {fmt} holds {chosen.drafter_type!r} drafters{note}; {drafter_dir} is a "
                        f"{drafter_type!r} drafter, which it cannot represent (its own layouts: "
                        f"{', '.join(layouts_for(drafter_type))})")
    check_export_target(drafter_dir, out_dir, force)
    if target is None:
        target = _export_target(config, target_spec, drafter_dir)
    from mmvsd.drafter import load_drafter

    drafter = load_drafter(drafter_dir, target)
    with atomic_dir(out_dir) as tmp:
        chosen.export_for(drafter, tmp, target)
    return out_dir


def layouts_for(drafter_type: str) -> list[str]:
    """Names of the registered layouts that can hold a drafter of `drafter_type` (hf holds every one)."""
    return [name for name in layout_names() if LAYOUTS[name].drafter_type in ("", drafter_type)]


def check_export_target(drafter_dir: Path, out_dir: Path, force: bool) -> None:
    """Refuse to replace the source folder, a file, or (without `force`) a non-empty folder."""
    if out_dir.exists() and out_dir.resolve() == drafter_dir.resolve():
        raise UserError(f"output {out_dir} is the drafter folder itself; choose another output folder")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UserError(f"output folder {out_dir} is not empty; pass --force to replace it")


def _export_target(config: dict, target_spec: str | None, drafter_dir: Path) -> Target:
    spec = target_spec or config.get("target_name")
    if not spec:
        raise UserError(f"{drafter_dir} does not record its target; pass --target")
    from mmvsd.targets import load_target

    return load_target(spec)


def add_export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `mmvsd export --drafter DIR --format NAME [--target T] [--force] OUT` to a CLI."""
    p = sub.add_parser("export", help="write a trained drafter in another checkpoint layout (e.g. for vLLM/SGLang)",
                       description="Write a drafter folder of ours in a registered checkpoint layout, e.g. "
                       "eagle3 (what vLLM and SGLang load), speculators (the `speculators` package's format) or hf "
                       "(ours). vLLM and SGLang serve only EAGLE-3-style drafters.")
    p.add_argument("--drafter", required=True, help="drafter folder written by `mmvsd train`")
    p.add_argument("--format", required=True, help="checkpoint layout to write (an unknown name lists them)")
    p.add_argument("--target", help="target the drafter was made for (default: the one its config records)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("output", help="output folder (written atomically)")
    return p


def run_export(args: argparse.Namespace) -> None:
    """`mmvsd export`: convert a drafter folder and say where it went."""
    out_dir = export_drafter(args.drafter, args.format, args.output, target_spec=args.target, force=args.force)
    print(f"{args.format} drafter written to {out_dir}")
