"""The `mmvsd` command line: the global options and the dispatch. User errors print one line and exit with code 2.

Every subcommand, mmvsd's own included, comes from the entry-point group `mmvsd.commands` (mmvsd/plugins.py): the
built-in ones live with what they run (`mmvsd/eval/*_cli.py`, `mmvsd/training/*_cli.py`) and pyproject.toml names
them, so this module imports nothing above the core, and a package of yours adds `mmvsd yourcommand` the same way.
"""

from __future__ import annotations

import argparse
import os
import sys

from mmvsd.errors import UserError
from mmvsd.plugins import add_commands


class VersionAction(argparse.Action):
    """`mmvsd --version`: mmvsd's version and torch/transformers/accelerate's in use, with one warning line
    on stderr when any of them differs from what CI tested (mmvsd/constraints.txt)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from mmvsd.versions import version_report  # CLI start-up: only --version reads the constraints

        report, warning = version_report()
        print(report)
        if warning:
            print(warning, file=sys.stderr)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmvsd", description="Multimodal speculative decoding toolkit.")
    parser.add_argument("--version", action=VersionAction,
                        help="print the versions of mmvsd, torch, transformers and accelerate, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)  # mmvsd's own commands, then other packages' (the studies' `lab`)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except UserError as err:  # an install without its commands' metadata
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed (the --dry-run plan repeats it)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    if len(overrides) != len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]  # key=value after later flags
    try:
        args.handler(args)
    except UserError as err:
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # a package of an extra that this install left out
        from mmvsd.versions import missing_package_message  # CLI start-up: only on this error

        message = missing_package_message(err)
        if message is None:
            raise
        print(f"mmvsd: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmvsd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`mmvsd drafters list | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not raise again
        return 141  # 128 + SIGPIPE
    return 0


if __name__ == "__main__":
    sys.exit(main())
