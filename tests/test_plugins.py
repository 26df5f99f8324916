"""Plugins fill the core's registries: the built-in ones through pyproject's `mmvsd.plugins` entry points, another
package's the same way; one that fails to import is logged and the others still load."""

from __future__ import annotations

import logging
import sys
from importlib.metadata import EntryPoint

import pytest

from mmvsd import drafter_base, plugins
from mmvsd.drafter_base import DRAFTERS, drafter_class
from mmvsd.errors import UserError
from mmvsd.layouts.registry import layout_names
from mmvsd.prompts import PROMPT_SETS, prompt_set_names


def test_the_builtin_plugins_register_drafters_layouts_and_prompt_sets():
    assert drafter_class("eagle3").__name__ == "Eagle3Drafter"  # a lookup loads the plugins
    assert {"eagle3", "msd", "vispec"} <= set(DRAFTERS)
    assert {"hf", "eagle3", "speculators", "msd", "vispec"} <= set(layout_names())
    assert {"mt_bench", "humaneval", "gsm8k", "vqav2_val_mini_long"} <= set(prompt_set_names())
    with pytest.raises(UserError, match="registered: .*eagle3"):
        drafter_class("no-such-drafter")


@pytest.fixture()
def fresh_plugins(monkeypatch):
    """The plugin loader as in a new process, reading the entry points the test gives; registries restored."""
    monkeypatch.setattr(plugins, "_state", {"loaded": False})
    monkeypatch.setattr(drafter_base, "DRAFTERS", dict(DRAFTERS))
    monkeypatch.setattr("mmvsd.prompts.PROMPT_SETS", dict(PROMPT_SETS))

    def use(*entries: EntryPoint) -> None:
        monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: list(entries))

    return use


def test_another_package_registers_a_drafter_and_a_broken_one_is_only_logged(fresh_plugins, monkeypatch, tmp_path,
                                                                              caplog):
    (tmp_path / "their_plugin.py").write_text(
        "from mmvsd.drafter_base import Drafter, register_drafter\n\n\n"
        "@register_drafter\nclass TheirDrafter(Drafter):\n    drafter_type = 'theirs'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "their_plugin", raising=False)
    fresh_plugins(EntryPoint("broken", "no_such_module_anywhere", plugins.ENTRY_POINT_GROUP),
                  EntryPoint("theirs", "their_plugin", plugins.ENTRY_POINT_GROUP))
    assert "theirs" not in drafter_base.DRAFTERS  # nothing registers it until a lookup loads the plugins
    with caplog.at_level(logging.WARNING, logger="mmvsd.plugins"):
        cls = drafter_base.drafter_class("theirs")
    assert cls.__name__ == "TheirDrafter" and cls.__module__ == "their_plugin"
    assert "plugin broken (no_such_module_anywhere) failed to import: ModuleNotFoundError" in caplog.text
