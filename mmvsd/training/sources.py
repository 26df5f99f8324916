"""Where a run's batches come from, and in which order: rendered examples whose target features are captured in
the step (online), the feature cache `mmvsd prepare` wrote (offline), or a regeneration folder's shards as they are
finished (`data_order=shards`, shard_stream.py); shuffled epochs, the shards' stream or MSD's media curriculum.
Every order derives from (seed, micro-step), so a resumed run draws the batches the interrupted one would have."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mmvsd.drafter_base import Drafter
from mmvsd.target import Target
from mmvsd.training.budget import Budget
from mmvsd.training.config import TrainConfig
from mmvsd.training.dataset import ExampleSplit, load_examples
from mmvsd.training.distributed import derived_seed
from mmvsd.training.feature_cache import FeatureCache, check_cache_matches
from mmvsd.training.features import FeatureBatch, capture_features, collate
from mmvsd.training.media import embed_batch, media_adapter
from mmvsd.training.shard_stream import (
    ShardStream,
    check_stream_resume,
    load_shard_stream,
    stream_holds,
    stream_indices,
    wait_for_shards,
)


def batch_indices(num_examples: int, batch_size: int, seed: int, micro_step: int) -> list[int]:
    """Example indices of micro-batch `micro_step`: a fresh seeded permutation every epoch, its last batch filled
    up from the permutation's start (as a distributed sampler pads), so every batch holds `batch_size` examples."""
    per_epoch = math.ceil(num_examples / batch_size)
    epoch, slot = divmod(micro_step, per_epoch)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(derived_seed(seed, epoch)))
    order = torch.cat([order, order[: per_epoch * batch_size - num_examples]])
    return order[slot * batch_size : (slot + 1) * batch_size].tolist()


def curriculum_indices(is_media: list[bool], batch_size: int, seed: int, micro_step: int, num_micro: int) -> list[int]:
    """MSD's two-stage curriculum: text-only batches for the first half of the run, then each slot holds a
    media example with a probability rising linearly to 1 at the end (seeded by step, so resumable)."""
    text = [i for i, flag in enumerate(is_media) if not flag]
    media = [i for i, flag in enumerate(is_media) if flag]
    if not text or not media:
        return batch_indices(len(is_media), batch_size, seed, micro_step)
    half = num_micro / 2
    share = 0.0 if micro_step < half else min(1.0, (micro_step + 1 - half) / max(1.0, num_micro - half))
    generator = torch.Generator().manual_seed(derived_seed(seed, micro_step))
    picks = []
    for _ in range(batch_size):
        pool = media if float(torch.rand((), generator=generator)) < share else text
        picks.append(pool[int(torch.randint(len(pool), (), generator=generator))])
    return picks



class OnlineSource:
    """Training batches whose target features are captured inside the step (media embedded per batch)."""

    def __init__(self, target: Target, examples: list, adapter_name: str = "", stream: ShardStream | None = None):
        self.target = target
        self.examples = examples
        self.stream = stream  # data_order=shards: batches follow the shards' stream
        self.is_media = [bool(ex.media) for ex in examples]
        self.adapter = media_adapter(target, adapter_name) if any(self.is_media) else None

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, indices: list[int]) -> FeatureBatch:
        examples = [self.examples[i] for i in indices]
        tokens = collate(examples)
        if self.adapter is not None:
            tokens = embed_batch(self.target, self.adapter, tokens, examples)
        return capture_features(self.target, tokens, keep_cache=True)


class OfflineSource:
    """Training batches read from a feature cache written by `mmvsd prepare`."""

    def __init__(self, cache, dtype: torch.dtype) -> None:
        self.cache = cache
        self.dtype = dtype
        self.examples = cache.token_examples()
        self.is_media = [False] * len(self.examples)
        self.stream = None

    def __len__(self) -> int:
        return len(self.cache)

    def batch(self, indices: list[int]) -> FeatureBatch:
        return self.cache.batch(indices, dtype=self.dtype)



def uses_curriculum(config: TrainConfig, drafter: Drafter, source) -> bool:
    """Whether batches follow the media curriculum (asked for, or the drafter's default, and media to show)."""
    asked = config.media_curriculum == "on" or (config.media_curriculum == "auto" and drafter.media_curriculum)
    return asked and any(source.is_media)


def micro_batch_indices(config: TrainConfig, drafter: Drafter, source, micro_step: int, num_steps: int,
                        global_batch: int) -> list[int]:
    """Examples of one global micro-batch: shuffled epochs, the shards' stream, or the media curriculum."""
    if source.stream is not None:
        return stream_indices(source.stream.blocks, global_batch, config.seed, micro_step)
    if uses_curriculum(config, drafter, source):
        return curriculum_indices(source.is_media, global_batch, config.seed, micro_step,
                                  num_steps * config.grad_accum)
    return batch_indices(len(source), global_batch, config.seed, micro_step)


def stream_reaches(config: TrainConfig, source, global_batch: int, step: int) -> bool:
    """Whether the data holds optimizer step `step` (0-based): always, except past the end of the finished shards."""
    return source.stream is None or stream_holds(source.stream.blocks, global_batch, (step + 1) * config.grad_accum - 1)



def follow_stream(config: TrainConfig, target: Target, source: OnlineSource, global_batch: int, step: int,
                  budget: Budget) -> bool:
    """`wait_for_shards`: wait for the regeneration's next shards and append them to the stream until it holds
    optimizer step `step` (True); False when the regeneration ends first or the budget does."""
    while not stream_reaches(config, source, global_batch, step):
        if not wait_for_shards(config.data, len(source.stream.blocks), budget):
            return False
        stream = load_shard_stream(target, config.data, max_length=config.max_length, seed=config.seed,
                                   validation_fraction=config.validation_fraction, adapter=config.adapter)
        check_stream_resume(source.stream.key, source.stream.blocks, stream, Path(config.output))
        source.examples, source.stream = stream.train, stream
        source.is_media = [bool(ex.media) for ex in stream.train]
    return True


def training_source(config: TrainConfig, target: Target, read: dict | None = None):
    """Where batches come from: rendered examples with online capture (`read`: the dataset files as
    `check_dataset_exists` read them), or the offline cache."""
    if config.features == "offline":
        cache = FeatureCache(config.feature_cache)
        check_cache_matches(cache, target, data_settings(config))
        return OfflineSource(cache, target.dtype)
    if config.data_order == "shards":
        stream = load_shard_stream(target, config.data, max_length=config.max_length, seed=config.seed,
                                   validation_fraction=config.validation_fraction, adapter=config.adapter)
        return OnlineSource(target, stream.train, config.adapter, stream)
    split = config_examples(config, target, read)
    return OnlineSource(target, split.train, config.adapter)


def config_examples(config: TrainConfig, target: Target, read: dict | None = None) -> ExampleSplit:
    """The examples a run with `config` trains on (the same for `mmvsd train` and `mmvsd prepare`; `read`: the
    dataset files already read by `check_dataset_exists`)."""
    return load_examples(
        target, config.data, num_conversations=config.num_conversations, max_length=config.max_length,
        validation_fraction=config.validation_fraction, seed=config.seed, regenerate=config.regenerate,
        regenerate_max_new_tokens=config.regenerate_max_new_tokens,
        regenerate_cache=Path(config.regenerate_cache) if config.regenerate_cache else None,
        regenerate_batch_size=config.regenerate_batch_size, progress=config.progress, adapter=config.adapter,
        image_root=config.image_root, read=read,
    )


def data_settings(config: TrainConfig) -> dict:
    """The settings that decide which examples a feature cache holds."""
    keys = ("target", "data", "adapter", "num_conversations", "max_length", "validation_fraction", "seed",
            "regenerate", "regenerate_max_new_tokens")
    return {k: getattr(config, k) for k in keys}
