"""Where one verify step's time goes on this machine: a target forward over N tree tokens plus the cache commit,
measured with the torch profiler and split into GEMMs, attention, masks and positions, cache writes, the LM
head, other operators and what no operator accounts for (Python and dispatch).

The step is the cost profile's (`mmvsd.decoding.cost_measure.verify_step`: `Target.forward` over a bushy tree of N
nodes on a cache of `--context` committed tokens, then `RaggedCache.keep` of a 4-node path), warmed up, then
profiled over `--steps` steps per N.

    python benchmarks/verify_breakdown.py [--target smollm2-135m] [--tokens 1,4,16,64] [--steps 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AttentionInterface

from mmvsd.decoding import cpu_kernels
from mmvsd.decoding.cost_measure import heap_tree, prefilled_cache, verify_step
from mmvsd.decoding.kv import RaggedCache
from mmvsd.decoding.tree import DraftTree
from mmvsd.target import Target
from mmvsd.target_loader import load_target

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "onednn")
# the exact kernels' float64 attention runs as matmuls under its own label, counted as attention
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "aten::_efficient_attention", "aten::softmax")
SECTIONS = ("mask+positions", "keep", "lm_head", "attention")  # our own code paths, labelled with record_function


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--tokens", default="1,4,16,64", help="tree sizes N to break down")
    p.add_argument("--context", type=int, default=256, help="committed tokens in the cache")
    p.add_argument("--steps", type=int, default=20, help="profiled steps per N (after 5 warm-up steps)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: with the exact kernels where this CPU allows it, as `--dtype bf16` loads it")
    p.add_argument("--json", help="also write the table here")
    return p.parse_args()


@contextmanager
def labelled(cls, name: str, label: str):
    """Wrap `cls.name` in a profiler label for the duration."""
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    setattr(cls, name, wrapper)
    try:
        yield
    finally:
        setattr(cls, name, original)


@contextmanager
def labelled_attention():
    """Label the exact kernels' float64 attention (matmuls that would otherwise count as GEMMs)."""
    def wrapper(*args, **kwargs):
        with record_function("attention"):
            return cpu_kernels.exact_attention(*args, **kwargs)

    AttentionInterface.register(cpu_kernels.EXACT_ATTENTION, wrapper)
    try:
        yield
    finally:
        AttentionInterface.register(cpu_kernels.EXACT_ATTENTION, cpu_kernels.exact_attention)


def step(target: Target, cache: RaggedCache, tree: DraftTree, lens: torch.Tensor) -> None:
    """The cost profile's verify step (no auxiliary states: a target alone), then back to `lens` tokens."""
    verify_step(target, cache, tree, need_aux=False)
    cache.rewind(lens)


def breakdown(target: Target, num_nodes: int, context: int, steps: int) -> dict[str, float]:
    """Milliseconds per step by category (self CPU time of the operators, and the unaccounted rest)."""
    cache, _, _ = prefilled_cache(target, 1, context, need_aux=False)
    lens = cache.lens.clone()
    tree = heap_tree(num_nodes, 1, target.vocab_size, target.device)
    tree.ancestor_mask()  # the tree builder computes it in decoding, not the verify step
    for _ in range(5):
        step(target, cache, tree, lens)
    with labelled(RaggedCache, "attention_mask", "mask+positions"), labelled(RaggedCache, "positions",
                                                                            "mask+positions"), \
            labelled(RaggedCache, "keep", "keep"), labelled(Target, "logits", "lm_head"), \
            labelled_attention(), \
            profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step(target, cache, tree, lens)
        wall = time.perf_counter() - start
    return summarise(prof.events(), wall, steps)


def summarise(events, wall: float, steps: int) -> dict[str, float]:
    """Split self CPU time: our labelled sections first (everything under them), then operators by kind."""
    totals = dict.fromkeys(("gemm", *SECTIONS, "other ops"), 0.0)
    for event in events:
        if event.name in SECTIONS:
            continue
        inside = next((s for s in SECTIONS if _under(event, s)), None)
        seconds = event.self_cpu_time_total / 1e6
        if inside is not None:
            totals[inside] += seconds
        elif any(op in event.name for op in GEMM_OPS):
            totals["gemm"] += seconds
        elif any(op in event.name for op in ATTENTION_OPS):
            totals["attention"] += seconds
        else:
            totals["other ops"] += seconds
    row = {name: 1e3 * value / steps for name, value in totals.items()}
    row["wall"] = 1e3 * wall / steps
    row["unaccounted (python, dispatch)"] = row["wall"] - sum(row[name] for name in totals)
    return row


def _under(event, label: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == label:
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    target = load_target(args.target, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    target = cpu_kernels.decoding_kernels(target)  # bf16: the exact kernels where this CPU allows them, as decoding
    sizes = [int(n) for n in args.tokens.split(",")]
    rows = {n: breakdown(target, n, args.context, args.steps) for n in sizes}
    columns = ["wall", "gemm", "attention", "mask+positions", "keep", "lm_head", "other ops",
               "unaccounted (python, dispatch)"]
    print(f"{target.name} ({target.dtype}, {target.engine} engine), {torch.get_num_threads()} threads, "
          f"cache of {args.context} tokens, ms per verify step (mean of {args.steps} steps); "
          "profiler overhead included")
    print("| N | " + " | ".join(columns) + " | x N=1 |")
    print("|---" * (len(columns) + 2) + "|")
    for n, row in rows.items():
        cells = " | ".join(f"{row[c]:.2f}" for c in columns)
        print(f"| {n} | {cells} | {row['wall'] / rows[sizes[0]]['wall']:.2f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"target": target.name, "dtype": str(target.dtype), "threads": torch.get_num_threads(),
                       "context": args.context, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
