"""`mmvsd export`'s runner: what `--drafter` names (a folder, `default` or a shipped name, `model:NAME`) exported
in a registered layout; a draft model (`model:NAME`, or a built-in target's default draft model) exports as the
GGUF file it is read from, which llama.cpp's draft-simple mode loads."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from mmvsd.drafters.draft_model import PREFIX as DRAFT_MODEL
from mmvsd.drafters.draft_model import parse_draft_spec
from mmvsd.errors import UserError
from mmvsd.files import atomic_file
from mmvsd.layouts.export import export_drafter
from mmvsd.layouts.registry import layout
from mmvsd.shipped import resolve_drafter
from mmvsd.target_loader import builtin_targets, target_gguf_file

GGUF = "gguf"


def run_export(args: argparse.Namespace) -> None:
    """`mmvsd export`: convert what `--drafter` names and say where it went."""
    out = export_spec(args.drafter, args.format, args.output, args.target, force=args.force,
                      out_type=getattr(args, "outtype", None))
    print(f"{args.format} drafter written to {out}")


def export_spec(spec: str, fmt: str, out: str | Path, target_name: str | None = None, *, force: bool = False,
                out_type: str | None = None) -> Path:
    """Export the drafter `spec` names for `target_name` in layout `fmt` to `out`; returns what was written."""
    layout(fmt)  # an unknown format is an error before anything is read
    model = draft_model_name(spec, target_name)
    if model is not None:
        if fmt != GGUF:
            raise UserError(f"--drafter {spec} is a draft model, a language model of its own: it exports only as "
                            f"--format {GGUF} (the file llama.cpp's draft-simple mode loads)")
        if out_type:
            raise UserError("--outtype: a draft model is exported as the GGUF file it is read from, as it is")
        return copy_gguf(model, Path(out), force)
    return export_drafter(drafter_folder(spec, target_name), fmt, out, target_spec=target_name, force=force,
                          out_type=out_type)


def draft_model_name(spec: str, target_name: str | None) -> str | None:
    """The draft model `spec` names (`model:NAME[@FMT]`, or `default` for a target whose default is one)."""
    if spec == "default" and target_name:
        builtin = builtin_targets().get(target_name)
        if builtin is not None and builtin.default_drafter:
            spec = builtin.default_drafter
    return parse_draft_spec(spec)[0] if spec.startswith(DRAFT_MODEL) else None


def drafter_folder(spec: str, target_name: str | None) -> Path:
    """A drafter folder, or the verified folder of a shipped drafter (`default` or its name) of `target_name`."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if "/" in spec or spec.endswith((".json", ".safetensors")):
        raise UserError(f"--drafter {spec}: no such drafter folder")
    if not target_name:
        raise UserError(f"--drafter {spec} names a shipped drafter: say whose with --target (`mmvsd drafters list`)")
    return resolve_drafter(spec, target_name)


def copy_gguf(model: str, out: Path, force: bool) -> Path:
    """Copy the GGUF file draft model `model` is read from to `out` (a file ending .gguf, or a folder)."""
    source = target_gguf_file(model)
    if source is None:
        raise UserError(f"draft model {model!r} is not read from a GGUF file; convert it with llama.cpp's "
                        "convert_hf_to_gguf.py for draft-simple")
    dest = out if out.suffix == ".gguf" else out / source.name
    if dest.is_dir() or (dest.exists() and not force):
        raise UserError(f"output {dest} exists; pass --force to replace it" if not dest.is_dir()
                        else f"output {dest} is a folder")
    with atomic_file(dest, "wb") as handle, open(source, "rb") as src:
        shutil.copyfileobj(src, handle, 1 << 24)
    return dest
