"""The `mmvsd export` command line's parser, light to import (`mmvsd --help` loads no model code); its runner,
which resolves what `--drafter` names, is `mmvsd.drafters.export_spec.run_export`."""

from __future__ import annotations

import argparse


def add_export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `mmvsd export --drafter DIR --format NAME [--target T] [--force] OUT` to a CLI."""
    p = sub.add_parser("export", help="write a trained drafter in another checkpoint layout (e.g. for vLLM/SGLang)",
                       description="Write a drafter folder of ours in a registered checkpoint layout, e.g. "
                       "eagle3 (what vLLM and SGLang load), speculators (the `speculators` package's format), gguf "
                       "(llama.cpp) or hf (ours). vLLM and SGLang serve only EAGLE-3-style drafters.")
    p.add_argument("--drafter", required=True, help="drafter folder written by `mmvsd train`, `default` or a shipped "
                   "drafter's name (with --target), or model:NAME (a draft model: --format gguf)")
    p.add_argument("--format", required=True, help="checkpoint layout to write (an unknown name lists them)")
    p.add_argument("--target", help="target the drafter was made for (default: the one its config records)")
    p.add_argument("--outtype", choices=("f16", "bf16", "f32", "q8_0"), help="gguf: the weights' type (default f16)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("output", help="output folder, or for gguf a FILE.gguf (written atomically)")
    return p
