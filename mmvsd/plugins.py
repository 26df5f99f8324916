"""Plugins: packages that register drafters, checkpoint layouts and prompt sets into the core's registries when
imported. The built-in ones (`mmvsd.drafters`, `mmvsd.eval.prompt_sets`) and any other package's are named in
the entry-point group `mmvsd.plugins`; a registry imports them on its first lookup, so the core never names them.

Two more groups extend mmvsd: `mmvsd.targets` (a named `--target`, mmvsd.target_loader) and `mmvsd.commands` (a
subcommand of `mmvsd`: the entry point is a function of argparse's subparsers action that adds its parser and sets
`handler=FUNCTION(args)` on it; `add_commands`). mmvsd's own subcommands are entry points of this group too
(pyproject.toml), so the core's command line imports nothing above it, and so is mmvsd's own named target
`smol-llava` (`mmvsd.targets`). The studies (studies/, the distribution mmvsd-studies) add the command `mmvsd lab`
this way.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
from collections.abc import Callable

from mmvsd.errors import UserError

ENTRY_POINT_GROUP = "mmvsd.plugins"
COMMANDS_ENTRY_POINT = "mmvsd.commands"
LOG = logging.getLogger(__name__)
_state = {"loaded": False}
# Names users meet in mmvsd's docs that come from a plugin distribution of this repository, with the command that
# installs it: naming one while its plugin is absent ends in this hint, not in "unknown target" or "invalid choice".
STUDIES_INSTALL = "pip install -e ./studies  (the studies plugin, mmvsd-studies, in mmvsd's repository)"
PLUGIN_COMMANDS = {"lab": STUDIES_INSTALL}


def load_plugins() -> None:
    """Import every package of the `mmvsd.plugins` entry-point group, once per process. One that fails to
    import is logged and skipped: a broken plugin must not break the others."""
    if _state["loaded"]:
        return
    _state["loaded"] = True  # first: a plugin that looks something up while importing must not recurse
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as err:  # noqa: BLE001  reported, then the other plugins still load
            LOG.warning("mmvsd plugin %s (%s) failed to import: %s: %s", entry.name, entry.value,
                        type(err).__name__, err)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Let every `mmvsd.commands` entry point add its subcommand to `sub`: mmvsd's own first, by name (setuptools
    sorts them; one that fails to load is a bug, and raises), then other packages' (one that fails is logged and
    skipped).
    A PLUGIN_COMMANDS name that none added gets a stand-in that says how to install its plugin."""
    entries = list(importlib.metadata.entry_points(group=COMMANDS_ENTRY_POINT))
    own = [entry for entry in entries if _distribution(entry) == "mmvsd"]
    if not own:
        raise UserError("this mmvsd has no commands registered: its subcommands are entry points that an install "
                        "writes; install it (`pip install -e .` in a checkout) and run again")
    for entry in own:
        entry.load()(sub)
    for entry in [entry for entry in entries if entry not in own]:
        try:
            entry.load()(sub)
        except Exception as err:  # noqa: BLE001  reported, then mmvsd's own commands still work
            LOG.warning("mmvsd command plugin %s (%s) failed to load: %s: %s", entry.name, entry.value,
                        type(err).__name__, err)
    for name, install in PLUGIN_COMMANDS.items():
        if name not in sub.choices:
            stand_in = sub.add_parser(name, help=f"(not installed: {install})", add_help=False)
            stand_in.add_argument("arguments", nargs=argparse.REMAINDER)
            stand_in.set_defaults(handler=_not_installed(f"`mmvsd {name}` comes with a plugin that is not installed; "
                                                         f"install it with: {install}"))


def _distribution(entry: importlib.metadata.EntryPoint) -> str:
    """The name of the distribution that declares `entry` ('' when unknown)."""
    dist = getattr(entry, "dist", None)
    return (dist.metadata["Name"] or "").lower() if dist is not None else ""


def _not_installed(message: str) -> Callable[[argparse.Namespace], None]:
    def handler(args: argparse.Namespace) -> None:
        raise UserError(message)

    return handler
