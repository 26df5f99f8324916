"""What can the projector read from each choice of tower features? Per-patch linear probes on shape scenes.

For every one of the 49 patches of a generated shape scene, the label is the colour and the kind of the
shape it shows (from the drawing parameters, as the projector's first stage uses them). A linear
classifier per feature set is trained on train-split scenes and scored on validation-split patches that
show a shape. Feature sets, each one 7 x 7 map of tokens:

- head: the 1280-channel head map (smol-llava's tokens before they were multi-scale);
- stride 16: the 112-channel stride-16 map, each 2 x 2 block folded into one token (448);
- stride 8: the 40-channel stride-8 map, each 4 x 4 block folded into one token (640);
- patch tokens: what smol-llava's projector reads, stride 8 + stride 16 + head + position code (2382).

    python -m mmvsd_studies.smol_llava_tower_probe [--train-items 1500] [--steps 300]

Writes studies/results/smol_llava_tower_probe.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from mmvsd.data.image_families import SHAPE_COLORS, SHAPE_KINDS
from mmvsd.data.images import ImageItem, generate_items
from mmvsd.targets.efficientnet import (
    FOLDED_STAGES,
    feature_map_to_tokens,
    load_efficientnet_lite0,
    patch_feature_map,
)
from mmvsd.targets.smol_llava import image_processor
from mmvsd_studies import RESULTS_DIR
from mmvsd_studies.lab.projector_questions import BACKGROUND_WORD, patch_words

COLOURS = [*SHAPE_COLORS, BACKGROUND_WORD]
KINDS = [*SHAPE_KINDS, BACKGROUND_WORD]


@torch.no_grad()
def feature_sets(items: list[ImageItem]) -> dict[str, Tensor]:
    """{name: [N * 49, C]} for every feature set, computed from stock timm's maps."""
    tower, processor = load_efficientnet_lite0(), image_processor()
    parts: dict[str, list[Tensor]] = {}
    for start in range(0, len(items), 32):
        pixels = processor(images=[i.image for i in items[start:start + 32]], return_tensors="pt")["pixel_values"]
        head, stages = tower.forward_intermediates(pixels)
        (stride8, fold8), (stride16, fold16) = FOLDED_STAGES
        maps = {"head": head, "stride 16": F.pixel_unshuffle(stages[stride16], fold16),
                "stride 8": F.pixel_unshuffle(stages[stride8], fold8), "patch tokens": patch_feature_map(stages, head)}
        for name, feature_map in maps.items():
            parts.setdefault(name, []).append(feature_map_to_tokens(feature_map).flatten(0, 1))
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


def patch_labels(items: list[ImageItem]) -> tuple[Tensor, Tensor]:
    """[N * 49] colour and kind class of every patch (the last class is the background)."""
    words = [w for item in items for w in patch_words(item.meta["shapes"])]
    return torch.tensor([COLOURS.index(w[0]) for w in words]), torch.tensor([KINDS.index(w[-1]) for w in words])


def probe_accuracy(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, steps: int) -> float:
    """Accuracy on the test patches that show a shape, of a linear classifier on standardised features."""
    mean, scale = train_x.mean(0), train_x.std(0) + 1e-4
    train_x, test_x = (train_x - mean) / scale, (test_x - mean) / scale
    classes = int(train_y.max()) + 1
    weight = torch.zeros(train_x.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=1e-2)
    for _ in range(steps):
        loss = F.cross_entropy(train_x @ weight + bias, train_y) + 1e-4 * weight.pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        shown = test_y != classes - 1
        return float(((test_x @ weight + bias).argmax(1) == test_y)[shown].float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-items", type=int, default=1500)
    parser.add_argument("--test-items", type=int, default=300)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "smol_llava_tower_probe.json")
    args = parser.parse_args()
    started = time.monotonic()
    train = [i for i in generate_items("vqav2", "train", args.train_items, 0) if "shapes" in i.meta]
    test = [i for i in generate_items("vqav2", "validation", args.test_items, 0) if "shapes" in i.meta]
    train_sets, test_sets = feature_sets(train), feature_sets(test)
    (train_colour, train_kind), (test_colour, test_kind) = patch_labels(train), patch_labels(test)
    labels = {"colour": (train_colour, test_colour), "kind": (train_kind, test_kind)}
    results = {}
    print(f"{'features':<14} {'width':>6} {'colour':>7} {'kind':>7}")
    for name in train_sets:
        results[name] = {"width": train_sets[name].shape[1]}
        for label, (train_y, test_y) in labels.items():
            results[name][label] = round(probe_accuracy(train_sets[name], train_y, test_sets[name], test_y,
                                                        args.steps), 3)
        print(f"{name:<14} {results[name]['width']:>6} {results[name]['colour']:>7.1%} {results[name]['kind']:>7.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"train_scenes": len(train), "test_scenes": len(test), "results": results,
                                    "minutes": round((time.monotonic() - started) / 60, 1)}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
