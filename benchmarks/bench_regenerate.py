"""On-policy regeneration throughput: answer tokens per second (and per core-hour) on a real target.

Regenerates the same ShareGPT conversations (greedy, answers cut at the training length as training
would) once per setting, each into its own temporary cache, and reports conversations, answers, answer tokens,
tokens/s and tokens per core-hour (tokens/s x 3600 / cores the engine used). Settings: mmvsd's engine at each
batch size (`regenerate_batch_size` in the training config picks it), or llama.cpp (`--engine llama.cpp`) at
each pair of slots and threads.

    python benchmarks/bench_regenerate.py --num-conversations 64 --batch-sizes 16,64 --out r.json
    python benchmarks/bench_regenerate.py --engine llama.cpp --parallel 4,8,16 --llama-threads 1,2 --out r.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from mmvsd.data.conversations import load_conversations
from mmvsd.decoding.cpu_kernels import decoding_kernels
from mmvsd.engines.llamacpp_answers import LlamaCppAnswers
from mmvsd.target_loader import load_target, target_gguf_file
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
    p.add_argument("--engine", default="mmvsd", choices=["mmvsd", "llama.cpp"])
    p.add_argument("--parallel", default="8", help="llama.cpp: slots, comma-separated")
    p.add_argument("--llama-threads", default="1", help="llama.cpp: threads, comma-separated")
    p.add_argument("--out", default="")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target = load_target(args.target, dtype=dtype)
    if args.engine == "mmvsd":  # mmvsd's loop decodes on its kernels (bf16: the exact ones where this CPU has them)
        target = decoding_kernels(target)
    convs = load_conversations(args.data, limit=args.skip + args.num_conversations)[args.skip:]
    rows = []
    for setting in settings(args):
        stats = RegenerateStats()
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            answer, engine, cores = None, "", setting.get("threads") or torch.get_num_threads()
            if args.engine == "llama.cpp":
                answer = stack.enter_context(LlamaCppAnswers(target_gguf_file(args.target), setting["parallel"],
                                                             args.max_length + args.max_new_tokens + 32,
                                                             setting["threads"]))
                engine = answer.engine
            start = time.perf_counter()
            regenerate_conversations(target, convs, cache_path=Path(tmp) / "cache.jsonl", temperature=0.0,
                                     max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_length,
                                     batch_size=setting["batch_size"], progress=False, stats=stats, answer=answer,
                                     engine=engine)
            seconds = time.perf_counter() - start
        row = {**setting, "engine": args.engine, "conversations": stats.num_regenerated,
               "answers": stats.num_answers, "tokens": stats.num_tokens, "seconds": round(seconds, 1),
               "tokens_per_s": round(stats.num_tokens / seconds, 1),
               "tokens_per_core_hour": round(stats.num_tokens / seconds * 3600 / cores)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "target": args.target, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "rows": rows}, indent=1))


def settings(args: argparse.Namespace) -> list[dict]:
    """The settings to time: batch sizes (mmvsd), or slots x threads (llama.cpp; every slot answers at once)."""
    if args.engine == "mmvsd":
        return [{"batch_size": int(size)} for size in args.batch_sizes.split(",")]
    return [{"parallel": int(slots), "threads": int(threads), "batch_size": max(int(slots), 64)}
            for slots in args.parallel.split(",") for threads in args.llama_threads.split(",")]


if __name__ == "__main__":
    main()
