"""One benchmark prompt (`BenchItem`): what every suite yields and `mmvsd bench` decodes and scores."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchItem:
    """One benchmark prompt: its user turns and what scoring needs."""

    benchmark: str
    item_id: str
    turns: tuple[str, ...]  # user turns; turn k is asked after the model's own answer to turn k-1
    reference: dict = field(default_factory=dict)  # gsm8k: {"answer"}, humaneval: the problem, tasks: doc index
    images: tuple = ()  # PIL images shown before the first turn
