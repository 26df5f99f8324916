"""An example modality adapter living outside mmvsd: LLaVA targets see images in grayscale.

mmvsd finds it through the ``mmvsd.adapters`` entry point in this package's pyproject.toml; nothing
in mmvsd names it. It reuses the built-in llava adapter and changes only how images are read.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from mmvsd.adapters.llava import LlavaAdapter, load_image


class GrayImageAdapter(LlavaAdapter):
    """Images converted to grayscale (three equal channels) before the target's processor."""

    def load(self, path: str | Path) -> Image.Image:
        return load_image(path).convert("L").convert("RGB")
