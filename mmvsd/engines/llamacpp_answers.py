"""Regeneration answers from llama.cpp: `mmvsd regenerate --engine llama.cpp`.

One `llama-server` with `parallel` slots decodes that many answers together (continuous batching) from the
target's own GGUF file, the file mmvsd's built-in targets are read from. Prompts go in as mmvsd's token ids, so
the chat template is mmvsd's; the answers are llama.cpp's greedy (or seeded T > 0) continuations. On a CPU this is
faster than mmvsd's exact loop (docs/training.md), but llama.cpp's arithmetic is not mmvsd's: a greedy answer can
take the other token where two are nearly tied, and continue from there. The engine's name joins the cache key,
so these answers never mix with mmvsd's. Images are refused (llama.cpp cannot take mmvsd's image embeddings).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmvsd.adapter_base import Prompt
from mmvsd.engines.llamacpp_server import LlamaServer
from mmvsd.errors import UserError


class LlamaCppAnswers:
    """An `AnswerFn` (mmvsd.training.regenerate) over one llama-server; a context manager that owns the server."""

    def __init__(self, model: Path, parallel: int = 8, context_per_slot: int = 2048, threads: int = 0) -> None:
        if parallel < 1:
            raise UserError(f"--parallel must be >= 1, got {parallel}")
        self.model, self.parallel = Path(model), parallel
        self.server = LlamaServer(self.model, threads=threads, context=parallel * context_per_slot, parallel=parallel)

    @property
    def engine(self) -> str:
        """The engine's name in the cache key: llama.cpp and the exact file it ran (name and size)."""
        return f"llama.cpp:{self.model.name}:{self.model.stat().st_size}"

    def __enter__(self) -> LlamaCppAnswers:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def __call__(self, prompts: list[Prompt], budgets: list[int], temperature: float,
                 seeds: list[int]) -> list[list[int]]:
        if any(prompt.inputs_embeds is not None for prompt in prompts):
            raise UserError("--engine llama.cpp answers text prompts only; regenerate image conversations with "
                            "--engine mmvsd")

        def one(item: tuple[Prompt, int, int]) -> list[int]:
            prompt, budget, seed = item
            return list(self.server.complete(prompt.token_ids, budget, temperature, seed)["tokens"])

        with ThreadPoolExecutor(self.parallel) as pool:
            return list(pool.map(one, zip(prompts, budgets, seeds)))
