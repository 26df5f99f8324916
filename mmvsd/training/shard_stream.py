"""Training on a regeneration folder while it grows (`data_order=shards`): shard by shard, across sessions.

`mmvsd regenerate` writes a dataset's answers in shards of a fixed size, in the dataset's order, and records each
finished shard in its manifest. A run with `data_order=shards` reads the finished shards (the first ones without
a gap; the one being written is left alone) and trains on them as one stream, once: the shards in order, each
shard's examples in a permutation seeded by (seed, shard index). Each shard keeps its own validation split (seeded
the same way). So a shard finished later only appends to the stream: it never moves an example that a run trained
on, nor one of the validation split. A run that reaches the end of the finished shards stops with a checkpoint
and its drafter, as at a time budget; `mmvsd train --resume` with the same settings goes on from there once more
shards are finished. The learning-rate schedule is planned for the whole dataset (the manifest's conversation
count, at the finished shards' rate of rendered examples), or for `max_steps`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mmvsd.data.conversations import load_conversations
from mmvsd.data.render import split_conversations
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.training.budget import Budget
from mmvsd.training.dataset import render_all
from mmvsd.training.distributed import derived_seed
from mmvsd.training.regenerate_shards import read_manifest, shard_path

POLL_SECONDS = 60.0  # wait_for_shards: how often the manifest is read again
logger = logging.getLogger(__name__)


@dataclass
class ShardStream:
    """The finished shards' rendered examples, shard by shard."""

    train: list  # RenderedExample, the shards in order
    validation: list
    blocks: list[int]  # train examples per finished shard, in order
    planned: int  # train examples the whole dataset is expected to give (the schedule's length)
    key: str  # the folder's settings and dataset order: a resumed run must read the same regeneration
    num_dropped: int  # conversations with nothing to learn after rendering


def finished_shards(folder: Path) -> tuple[dict, list[Path]]:
    """The folder's manifest and its finished shards from shard 0 up to the first one not finished."""
    manifest = read_manifest(folder) if folder.is_dir() else None
    if manifest is None:
        raise UserError(f"data_order=shards reads a folder written by `mmvsd regenerate`; {folder} is not one "
                        "(no manifest.json)")
    done = {int(index) for index in manifest["shards"]}
    count = next(n for n in range(len(done) + 1) if n not in done)
    return manifest, [shard_path(folder, index) for index in range(count)]


def stream_key(manifest: dict) -> str:
    """What identifies a regeneration: its settings key, dataset, shard size and order digest."""
    fields = {name: manifest[name] for name in ("key", "data", "shard_size", "num_conversations", "order")}
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def load_shard_stream(target: Target, folder: str | Path, *, max_length: int, validation_fraction: float,
                      seed: int, adapter: str = "") -> ShardStream:
    """Render the finished shards of `folder` (train and validation parts split per shard)."""
    manifest, paths = finished_shards(Path(folder))
    if not paths:
        raise UserError(f"{folder} has no finished shard yet: `mmvsd regenerate` writes one every "
                        f"{manifest['shard_size']} conversations; train when the first is done")
    train, validation, blocks, dropped, conversations = [], [], [], 0, 0
    for index, path in enumerate(paths):
        shard = load_conversations(str(path))
        shard_train, shard_validation = split_conversations(shard, validation_fraction, derived_seed(seed, index))
        examples, dropped_train = render_all(target, shard_train, max_length, adapter)
        held_out, dropped_validation = render_all(target, shard_validation, max_length, adapter)
        train += examples
        validation += held_out
        blocks.append(len(examples))
        dropped += dropped_train + dropped_validation
        conversations += manifest["shards"][str(index)]["conversations"]
    if not train:
        raise UserError(f"no training example in the finished shards of {folder} with max_length={max_length}")
    planned = max(len(train), round(len(train) / conversations * manifest["num_conversations"]))
    return ShardStream(train, validation, blocks, planned, stream_key(manifest), dropped)


def stream_holds(blocks: list[int], batch_size: int, micro_step: int) -> bool:
    """Whether the finished shards hold global micro-batch `micro_step` whole."""
    return (micro_step + 1) * batch_size <= sum(blocks)


def stream_indices(blocks: list[int], batch_size: int, seed: int, micro_step: int) -> list[int] | None:
    """Example indices of global micro-batch `micro_step` in the stream, None where the finished shards end first.
    Position p of the stream is example perm_b[p - start_b] of shard b, perm_b seeded by (seed, b)."""
    if not stream_holds(blocks, batch_size, micro_step):
        return None
    start, end = micro_step * batch_size, (micro_step + 1) * batch_size
    picks, offset = [], 0
    for index, size in enumerate(blocks):
        if offset < end and offset + size > start:
            order = torch.randperm(size, generator=torch.Generator().manual_seed(derived_seed(seed, index)))
            picks += (order[max(start - offset, 0) : end - offset] + offset).tolist()
        offset += size
    return picks


def wait_for_shards(folder: str | Path, have: int, budget: Budget) -> bool:
    """Wait until `folder` has more than `have` finished shards (True); False once the regeneration is complete
    without them, when the budget's time would run out first, or once a stop is asked for."""
    logger.warning("waiting for shard %d of %s (its manifest is read every %g s)", have, folder, POLL_SECONDS)
    while True:
        manifest, paths = finished_shards(Path(folder))
        if len(paths) > have:
            return True
        if len(paths) >= manifest["num_shards"] or budget.spent(POLL_SECONDS):
            return False
        time.sleep(POLL_SECONDS)


def check_stream_resume(saved_key: str, saved_blocks: list[int], stream: ShardStream, checkpoint: Path) -> None:
    """A resumed run reads the same regeneration, and the shards it trained on are as they were."""
    if saved_key and saved_key != stream.key:
        raise UserError(f"cannot resume {checkpoint}: its data was another regeneration (settings or dataset order "
                        "differ); train it on the folder it started with")
    if stream.blocks[: len(saved_blocks)] != saved_blocks:
        raise UserError(f"cannot resume {checkpoint}: the shards it trained on changed ({len(saved_blocks)} shards "
                        f"gave {saved_blocks[:4]}... examples, now {stream.blocks[:4]}...)")
