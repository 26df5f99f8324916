"""The `mmvsd export` command line: its parser and runner, light to import (`mmvsd --help` loads no model code)."""

from __future__ import annotations

import argparse


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
    from mmvsd.layouts.export import export_drafter  # loads torch and the drafters: only when exporting

    out_dir = export_drafter(args.drafter, args.format, args.output, target_spec=args.target, force=args.force)
    print(f"{args.format} drafter written to {out_dir}")
