"""`MediaWriter`: puts benchmark items' images in files where a modality adapter reads them (`mmvsd bench`,
`mmvsd eval-drafter` on image tasks)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mmvsd.adapters import choose_adapter
from mmvsd.eval.bench_item import BenchItem

if TYPE_CHECKING:
    from mmvsd.target import Target


class MediaWriter:
    """Writes items' images once under `folder` (`mmvsd bench`: OUT/images, kept with the results) for the
    modality adapter, chosen on first use."""

    def __init__(self, folder: Path, adapter_name: str) -> None:
        self.folder = folder
        self.adapter_name = adapter_name
        self.adapter = None

    def files(self, target: Target, item: BenchItem):
        if self.adapter is None:
            self.adapter = choose_adapter(target, self.adapter_name, "image")
        paths = []
        for index, image in enumerate(item.images):
            path = self.folder / f"{item.benchmark}-{item.item_id}-{index}.png"
            if not path.is_file():
                self.folder.mkdir(parents=True, exist_ok=True)
                image.save(path)
            paths.append(path)
        return self.adapter, paths
