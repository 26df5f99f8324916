"""`mmvsd export`: write a drafter folder of ours in a registered checkpoint layout (for vLLM, SGLang,
speculators, ...), atomically, refusing to overwrite what it should not."""

from __future__ import annotations

from pathlib import Path

from mmvsd.checkpoints import read_config
from mmvsd.drafter_base import load_drafter
from mmvsd.errors import UserError
from mmvsd.files import atomic_dir
from mmvsd.layouts.registry import layout, layouts_for
from mmvsd.target import Target
from mmvsd.target_loader import load_target


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
    drafter = load_drafter(drafter_dir, target)
    with atomic_dir(out_dir) as tmp:
        chosen.export_for(drafter, tmp, target)
    return out_dir


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
    return load_target(spec)
