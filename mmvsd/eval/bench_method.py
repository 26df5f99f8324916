"""A bench row: a named way of generating (prompts -> results), whichever engine decodes it (`mmvsd.eval.bench`
builds mmvsd's own, `mmvsd.engines.llamacpp_bench` llama.cpp's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mmvsd.decoding.decode import DecodeConfig, SequenceResult


@dataclass
class Method:
    """A named way of generating: prompts (token ids) -> results."""

    name: str
    generate: Callable[[list[list[int]], DecodeConfig], list[SequenceResult]]
    own_loop: bool  # counts target forwards (tau)
    batch_one: bool = False  # decodes one prompt at a time (HF baselines, vanilla@b1)
    media_refusal: str = ""  # non-empty: the method cannot take image prompts, and why
    tree: str = "paper"  # the `--tree` entry it decodes with (tree rows; the others ignore it)
