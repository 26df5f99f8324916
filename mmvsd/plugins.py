"""Plugins: packages that register drafters, checkpoint layouts and prompt sets into the core's registries when
imported. The built-in ones (`mmvsd.drafters`, `mmvsd.eval.prompt_sets`) and any other package's are named in
the entry-point group `mmvsd.plugins`; a registry imports them on its first lookup, so the core never names them.
"""

from __future__ import annotations

import importlib.metadata
import logging

ENTRY_POINT_GROUP = "mmvsd.plugins"
LOG = logging.getLogger(__name__)
_state = {"loaded": False}


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
