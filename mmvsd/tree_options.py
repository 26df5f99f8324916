"""The draft-tree options every command shares: one grammar, and one rule for the parts left unset.

Grammar (`mmvsd generate`, `eval-drafter`, `bench`; the lmms-eval plugin's model_args spell the flags
`tree`, `tree_budget`, `tree_depth`, `tree_topk`):

    --tree auto       each step planned from this machine's measured costs and the acceptance seen so far
    --tree paper      the paper's tree for the prompts' kind
    --tree B/D/K      a fixed shape: budget (nodes verified, root included) / depth / children per node;
                      a part given as 0 takes the paper's value
    --tree-budget B --tree-depth D --tree-topk K
                      the same fixed shape, part by part; the parts not given take the paper's value

The rule for unset parts: the paper's tree for what the prompts show, 60/5/8 when they carry media (images,
the paper's LLaVA setting) and 60/7/10 for text. A parsed option stays a spec string ("auto", "paper",
"0/5/0") until the prompts are known (`tree_shape`, `tree_for_prompts`). This module imports no torch, so
the command line parses fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmvsd.errors import UserError

if TYPE_CHECKING:
    from mmvsd.decoding.tree import TreeShape

TEXT_TREE = (60, 7, 10)  # the paper's tree for text prompts (LLM targets): budget, depth, top-k
MEDIA_TREE = (60, 5, 8)  # and for prompts with media (LLaVA on image benchmarks)
CLI_NAMES = ("--tree", "--tree-budget", "--tree-depth", "--tree-topk")  # how the command line spells the options
GRAMMAR = "auto, paper or BUDGET/DEPTH/TOPK (e.g. 60/7/10; a 0 part takes the paper's value)"


def add_tree_arguments(p: argparse.ArgumentParser, default: str, many: bool = False) -> None:
    """`--tree` (a comma-separated list of shapes when `many`) and `--tree-budget/--tree-depth/--tree-topk`."""
    what = "draft tree shape(s), comma-separated, one tree row per drafter and shape" if many else "draft tree shape"
    p.add_argument("--tree", type=_spec_list if many else str,
                   help=f"{what}: auto (planned per step from this machine's measured costs and the acceptance "
                        f"seen), paper (60/7/10 on text prompts, 60/5/8 on prompts with images) or "
                        f"BUDGET/DEPTH/TOPK, a 0 part taking the paper's value (default {default})")
    p.add_argument("--tree-budget", type=int, help="fixed shape: tree nodes per verification, root included "
                                                   "(default: the paper's, 60)")
    p.add_argument("--tree-depth", type=int, help="fixed shape: maximum depth (default: the paper's, 7 on text "
                                                  "prompts, 5 on prompts with images)")
    p.add_argument("--tree-topk", type=int, help="fixed shape: children per expanded node (default: the paper's, "
                                                 "10 on text prompts, 8 on prompts with images)")
    p.set_defaults(tree_default=default)


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"use on or off, not {text!r}")
    return text == "on"


def add_ngram_argument(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--ngram on|off`: whether a neural drafter's trees hold n-gram branches, read as True / False (None when
    not given: the drafter spec's default)."""
    p.add_argument("--ngram", type=_on_off, metavar="on|off", help=help_text)


def _spec_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def tree_spec_from_args(args: argparse.Namespace) -> str:
    """The one `--tree` spec the flags of `add_tree_arguments(many=False)` name (UserError if they contradict)."""
    return tree_spec(args.tree, args.tree_budget, args.tree_depth, args.tree_topk, args.tree_default)


def tree_spec(tree: str | None, budget: int | None, depth: int | None, topk: int | None, default: str = "auto",
              names: tuple[str, str, str, str] = CLI_NAMES) -> str:
    """The spec of a `--tree` value or of the part flags (None: not given), checked; `default` when none is given."""
    parts = (budget, depth, topk)
    if any(value is not None and value < 1 for value in parts):
        raise UserError(f"{', '.join(names[1:3])} and {names[3]} must be >= 1")
    if tree is not None and any(value is not None for value in parts):
        raise UserError(f"{names[0]} and {'/'.join(names[1:])} are two ways to say one thing: give one")
    if any(value is not None for value in parts):
        return "/".join(str(value or 0) for value in parts)
    spec = default if tree is None else tree
    tree_parts(spec, names[0])
    return spec


def tree_parts(spec: str, name: str = "--tree") -> tuple[int, int, int] | None:
    """(budget, depth, topk) of a spec, 0 for the paper's value; None for "auto" (UserError if malformed)."""
    if spec == "auto":
        return None
    if spec == "paper":
        return (0, 0, 0)
    try:
        parts = tuple(int(part) for part in spec.split("/"))
    except ValueError:
        parts = ()
    if len(parts) != 3 or min(parts) < 0:
        raise UserError(f"{name} {spec!r}: expected {GRAMMAR}")
    return parts


def paper_tree(media: bool) -> tuple[int, int, int]:
    """The paper's (budget, depth, topk) for prompts with media (60/5/8) or text prompts (60/7/10)."""
    return MEDIA_TREE if media else TEXT_TREE


def tree_shape(spec: str, media: bool) -> TreeShape | str:
    """The tree a spec decodes prompts of one kind with: "auto", or a TreeShape whose unset parts are the paper's."""
    from mmvsd.decoding.tree import TreeShape  # imports torch: the command line parses without it

    parts = tree_parts(spec)
    if parts is None:
        return "auto"
    return TreeShape(*(value or fallback for value, fallback in zip(parts, paper_tree(media))))


def tree_for_prompts(spec: str, prompts: Sequence) -> TreeShape | str:
    """`tree_shape` for these prompts (token-id lists or `Prompt`s): the media kind if any of them carries media."""
    from mmvsd.adapter_base import has_media  # imports torch: the command line parses without it

    return tree_shape(spec, has_media(prompts))
