"""The built-in drafter architectures (one file each) and the registry that loads a drafter folder by its type.

The interface they implement is `mmvsd.drafter_base`; their checkpoint layouts (`*_layout.py` here) are
registered in `mmvsd.layouts.registry`. A new architecture is a file here plus one entry in `DRAFTERS`.
"""

from __future__ import annotations

from pathlib import Path

from mmvsd.checkpoints import read_config
from mmvsd.drafter_base import Drafter
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.drafters.msd import MSDDrafter
from mmvsd.drafters.vispec import ViSpecDrafter
from mmvsd.errors import UserError

DRAFTERS: dict[str, type[Drafter]] = {cls.drafter_type: cls for cls in (Eagle3Drafter, MSDDrafter, ViSpecDrafter)}


def drafter_class(name: str) -> type[Drafter]:
    """The drafter class whose `drafter_type` is `name` (clear error listing the known ones)."""
    if name not in DRAFTERS:
        raise UserError(f"unknown drafter type {name!r}; registered: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[name]


def load_drafter(path: str | Path, target) -> Drafter:
    """Load a drafter directory (config.json + model.safetensors) for `target`."""
    path = Path(path)
    drafter_type = read_config(path).get("mmvsd_drafter_type")
    if not drafter_type:
        raise UserError(f"{path / 'config.json'} does not name an mmvsd drafter type (key 'mmvsd_drafter_type')")
    drafter = drafter_class(drafter_type).from_pretrained(path, target)
    drafter.check_target(target)
    return drafter
