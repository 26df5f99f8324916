"""`--chain auto` for llama.cpp rows: n_max and p_min planned (`mmvsd.decoding.chain_plan`) from llama.cpp's own
measured step costs and the drafter's chains recorded by mmvsd's exact replay on held-out prompts.

- Step costs, end to end through the server (its sampling, EAGLE-3 feature extraction and bookkeeping
  included): the plain server's seconds per step; the draft server with `n_max 1, p_min 0.9999` (the drafter
  runs once a step and nearly never drafts) minus that is a drafter forward; and with `n_max k, p_min 0` (every
  step drafts k tokens: k forwards, k + 1 tokens verified) for k = 1..8, a step's seconds less its k forwards
  are the verify cost of k + 1 tokens. Seconds per step = generation time / (tokens - accepted drafts), the
  median over 3 held-out prompts.
- Chains: the drafter alone (no n-gram branches), argmax chains of depth N along the target's greedy answers to
  held-out items of the suite (the items after the measured ones: never the bench's own prompts).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from mmvsd.decoding.chain_plan import ChainCosts, ChainPlan, ChainRecorder, plan_chain
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.engines.llamacpp_server import LlamaServer
from mmvsd.errors import UserError
from mmvsd.eval.acceptance import evaluate_acceptance, greedy_continuations
from mmvsd.eval.suites import load_items, resolve_suite
from mmvsd.target import Target

DEPTH = 8  # longest chain considered
HELD_OUT_PER_BENCHMARK = 4
CALIBRATION_TOKENS = 96
COST_PROMPTS = 3
STEP_TOKENS = 64


def plan_row(config, target: Target, spec: str, model: Path, draft_args: list[str]) -> ChainPlan:
    """The (n_max, p_min) plan of one drafter row; printed with its expected speed-up."""
    prompts = held_out_prompts(config, target)
    samples = chain_samples(target, spec, prompts)
    costs = measure_costs(model, draft_args, prompts[:COST_PROMPTS])
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


def measure_costs(model: Path, draft_args: list[str], prompts: list[list[int]]) -> ChainCosts:
    """llama.cpp's step costs, measured end to end through its server (module docstring)."""
    with LlamaServer(model) as plain:
        plain_step = step_seconds(plain, prompts)
    with LlamaServer(model, [*draft_args, "--spec-draft-n-max", "1", "--spec-draft-p-min", "0.9999"]) as idle:
        draft_forward = max(step_seconds(idle, prompts) - plain_step, 0.0)
    chain_steps = []
    for num_drafted in range(1, DEPTH + 1):  # every step drafts num_drafted tokens (p_min 0): one forward each
        args = [*draft_args, "--spec-draft-n-max", str(num_drafted), "--spec-draft-p-min", "0"]
        with LlamaServer(model, args) as server:
            chain_steps.append(step_seconds(server, prompts) - num_drafted * draft_forward)
    return ChainCosts((plain_step, *chain_steps), draft_forward)


def step_seconds(server: LlamaServer, prompts: list[list[int]]) -> float:
    """Median seconds per target step over the prompts (llama.cpp's generation time / its verify steps, a step
    being each accepted run plus its bonus token)."""
    times = []
    for prompt in prompts:
        timings = server.complete(prompt, STEP_TOKENS)["timings"]
        steps = max(timings["predicted_n"] - timings.get("draft_n_accepted", 0), 1)
        times.append(timings["predicted_ms"] / 1e3 / steps)
    return statistics.median(times)
