"""Built-in modality adapters (one file each) and the registry that finds an adapter by name or modality.

Built-ins are listed here; another package registers its adapter through the entry-point group
``mmvsd.adapters`` (``name = "package.module:AdapterClass"``). ``mmvsd adapters list`` shows them all.
The interface they implement is `mmvsd.adapter_base`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from mmvsd.adapter_base import ModalityAdapter
from mmvsd.adapters.llava import LlavaAdapter
from mmvsd.adapters.text import TextAdapter
from mmvsd.errors import UserError
from mmvsd.plugins import load_plugins

ENTRY_POINT_GROUP = "mmvsd.adapters"

ADAPTERS: dict[str, type[ModalityAdapter]] = {}
ADAPTER_SOURCES: dict[str, str] = {}  # name -> where it was registered from
_entry_points_loaded = False


def register_adapter(name: str) -> Callable[[type[ModalityAdapter]], type[ModalityAdapter]]:
    """Class decorator: make an adapter available by `name`."""

    def add(cls: type[ModalityAdapter]) -> type[ModalityAdapter]:
        cls.name = name
        ADAPTERS[name] = cls
        ADAPTER_SOURCES.setdefault(name, cls.__module__)
        return cls

    return add


for _builtin in (TextAdapter, LlavaAdapter):
    register_adapter(_builtin.name)(_builtin)


def _load_entry_points() -> None:
    """Import the adapters other packages declare in the `mmvsd.adapters` entry-point group (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
        except Exception as err:  # noqa: BLE001  a broken plugin must not break mmvsd: report it and go on
            ADAPTER_SOURCES[entry.name] = f"broken entry point {entry.value}: {type(err).__name__}: {err}"
            continue
        if isinstance(loaded, type) and issubclass(loaded, ModalityAdapter) and entry.name not in ADAPTERS:
            register_adapter(entry.name)(loaded)
        dist = entry.dist.name if entry.dist is not None else "?"
        if entry.name in ADAPTERS:
            ADAPTER_SOURCES[entry.name] = f"entry point {entry.value} (package {dist})"


def registered_adapters() -> dict[str, str]:
    """Every adapter name with where it came from (built-ins, then entry points; a `mmvsd.plugins` module may
    register one too)."""
    load_plugins()
    _load_entry_points()
    return dict(sorted(ADAPTER_SOURCES.items()))


def get_adapter(name: str) -> ModalityAdapter:
    """The adapter registered as `name` (error lists the registered ones)."""
    check_adapter(name)
    return ADAPTERS[name]()


def check_adapter(name: str) -> None:
    """UserError when `--adapter name` is not registered ('': chosen once the target is known). Cheap: commands call
    it before a target loads."""
    registered_adapters()
    if name and name not in ADAPTERS:
        raise UserError(f"no modality adapter {name!r}; registered: {', '.join(sorted(ADAPTERS))}")


def adapter_for(target, modality: str) -> ModalityAdapter:
    """The first registered adapter that takes `modality` files (or plain text, when empty) for `target`."""
    registered_adapters()
    for cls in ADAPTERS.values():
        adapter = cls()
        if adapter.modality == modality and adapter.accepts(target):
            return adapter
    if modality:
        raise UserError(f"target {target.name!r} takes no {modality} input: no registered adapter "
                        f"({', '.join(sorted(ADAPTERS))}) feeds it {modality}s")
    raise UserError(f"no registered adapter feeds target {target.name!r}")


def choose_adapter(target, name: str = "", modality: str = "image") -> ModalityAdapter:
    """The adapter `name` (or the first registered one that takes `modality` files for `target`), checked
    to take that modality (when one is asked for) and to fit the target."""
    adapter = get_adapter(name) if name else adapter_for(target, modality)
    if modality and adapter.modality != modality:
        raise UserError(f"adapter {adapter.name!r} takes no {modality}s")
    if not adapter.accepts(target):
        raise UserError(f"adapter {adapter.name!r} cannot feed target {target.name!r}")
    return adapter
