"""`--chain auto` for llama.cpp rows: n_max and p_min planned (`mmvsd.decoding.chain_plan`) from llama.cpp's own
measured step costs and the drafter's chains recorded by mmvsd's exact replay on held-out prompts.

- Verify costs: `llama-bench -p 1..N+1 -n 0 -d 256` on the target GGUF (a step verifying k tokens after a
  256-token context), scaled so that its one-token step equals the plain server's own per-token time.
- Drafter cost: the draft server with `n_max 1, p_min 0.9999` (the drafter runs every step, nearly never
  drafts) minus the plain server, per token, on a held-out prompt.
- Chains: the drafter alone (no n-gram branches), argmax chains of depth N along the target's greedy answers to
  held-out items of the suite (the items after the measured ones: never the bench's own prompts).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from mmvsd.decoding.chain_plan import ChainCosts, ChainPlan, ChainRecorder, plan_chain
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.eval.llamacpp_server import LlamaServer, find_llama_server
from mmvsd.eval.suites import load_items, resolve_suite
from mmvsd.target import Target
from mmvsd.training.acceptance import evaluate_acceptance, greedy_continuations

DEPTH = 8  # longest chain considered
HELD_OUT_PER_BENCHMARK = 4
CALIBRATION_TOKENS = 96
CONTEXT = 256
REPEATS = 5


def plan_row(config, target: Target, spec: str, model: Path, draft_args: list[str]) -> ChainPlan:
    """The (n_max, p_min) plan of one drafter row; printed with its expected speed-up."""
    prompts = held_out_prompts(config, target)
    samples = chain_samples(target, spec, prompts)
    costs = measure_costs(model, draft_args, prompts[0])
    plan = plan_chain(samples, costs, DEPTH)
    verdict = "" if plan.speedup > 1 else " (no chain beats plain decoding here: expect a slow-down)"
    print(f"mmvsd: --chain auto for {spec}: {plan.chain()} (expected {plan.speedup:.2f}x plain decoding; "
          f"{len(samples)} chains from {len(prompts)} held-out prompts; verify 1/2/4/8 tokens = "
          + "/".join(f"{costs.verify(k) * 1e3:.1f}" for k in (1, 2, 4, 8))
          + f" ms, a drafter forward {costs.draft_seconds * 1e3:.1f} ms){verdict}", file=sys.stderr, flush=True)
    return plan


def held_out_prompts(config, target: Target) -> list[list[int]]:
    """First turns of the suite's items after the first `--limit` (the measured ones), as token ids."""
    prompts = []
    for name in resolve_suite(config.suite):
        items = load_items(name, 0)[config.limit: config.limit + HELD_OUT_PER_BENCHMARK] if config.limit else []
        prompts += [target.encode_chat([{"role": "user", "content": item.turns[0]}]) for item in items
                    if not item.images]
    if not prompts:
        raise UserError("--chain auto plans from held-out items after the measured ones: give --limit smaller "
                        "than the benchmarks' sizes")
    return prompts


def chain_samples(target: Target, spec: str, prompts: list[list[int]]) -> list:
    """The drafter's argmax chains along the target's greedy answers (mmvsd's exact replay)."""
    drafter = drafter_from_spec(spec, target, ngram=False)
    continuations = greedy_continuations(target, prompts, CALIBRATION_TOKENS)
    recorder = ChainRecorder(DEPTH)
    evaluate_acceptance(target, drafter, prompts, continuations, recorder)
    return recorder.samples


def measure_costs(model: Path, draft_args: list[str], prompt: list[int]) -> ChainCosts:
    """llama.cpp's verify curve and drafter forward, in seconds (module docstring)."""
    curve = bench_curve(model, DEPTH + 1)
    with LlamaServer(model) as plain:
        plain_token = per_token(plain, prompt)
    with LlamaServer(model, [*draft_args, "--spec-draft-n-max", "1", "--spec-draft-p-min", "0.9999"]) as drafting:
        draft_token = per_token(drafting, prompt)
    scale = plain_token / curve[0]
    return ChainCosts(tuple(c * scale for c in curve), max(draft_token - plain_token, 0.0))


def per_token(server: LlamaServer, prompt: list[int]) -> float:
    """Median seconds per generated token over a few requests (llama.cpp's own generation timing)."""
    times = []
    for _ in range(3):
        timings = server.complete(prompt, 64)["timings"]
        times.append(timings["predicted_ms"] / 1e3 / max(timings["predicted_n"], 1))
    return statistics.median(times)


def bench_curve(model: Path, max_tokens: int) -> list[float]:
    """Seconds of a step verifying 1..max_tokens tokens after a 256-token context, from llama-bench."""
    binary = find_llama_server().with_name("llama-bench")
    if not binary.is_file():
        raise UserError(f"--chain auto needs llama-bench next to {binary.parent / 'llama-server'}")
    sizes = ",".join(str(k) for k in range(1, max_tokens + 1))
    command = [str(binary), "-m", str(model), "-p", sizes, "-n", "0", "-d", str(CONTEXT), "-r", str(REPEATS),
               "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"llama-bench failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    tests = {int(t["n_prompt"]): float(t["avg_ns"]) / 1e9 for t in json.loads(done.stdout)}
    return [tests[k] for k in range(1, max_tokens + 1)]
