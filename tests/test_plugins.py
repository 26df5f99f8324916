"""Plugins fill the core's registries: the built-in ones through pyproject's `mmvsd.plugins` entry points, another
package's the same way; one that fails to import is logged and the others still load."""

from __future__ import annotations

import logging
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import tomllib

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


ENTRY_POINTS = plugins.importlib.metadata.entry_points  # the real one, before a test patches it


def mmvsd_own(group: str) -> list[EntryPoint]:
    """The installed entry points of `group` that mmvsd itself declares (pyproject.toml), no other package's."""
    return [entry for entry in ENTRY_POINTS(group=group) if plugins._distribution(entry) == "mmvsd"]


def test_mmvsd_own_commands_are_entry_points_of_the_commands_group(capsys):
    """The core's command line names no command: every `mmvsd X` comes from pyproject's `mmvsd.commands` group."""
    from mmvsd.cli import build_parser

    declared = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    names = set(declared["project"]["entry-points"]["mmvsd.commands"])
    assert {"generate", "train", "bench", "eval-drafter", "regenerate", "export"} <= names
    assert {entry.name for entry in mmvsd_own(plugins.COMMANDS_ENTRY_POINT)} == names  # the install is current
    choices = build_parser()._subparsers._group_actions[0].choices
    assert names <= set(choices) and all(callable(choices[name].get_default("handler")) for name in names)


def test_an_install_without_its_commands_says_to_install(monkeypatch, capsys):
    """A checkout run without an install has no entry points: one message saying to install it, exit 2."""
    from mmvsd.cli import main

    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: [])
    assert main(["generate", "--target", "x", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no commands registered" in err and "pip install -e ." in err


def test_another_package_adds_a_command_and_a_broken_one_is_only_logged(monkeypatch, tmp_path, capsys, caplog):
    """The `mmvsd.commands` hook: an entry point adds its subparser and sets its handler (as the studies' `lab`)."""
    from mmvsd.cli import main

    (tmp_path / "their_command.py").write_text(
        "def add(sub):\n    p = sub.add_parser('greet')\n    p.add_argument('name')\n"
        "    p.set_defaults(handler=lambda args: print('hello', args.name))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "their_command", raising=False)
    entries = {plugins.COMMANDS_ENTRY_POINT: [*mmvsd_own(plugins.COMMANDS_ENTRY_POINT),
                                              EntryPoint("broken", "no_such_module_anywhere:add", "mmvsd.commands"),
                                              EntryPoint("greet", "their_command:add", "mmvsd.commands")]}
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: entries.get(group, []))
    with caplog.at_level(logging.WARNING, logger="mmvsd.plugins"):
        assert main(["greet", "you"]) == 0
    assert capsys.readouterr().out == "hello you\n"
    assert "command plugin broken (no_such_module_anywhere:add) failed to load: ModuleNotFoundError" in caplog.text


def test_the_studies_command_without_its_plugin_says_how_to_install_it_and_smol_llava_is_product(monkeypatch,
                                                                                                    capsys):
    """Without the studies plugin (studies/), `mmvsd lab ...` ends in one message naming the install command, exit 2,
    no traceback; `--target smol-llava` is mmvsd's own (its `mmvsd.targets` entry point, issue 65)."""
    from mmvsd import target_loader
    from mmvsd.cli import main

    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", mmvsd_own)  # mmvsd's alone: no studies
    assert main(["lab", "build-target", "smol-llava", "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`mmvsd lab` comes with a plugin that is not installed" in err
    assert "pip install -e ./studies" in err
    monkeypatch.setattr(target_loader, "BUILTIN_TARGETS", {})  # a fresh process: only entry points register
    monkeypatch.setattr(target_loader, "_entry_points_loaded", False)
    monkeypatch.setattr(target_loader, "load_plugins", lambda: None)
    assert target_loader.builtin_targets()["smol-llava"].assemble.__module__ == "mmvsd.targets"
