"""Where tokens are decoded: the `Engine` interface and its registry (`--engine` of `mmvsd bench` and `regenerate`).

An engine is one way of running the target: mmvsd's own loop in this process (`mmvsd.engines.mmvsd_loop`, exact
tree verification, every drafter kind) or a serving engine in a subprocess (`mmvsd.engines.llamacpp`:
llama-server on the target's GGUF file). mmvsd always keeps its own copy of the target as well: it tokenizes, and
for another engine explains mismatches; `load_target` says which precision and kernels that copy needs.

A new engine is one file that subclasses `Engine` and calls `register_engine`, in a package listed under the
entry-point group `mmvsd.plugins` (docs/architecture.md); the commands look engines up here, after the plugins load,
so they never name one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from mmvsd.errors import UserError
from mmvsd.plugins import load_plugins

if TYPE_CHECKING:
    from contextlib import ExitStack

    from mmvsd.target import Target

DEFAULT_ENGINE = "mmvsd"


class Engine(ABC):
    """One place tokens are decoded. Subclasses set `name` and implement what they support; the commands call
    `check` before anything loads, then `load_target`, then `bench_methods` or `answers`."""

    name: ClassVar[str]
    report_note: ClassVar[str] = ""  # what its bench rows and ratios mean (the bench report's header)
    batch_one: ClassVar[bool] = False  # decodes one prompt at a time (`mmvsd bench --batch-size` must stay 1)
    media: ClassVar[bool] = True  # can take mmvsd's image prompts

    def check(self, target: str) -> None:
        """Raise UserError for a target this engine cannot run (one that names nothing, or lacks the file the engine
        needs), before any model loads."""
        from mmvsd.target_loader import check_target_spec  # the loader's torch: when a command checks its inputs

        check_target_spec(target)

    def check_bench(self, config) -> None:
        """Raise UserError for what this engine cannot run of a `mmvsd bench` config (`mmvsd.eval.bench_config`):
        its target, and the methods, options and files the engine reads; before any model loads."""
        self.check(config.target_name())

    @abstractmethod
    def load_target(self, spec: str, dtype: str, device: str) -> Target:
        """mmvsd's copy of the target that this engine works with. `dtype`: the `--dtype` given (auto, fp32, ...)."""

    def bench_methods(self, config, target: Target, stack: ExitStack) -> list:
        """The `mmvsd bench` rows (`mmvsd.eval.bench_method.Method`) for `config`; subprocesses they start are
        stopped when `stack` closes."""
        raise UserError(f"--engine {self.name} does not run `mmvsd bench`")

    def answers(self, target: Target, options: dict[str, Any]):
        """`mmvsd regenerate`'s answerer: None for mmvsd's own loop, else an `AnswerFn` (mmvsd.training.regenerate)
        that is also a context manager (it owns its subprocess) and has an `engine` string for the cache key.
        `options`: parallel, threads, context_per_slot."""
        raise UserError(f"--engine {self.name} does not run `mmvsd regenerate`")


ENGINES: dict[str, Engine] = {}


def register_engine(engine: Engine) -> Engine:
    """Make `--engine NAME` decode with `engine` (a plugin registers its own the same way)."""
    ENGINES[engine.name] = engine
    return engine


def engine_names() -> list[str]:
    """Every registered engine's name, the plugins' included."""
    load_plugins()
    return sorted(ENGINES, key=lambda name: (name != DEFAULT_ENGINE, name))


def get_engine(name: str) -> Engine:
    """The engine `--engine NAME` names; UserError listing the known ones."""
    names = engine_names()
    if name not in ENGINES:
        raise UserError(f"--engine {name!r}: choose one of {', '.join(names)}")
    return ENGINES[name]
