"""Engine speed on SmolLM2-135M: HF generate, own vanilla loop, HF prompt lookup, tree decoding.

Runs the methods interleaved per prompt after a warm-up, at T=0, batch size 1, and prints a
Markdown table of median tokens/s, the ratio to the own vanilla loop, and tau. With an untrained
(random) drafter tau is ~1, so the tree row shows the engine's overhead.

    python benchmarks/bench_engine.py [--limit 80] [--max-new-tokens 128] [--drafter random|DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from importlib import resources

from mmvsd.baselines import hf_generate
from mmvsd.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.drafter import load_drafter
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.targets import load_target
from mmvsd.tree import TreeShape


def mt_bench_first_turns() -> list[str]:
    text = resources.files("mmvsd.data").joinpath("mt_bench/question.jsonl").read_text()
    return [json.loads(line)["turns"][0] for line in text.splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", default="random")
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load_target(args.target)
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
