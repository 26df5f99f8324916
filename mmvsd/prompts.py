"""Prompts: reading JSONL prompt files (`prompt`, or MT-Bench `turns`), and the registry of named prompt sets
(the benchmarks' first turns, with their images) that `eval-drafter` and the training tau monitor read.

Every registered benchmark is a prompt set (`register_benchmark` in mmvsd/eval/suites.py registers it; the plugin
`mmvsd/eval/prompt_sets.py`, under `mmvsd.plugins`, brings the built-in benchmarks in and reads their first turns).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mmvsd.errors import UserError
from mmvsd.files import jsonl_lines
from mmvsd.plugins import load_plugins

if TYPE_CHECKING:  # types only
    from mmvsd.adapter_base import Prompt
    from mmvsd.target import Target

PromptSetLoader = Callable[["Target", int, str], "list[Prompt]"]  # (target, limit (0: all), adapter name) -> prompts
PROMPT_SETS: dict[str, PromptSetLoader] = {}
PROMPT_SET_CHECKS: dict[str, Callable[[], None]] = {}  # name -> UserError when its data is not here (cheap)


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts of a JSONL file: each line's `prompt` field, or the first of its MT-Bench `turns`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}")
    prompts = []
    for number, line in enumerate(jsonl_lines(path.read_text(encoding="utf-8")), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if prompt is None and isinstance(record, dict) and record.get("turns"):
            prompt = record["turns"][0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"{path}:{number}: needs a non-empty 'prompt' string or a 'turns' list")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"prompt file {path} holds no prompts")
    return prompts


def prompt_domains(spec: str, limit: int = 0) -> list[str]:
    """Each prompt's `domain` field in a JSONL prompt file (chat, math, code; "" where a line has none), for figures
    per domain; [] for a named prompt set (one benchmark: one group)."""
    if not Path(spec).is_file():
        return []
    records = [json.loads(line) for line in jsonl_lines(Path(spec).read_text(encoding="utf-8")) if line.strip()]
    domains = [str(record.get("domain", "")) if isinstance(record, dict) else "" for record in records]
    return domains[:limit] if limit > 0 else domains


def register_prompt_set(name: str, loader: PromptSetLoader, check: Callable[[], None] | None = None) -> None:
    """Make a prompt set loadable by `name` (`--prompt-file NAME`, `eval_prompts=NAME`); `check` raises UserError
    when its data cannot be read here, without a target (commands call it before one loads)."""
    PROMPT_SETS[name] = loader
    if check is not None:
        PROMPT_SET_CHECKS[name] = check


def prompt_set_names() -> list[str]:
    """The registered prompt sets' names, the plugins' included."""
    load_plugins()
    return sorted(PROMPT_SETS)


def check_eval_prompts(spec: str, limit: int = 0) -> None:
    """UserError for prompts `load_eval_prompts` cannot read: a bad limit, an unreadable prompt file, a name that is
    no prompt set. Cheap: commands call it before a target loads."""
    if limit < 0:
        raise UserError(f"--limit must be >= 0, got {limit}")
    if Path(spec).exists():
        read_prompt_file(spec)
    elif spec not in prompt_set_names():
        names = ", ".join(prompt_set_names())
        raise UserError(f"prompt file not found: {spec} (or name a built-in benchmark: {names})")
    elif spec in PROMPT_SET_CHECKS:
        PROMPT_SET_CHECKS[spec]()  # e.g. a real lmms-eval task whose dataset is not on this machine


def load_eval_prompts(target: Target, spec: str, limit: int = 0, adapter: str = "") -> list[Prompt]:
    """The target's prompts of `spec` (first `limit`, 0: all): a JSONL prompt file's, through the chat template,
    or a registered prompt set's (a benchmark's first turns, with images through the modality adapter
    `adapter`, or the first that can feed the target)."""
    from mmvsd.adapter_base import Prompt  # loads torch: the command line reads prompt files without it

    check_eval_prompts(spec, limit)
    if Path(spec).exists():
        texts = read_prompt_file(spec)
        return [Prompt(target.encode_prompt(text)) for text in (texts[:limit] if limit > 0 else texts)]
    prompts = PROMPT_SETS[spec](target, limit, adapter)
    if not prompts:
        raise UserError(f"no prompts in {spec}")
    return prompts
