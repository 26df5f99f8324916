"""The commands that show what is installed and measured, and the export: `mmvsd drafters list`, `mmvsd adapters
list`, `mmvsd profile` (the cost table of a target and drafter on this machine) and `mmvsd export`."""

from __future__ import annotations

import argparse

from mmvsd.errors import UserError
from mmvsd.layouts.export_cli import add_export_parser
from mmvsd.placement import add_placement_arguments, positive_int
from mmvsd.tree_options import add_ngram_argument


def add_drafters_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd drafters list|card` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("drafters", help="drafters shipped with mmvsd")
    p.add_argument("action", choices=["list", "card"],
                   help="list: targets, names, defaults and measured tau; card NAME: a drafter's model card")
    p.add_argument("name", nargs="?", help="card: a shipped drafter, NAME or TARGET/NAME")
    p.set_defaults(handler=run_drafters)


def add_adapters_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd adapters list` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("adapters", help="modality adapters")
    p.add_argument("action", choices=["list"], help="list: show registered adapters and where they come from")
    p.set_defaults(handler=run_adapters)


def add_profile_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd profile` (entry point `mmvsd.commands`)."""
    p = sub.add_parser("profile", help="measure (or show the cached) target and drafter costs on this machine",
                       description="Time a verify step against the number of tree tokens and the drafter against "
                                   "the frontier width; cached per machine, target, dtype and drafter.")
    p.add_argument("--target", required=True, help="built-in name, local folder, .gguf file or HF id")
    p.add_argument("--drafter", default="none",
                   help="none (default), random, ngram, or a drafter folder (as `mmvsd generate --drafter`)")
    add_ngram_argument(p, "as in `mmvsd generate`: profile the neural drafter with (default) or without n-gram "
                          "branches")
    p.add_argument("--batch-size", type=positive_int, action="append", help="batch size to measure (repeatable)")
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--plot", metavar="OUT.png", help="write the cost curves to this PNG file")
    add_placement_arguments(p)
    p.set_defaults(handler=run_profile)


def add_export_command(sub: argparse._SubParsersAction) -> None:
    """`mmvsd export` (entry point `mmvsd.commands`): the core's parser, the drafters' runner."""
    add_export_parser(sub).set_defaults(handler=run_export)


def run_drafters(args: argparse.Namespace) -> None:
    """`mmvsd drafters list`, `mmvsd drafters card NAME`."""
    from mmvsd.shipped import format_shipped, shipped_card  # CLI start-up: loaded per command

    if args.action == "card":
        if not args.name:
            raise UserError("mmvsd drafters card needs a drafter: NAME or TARGET/NAME (see `mmvsd drafters list`)")
        print(shipped_card(args.name), end="")
    else:
        print(format_shipped())


def run_adapters(args: argparse.Namespace) -> None:
    """`mmvsd adapters list`."""
    from mmvsd.adapters import registered_adapters  # CLI start-up: loaded per command

    for name, source in registered_adapters().items():
        print(f"{name:<16} {source}")


def run_export(args: argparse.Namespace) -> None:
    """`mmvsd export`: what --drafter names, in the layout --format names."""
    from mmvsd.drafters.export_spec import run_export as export  # CLI start-up: loaded per command

    export(args)


def run_profile(args: argparse.Namespace) -> None:
    """`mmvsd profile`: load (measuring once) the cost table, print it, optionally plot it."""
    from mmvsd.decoding.cost_cache import cost_table_path, load_cost_table  # CLI start-up: loaded per command
    from mmvsd.decoding.cost_plot import plot_cost_table  # CLI start-up: loaded per command
    from mmvsd.decoding.costs import format_cost_table  # CLI start-up: loaded per command
    from mmvsd.decoding.engines import DEFAULT_ENGINE, get_engine  # CLI start-up: loaded per command
    from mmvsd.decoding.fingerprints import cost_key  # CLI start-up: loaded per command
    from mmvsd.drafters.spec import check_drafter_spec, drafter_from_spec  # CLI start-up: loaded per command

    if args.plot and not args.plot.lower().endswith(".png"):
        raise UserError(f"--plot must name a .png file, got {args.plot!r}")
    check_drafter_spec(args.drafter, args.target, args.ngram)
    batch_sizes = tuple(sorted(set(args.batch_size or [1])))
    target = get_engine(DEFAULT_ENGINE).load_target(args.target, args.dtype, args.device)
    drafter = drafter_from_spec(args.drafter, target, ngram=args.ngram)
    table = load_cost_table(target, drafter, batch_sizes, refresh=args.refresh)
    print(format_cost_table(table))
    print(f"profile cached in {cost_table_path(cost_key(target, drafter, batch_sizes, table.context))}")
    if args.plot:
        plot_cost_table(table, args.plot)
        print(f"plot written to {args.plot}")
