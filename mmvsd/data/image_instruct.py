"""Generated images as LLaVA-Instruct records, for multimodal drafter training
(`mmvsd train --data llava-instruct:DIR/llava_instruct.json`).

Each item of the generator's split becomes one conversation: the user turn is ``<image>`` and the
item's long prompt (the kind of prompt speculative-decoding benchmarks use), the reference answer is
the item's description followed by its answer sentence. Train with ``regenerate=greedy`` to replace
the references by the target's own answers.

    python -m mmvsd.data.image_instruct --out DIR [--num-items 200] [--split train] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mmvsd.data.images import FAMILIES, ImageItem, answer_sentence, generate_items, write_items
from mmvsd.errors import UserError
from mmvsd.files import atomic_file

RECORDS_FILE = "llava_instruct.json"


def instruct_record(item: ImageItem, image_path: str) -> dict[str, Any]:
    """A LLaVA-Instruct conversation asking the long prompt, answered by description + answer."""
    return {"id": item.item_id, "image": image_path,
            "conversations": [{"from": "human", "value": "<image>\n" + item.long_prompt},
                              {"from": "gpt", "value": f"{item.description} {answer_sentence(item)}"}]}


def write_image_instruct(out_dir: Path, num_items: int, split: str = "train", seed: int = 0) -> Path:
    """Write num_items items of every family (images/ plus one records file) and return the records path."""
    records = []
    for family in FAMILIES:
        items = generate_items(family, split, num_items, seed)
        if not items:
            continue
        write_items(items, out_dir, fmt="jsonl")  # images/<item_id>.png (and the family's own records)
        records += [instruct_record(item, f"images/{item.item_id}.png") for item in items]
    if not records:
        raise UserError("--num-items must be at least 1")
    path = Path(out_dir) / RECORDS_FILE
    with atomic_file(path) as handle:
        json.dump(records, handle, indent=1, ensure_ascii=False)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmvsd.data.image_instruct", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-items", type=int, default=200, help="items per family")
    parser.add_argument("--split", default="train")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = write_image_instruct(args.out, args.num_items, args.split, args.seed)
    except UserError as err:
        print(f"mmvsd: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
