"""Reading prompts from the command line or from JSONL files (`prompt`, or MT-Bench `turns`)."""

from __future__ import annotations

import json
from pathlib import Path

from mmvsd.errors import UserError


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts of a JSONL file: each line's `prompt` field, or the first of its MT-Bench `turns`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
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
