"""Write the data files of the offline lmms-eval mini tasks: one parquet file per task.

Usage: python -m mmvsd.eval.make_mini_tasks [--out DIR] [--num-items 100] [--seed 0]
(or python mmvsd/eval/make_mini_tasks.py from the repository root).

Each file `<task>.parquet` holds items 0 .. num_items - 1 of the *test* split of the task's family in
`mmvsd.data.images`, one row per item: item_id, question, answer, long_prompt, options, family and
the image as PNG bytes. The schema carries the Hugging Face `datasets` features, so `load_dataset`
(and therefore lmms-eval) decodes the image column to a PIL image.

Deterministic: the generator is, PNG encoding has no metadata, and the parquet file has no
timestamps (its footer names the pyarrow version, so files match byte for byte under one pyarrow
version). Atomic: each file is written to a temporary name next to it, then renamed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from mmvsd.data.images import ImageItem, generate_items, png_bytes
from mmvsd.errors import UserError
from mmvsd.eval import MINI_TASKS, mini_task_dir
from mmvsd.files import atomic_file

SPLIT = "test"
DEFAULT_NUM_ITEMS = 100
MINI_FEATURES = datasets.Features({
    "item_id": datasets.Value("string"),
    "question": datasets.Value("string"),
    "answer": datasets.Value("string"),
    "long_prompt": datasets.Value("string"),
    "options": datasets.Sequence(datasets.Value("string")),
    "family": datasets.Value("string"),
    "image": datasets.Image(),
})


def default_data_dir() -> Path:
    """Where the task YAMLs look for their parquet files."""
    return mini_task_dir() / "data"


def item_row(item: ImageItem) -> dict[str, Any]:
    """One parquet row: the item's texts and its image as PNG bytes."""
    return {"item_id": item.item_id, "question": item.question, "answer": item.answer,
            "long_prompt": item.long_prompt, "options": list(item.options), "family": item.family,
            "image": {"bytes": png_bytes(item.image), "path": None}}


def task_table(family: str, num_items: int, seed: int) -> pa.Table:
    """The rows of one task as an Arrow table whose schema carries the `datasets` features."""
    rows = [item_row(item) for item in generate_items(family, SPLIT, num_items, seed)]
    return pa.Table.from_pylist(rows, schema=MINI_FEATURES.arrow_schema)


def write_table(table: pa.Table, path: Path) -> None:
    """Write a parquet file atomically, with the writer options pinned so defaults cannot drift."""
    try:
        with atomic_file(path, "wb") as handle:
            pq.write_table(table, handle, compression="snappy", version="2.6", use_dictionary=True,
                           write_statistics=True)
        path.chmod(0o644)  # the temporary file was created private (0600)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error}") from error


def write_mini_tasks(out_dir: Path, num_items: int = DEFAULT_NUM_ITEMS, seed: int = 0) -> list[Path]:
    """(Re)write <task>.parquet for every mini task under out_dir; return the paths written."""
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
        raise UserError(f"num_items must be a positive integer, got {num_items!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} exists and is not a folder")
    paths = []
    for task, family in MINI_TASKS.items():
        path = out_dir / f"{task}.parquet"
        write_table(task_table(family, num_items, seed), path)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m mmvsd.eval.make_mini_tasks", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=default_data_dir(),
                        help="folder for the <task>.parquet files (default: the task folder's data/)")
    parser.add_argument("--num-items", type=int, default=DEFAULT_NUM_ITEMS, help="items per task")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write the files and print their paths and sizes; exit code 2 on a user error."""
    args = parse_args(argv)
    try:
        paths = write_mini_tasks(args.out, args.num_items, args.seed)
    except UserError as error:
        print(f"make_mini_tasks: error: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path}  {path.stat().st_size / 1e6:.2f} MB")
    print(f"total {sum(path.stat().st_size for path in paths) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
