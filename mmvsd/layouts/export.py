"""`mmvsd export`: write a drafter folder of ours in a registered checkpoint layout (for vLLM, SGLang,
speculators, ...), atomically, refusing to overwrite what it should not."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mmvsd.checkpoints import read_config
from mmvsd.drafter_base import load_drafter
from mmvsd.errors import UserError
from mmvsd.files import atomic_dir, atomic_path
from mmvsd.layouts.registry import layout, layouts_for
from mmvsd.target import Target
from mmvsd.target_loader import load_target


def export_drafter(
    drafter_dir: str | Path, fmt: str, out_dir: str | Path, target_spec: str | None = None, *,
    target: Target | None = None, force: bool = False, out_type: str | None = None,
) -> Path:
    """Write our drafter folder `drafter_dir` to `out_dir` in layout `fmt`, atomically; returns what was written.

    The drafter is loaded for `target` (or the target `target_spec` names, default: the one its
    config records), since some architectures borrow the target's embeddings. A single-file layout (`gguf`)
    writes the file `out_dir` when it ends in that file's suffix, else `out_dir/<its file name>`; `out_type`
    is its weights' type (`--outtype`).
    """
    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    chosen = layout(fmt)
    if out_type and not chosen.single_file:
        raise UserError(f"--outtype sets the weight type of a single-file layout (gguf); --format {fmt} keeps the "
                        "drafter's own")
    config = read_config(drafter_dir)
    drafter_type = config.get("mmvsd_drafter_type")
    if not drafter_type:
        raise UserError(f"{drafter_dir} is not an mmvsd drafter folder (no 'mmvsd_drafter_type' in its config.json)")
    if chosen.drafter_type and chosen.drafter_type != drafter_type:
        note = f" ({chosen.serving_note})" if chosen.serving_note else ""
        raise UserError(f"--format {fmt} holds {chosen.drafter_type!r} drafters{note}; {drafter_dir} is a "
                        f"{drafter_type!r} drafter, which it cannot represent (its own layouts: "
                        f"{', '.join(layouts_for(drafter_type))})")
    file_out = bool(chosen.single_file) and out_dir.suffix == Path(chosen.single_file).suffix
    check_export_target(drafter_dir, out_dir, force, file_out)
    if target is None:
        target = _export_target(config, target_spec, drafter_dir)
    drafter = load_drafter(drafter_dir, target)
    options = {"out_type": out_type} if out_type else {}
    if not file_out:
        with atomic_dir(out_dir) as tmp:
            chosen.export_for(drafter, tmp, target, **options)
        return out_dir
    with atomic_path(out_dir) as file, tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.",
                                                                   dir=out_dir.parent) as scratch:
        chosen.export_for(drafter, Path(scratch), target, **options)  # the file appears whole, or not at all
        os.replace(Path(scratch) / chosen.single_file, file)
    return out_dir


def check_export_target(drafter_dir: Path, out_dir: Path, force: bool, file_out: bool = False) -> None:
    """Refuse to replace the source folder, a file, or (without `force`) a non-empty folder; for a single-file
    output, refuse a folder, or (without `force`) an existing file."""
    if out_dir.exists() and out_dir.resolve() == drafter_dir.resolve():
        raise UserError(f"output {out_dir} is the drafter folder itself; choose another output folder")
    if file_out:
        if out_dir.is_dir():
            raise UserError(f"output {out_dir} is a folder; name the file to write, or a folder without its suffix")
        if out_dir.exists() and not force:
            raise UserError(f"output file {out_dir} exists; pass --force to replace it")
        return
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UserError(f"output folder {out_dir} is not empty; pass --force to replace it")


def _export_target(config: dict, target_spec: str | None, drafter_dir: Path) -> Target:
    spec = target_spec or config.get("target_name")
    if not spec:
        raise UserError(f"{drafter_dir} does not record its target; pass --target")
    return load_target(spec)
