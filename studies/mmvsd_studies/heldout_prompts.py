"""The scale issue's held-out prompt file: chat questions and math word problems no run of the scale recipe trains on.

    python -m mmvsd_studies.heldout_prompts --out heldout40.jsonl

- `--chat` first user turns taken from the END of the dataset (ShareGPT's last conversations, in the dataset's
  order): `mmvsd regenerate` writes shards in that order, so they fall in its last shard, which a run following
  the regeneration (`data_order=shards`) reaches last. Turns outside `--min-chars`..`--max-chars` are passed over:
  a one-word turn tests little, and prompt and continuation should fit the CPU recipe's 512-token length.
- `--math` GSM8K test problems from item `--math-start` on (the text suite's `--limit N` runs use the first N).
- `--code` HumanEval problems from item `--code-start` on (likewise past the text suite's first items): code that
  no drafter here trained on (they train on ShareGPT).

One JSON object per line with a `prompt` (what `mmvsd eval-drafter --prompt-file` and the trainer's
`eval_prompts` read), its `source` and its `domain` (chat, math, code: the groups reports give figures for). The
file is a pure function of the installed data and these options.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmvsd.data.conversations import load_conversations
from mmvsd.eval.bench_item import BenchItem
from mmvsd.eval.suites import gsm8k_items, humaneval_items


def chat_prompts(data: str, count: int, min_chars: int, max_chars: int) -> list[dict]:
    """The first user turns of the dataset's last conversations, in the dataset's order, of min..max characters."""
    picked = []
    for conv in reversed(load_conversations(data)):
        first = next((turn.text for turn in conv.turns if turn.role == "user"), "")
        if min_chars <= len(first.strip()) <= max_chars:
            picked.append({"prompt": first, "source": f"{data}:{conv.conv_id}", "domain": "chat"})
        if len(picked) == count:
            break
    if len(picked) < count:
        sys.exit(f"heldout_prompts: {data} has only {len(picked)} first user turns of {min_chars}-{max_chars} "
                 "characters")
    return picked[::-1]


def benchmark_prompts(items: list[BenchItem], domain: str, start: int, count: int) -> list[dict]:
    """Items `start` .. `start + count` of a benchmark, first turns."""
    return [{"prompt": item.turns[0], "source": f"{item.benchmark}:{item.item_id}", "domain": domain}
            for item in items[start:start + count]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument("--chat", type=int, default=20)
    parser.add_argument("--min-chars", type=int, default=16)
    parser.add_argument("--max-chars", type=int, default=1200)
    parser.add_argument("--math", type=int, default=20)
    parser.add_argument("--math-start", type=int, default=200)
    parser.add_argument("--code", type=int, default=0)
    parser.add_argument("--code-start", type=int, default=100)
    args = parser.parse_args(argv)
    rows = (chat_prompts(args.data, args.chat, args.min_chars, args.max_chars)
            + benchmark_prompts(gsm8k_items(), "math", args.math_start, args.math)
            + benchmark_prompts(humaneval_items(), "code", args.code_start, args.code))
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"{args.out}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
