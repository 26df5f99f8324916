"""On-policy regeneration throughput: answer tokens per second of `regenerate_conversations` on a real target.

Regenerates the same ShareGPT conversations (greedy, answers cut at the training length as training
would) once per batch size, each into its own temporary cache, and reports conversations, answers,
answer tokens and tokens/s (`regenerate_batch_size` in the training config picks the batch size).

    python benchmarks/bench_regenerate.py --num-conversations 64 --batch-sizes 16,64 --out r.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from mmvsd.data.conversations import load_conversations
from mmvsd.target_loader import load_target
from mmvsd.training.regenerate import RegenerateStats, regenerate_conversations


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--data", default="sharegpt")
    p.add_argument("--skip", type=int, default=8000, help="start this far into the dataset (past the training runs)")
    p.add_argument("--num-conversations", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=448)
    p.add_argument("--max-length", type=int, default=512, help="training length: answers stop there")
    p.add_argument("--batch-sizes", default="16,64")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--out", default="")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target = load_target(args.target, dtype=dtype)
    convs = load_conversations(args.data, limit=args.skip + args.num_conversations)[args.skip:]
    rows = []
    for batch_size in (int(x) for x in args.batch_sizes.split(",")):
        stats = RegenerateStats()
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            regenerate_conversations(target, convs, cache_path=Path(tmp) / "cache.jsonl", temperature=0.0,
                                     max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_length,
                                     batch_size=batch_size, progress=False, stats=stats)
            seconds = time.perf_counter() - start
        row = {"batch_size": batch_size, "conversations": stats.num_regenerated,
               "answers": stats.num_answers, "tokens": stats.num_tokens, "seconds": round(seconds, 1),
               "tokens_per_s": round(stats.num_tokens / seconds, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "target": args.target, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
