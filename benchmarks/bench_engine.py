"""Engine speed on SmolLM2-135M: HF generate, own vanilla loop, HF prompt lookup, tree decoding.

Runs the methods interleaved per prompt after a warm-up, at T=0, batch size 1, and prints a
Markdown table of median tokens/s, the ratio to the own vanilla loop, and tau. With an untrained
(random) drafter tau is ~1, so the tree row shows the engine's overhead.

    python benchmarks/bench_engine.py [--limit 80] [--max-new-tokens 128] [--drafter random|DIR]

`--forward-cost` instead measures one verification step of the target alone: `Target.forward` of n
new tokens (a chain) over a `--context`-token cache plus `RaggedCache.keep` of 2 of them, median
wall and CPU time after warm-up, and the ratio to n=1. `--legacy` runs the engine as it was before
issue 15 (an HF `DynamicCache` that concatenates the whole cache every forward, and transformers'
sdpa that copies the KV heads per query head) for before/after numbers.

    python benchmarks/bench_engine.py --forward-cost [--sizes 1,4,8,16,60] [--threads 2] [--legacy]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources

import torch
from transformers.cache_utils import Cache, DynamicLayer

from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.kv import RaggedCache
from mmvsd.decoding.tree import TreeShape
from mmvsd.drafters import load_drafter
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.eval.baselines import hf_generate
from mmvsd.target import Target
from mmvsd.target_loader import load_target


def mt_bench_first_turns() -> list[str]:
    text = resources.files("mmvsd.data").joinpath("mt_bench/question.jsonl").read_text()
    return [json.loads(line)["turns"][0] for line in text.splitlines() if line.strip()]


class LegacyLayer(DynamicLayer):
    """The pre-issue-15 cache layer: concatenation per update, keep copies keys and values apart."""

    def truncate(self, length: int) -> None:
        if self.is_initialized and self.keys.shape[-2] > length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def move(self, rows, dst, src) -> None:
        self.keys[rows, :, dst] = self.keys[rows, :, src]
        self.values[rows, :, dst] = self.values[rows, :, src]


def forward_cost(target: Target, sizes: list[int], context: int, repeats: int, legacy: bool) -> None:
    """Print median wall/CPU ms of Target.forward(n chain tokens) + keep(2) over a `context` cache."""
    if legacy:
        target.model.config.get_text_config(decoder=True)._attn_implementation = "sdpa"
    cache = RaggedCache(1, target.device)
    if legacy:
        cache.kv = Cache(layer_class_to_replicate=LegacyLayer)
    prompt = torch.arange(100, 100 + context)[None]
    causal = torch.ones(context, context, dtype=torch.bool).tril()[None]
    target.forward(cache, prompt, torch.arange(context)[None], causal, need_aux=False)
    cache.keep(torch.arange(context)[None], torch.tensor([context]))

    def step(n: int) -> None:
        depths = torch.arange(n)[None]
        target.forward(cache, torch.randint(0, 1000, (1, n)), depths, torch.ones(n, n, dtype=torch.bool).tril()[None])
        keep = min(n, 2)
        cache.keep(depths.flip(1) if n > 1 else depths, torch.tensor([keep]))  # entries move when n > 2
        cache.lens -= keep  # back to `context` committed tokens
        cache._truncate(context)

    print(f"{target.name}, {target.dtype}, {torch.get_num_threads()} threads, {context}-token cache, "
          f"{'legacy' if legacy else 'current'} engine: forward(n) + keep, median of {repeats}\n")
    print("| n | wall ms | wall / n=1 | CPU ms | CPU / n=1 |")
    print("| --- | --- | --- | --- | --- |")
    base = None
    for n in sizes:
        for _ in range(3):
            step(n)
        walls, cpus = [], []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            step(n)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        wall, cpu = statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3
        base = base or (wall, cpu)
        print(f"| {n} | {wall:.1f} | {wall / base[0]:.2f}x | {cpu:.1f} | {cpu / base[1]:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", default="random")
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--forward-cost", action="store_true", help="time one target verification step per size")
    parser.add_argument("--sizes", default="1,4,8,16,60", help="new tokens per forward, for --forward-cost")
    parser.add_argument("--context", type=int, default=300, help="committed tokens, for --forward-cost")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--legacy", action="store_true", help="--forward-cost on the pre-issue-15 cache and attention")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    if args.forward_cost:
        forward_cost(target, [int(n) for n in args.sizes.split(",")], args.context, args.repeats, args.legacy)
        return
    drafter = (Eagle3Drafter.from_target(target, seed=0).eval() if args.drafter == "random"
               else load_drafter(args.drafter, target))
    config = DecodeConfig(max_new_tokens=args.max_new_tokens)
    small = DecodeConfig(max_new_tokens=args.max_new_tokens, tree=TreeShape(budget=16, depth=4, topk=4))
    methods = {
        "HF generate (greedy)": lambda p: hf_generate(target, p, config),
        "mmvsd vanilla loop": lambda p: vanilla_generate(target, [p], config)[0],
        "HF prompt lookup (k=10)": lambda p: hf_generate(target, p, config, prompt_lookup_num_tokens=10),
        f"mmvsd tree 60/7/10 ({args.drafter} drafter)": lambda p: speculative_generate(target, drafter, [p], config)[0],
        f"mmvsd tree 16/4/4 ({args.drafter} drafter)": lambda p: speculative_generate(target, drafter, [p], small)[0],
    }
    prompts = [target.encode_prompt(t) for t in mt_bench_first_turns()[: args.limit]]
    for run in methods.values():  # warm-up
        run(prompts[0][:32])
    speeds = {name: [] for name in methods}
    taus = {name: [] for name in methods}
    reference = {}
    mismatches = 0
    for index, prompt in enumerate(prompts):
        for name, run in methods.items():
            result = run(prompt)
            speeds[name].append(result.tokens_per_second)
            taus[name].append(result.tau)
            if name == "mmvsd vanilla loop":
                reference[index] = result.output_ids
            elif "tree" in name and result.output_ids != reference[index]:
                mismatches += 1
        print(f"prompt {index + 1}/{len(prompts)}: " + ", ".join(
            f"{n.split(' (')[0]} {speeds[n][-1]:.1f}" for n in methods), flush=True)
    base = statistics.median(speeds["mmvsd vanilla loop"])
    print(f"\n{args.target}, {len(prompts)} MT-Bench first turns, {args.max_new_tokens} new tokens, T=0, batch 1\n")
    print("| method | median tokens/s | vs own vanilla | tau |")
    print("| --- | --- | --- | --- |")
    for name in methods:
        med = statistics.median(speeds[name])
        tau = f"{statistics.mean(taus[name]):.2f}" if "HF" not in name else "-"
        print(f"| {name} | {med:.2f} | {med / base:.2f}x | {tau} |")
    print(f"\ntree output != vanilla output on {mismatches} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
