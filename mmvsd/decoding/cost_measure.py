"""Measuring the cost table: seconds of a verify step per tree size and of drafting per frontier width.

`measure_costs` times the real code paths (`Target.forward` over a tree-shaped block plus `RaggedCache.keep`,
and a drafter's real session) warmed up, interleaved across shapes and summarised by lower quartiles. What
the numbers mean and where they are cached is `mmvsd.decoding.costs`.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import Tensor
from tqdm import tqdm

from mmvsd.decoding.costs import CostTable, check_table
from mmvsd.decoding.fingerprints import cost_key
from mmvsd.decoding.kv import RaggedCache, sequence_block
from mmvsd.decoding.tree import DraftTree
from mmvsd.drafter_base import DraftInputs
from mmvsd.target import Target

TARGET_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
DRAFT_WIDTHS = (1, 2, 4, 8, 10, 16)
DRAFT_TOPK = 10  # children asked of every expanded node (the cost hardly depends on it)
ACCEPTED_PAIRS = 3  # pairs the drafter is fed per step in the fixed-cost measurement (a typical tau)
REPEATS = 7  # timed rounds per shape (after one warm-up round)
SPOT_TOKENS = (1, 16)  # the verify steps `spot_check` times


def typical(values: list[float]) -> float:
    """The lower quartile of repeated timings: like the median for steady timings, but a process
    preempted in up to 3/4 of the rounds (a shared 2-core machine) still gets its real cost."""
    return sorted(values)[(len(values) - 1) // 4]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    """Wall seconds of fn(), with the device's queue drained before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _token_ids(count: int, vocab_size: int, device: torch.device) -> Tensor:
    """[count] fixed, varied token ids inside the vocabulary (what they are does not change the cost)."""
    return torch.arange(count, device=device) * 7 % min(vocab_size, 1000)


def heap_tree(num_nodes: int, batch: int, vocab_size: int, device: torch.device) -> DraftTree:
    """A bushy tree of `num_nodes` nodes (node i's parent is (i-1)//2), the same in every row."""
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, num_nodes)], device=device)
    depths = torch.zeros(num_nodes, dtype=torch.long, device=device)
    for i in range(1, num_nodes):
        depths[i] = depths[parents[i]] + 1
    ids = _token_ids(num_nodes, vocab_size, device)
    rows = [t[None].expand(batch, -1).contiguous() for t in (ids, parents, depths)]
    return DraftTree(*rows, torch.zeros(batch, num_nodes, device=device))


def prefilled_cache(target: Target, batch: int, context: int, need_aux: bool):
    """A cache of `context` committed tokens per row (fixed pseudo-random ids) and the prefill output."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(target.vocab_size, 1000), (batch, context), generator=gen).to(target.device)
    cache = target.new_cache(batch)
    depths, causal = sequence_block(batch, context, target.device)
    lens = torch.full((batch,), context, dtype=torch.long, device=target.device)
    out = target.forward(cache, ids, depths, causal, need_aux=need_aux, logit_positions=(lens - 1)[:, None])
    cache.keep(depths, lens)
    return cache, ids, out


def verify_step(target: Target, cache: RaggedCache, tree: DraftTree, need_aux: bool) -> None:
    """One verify step as decoding runs it: forward over the tree, keep a few accepted nodes."""
    target.forward(cache, tree.token_ids, tree.depths, tree.ancestor_mask(), need_aux=need_aux)
    last = torch.full((tree.token_ids.shape[0],), tree.num_nodes - 1, dtype=torch.long, device=cache.lens.device)
    path = tree.path_to(last)[:, :ACCEPTED_PAIRS + 1]
    num_keep = (path >= 0).sum(1)
    cache.keep(path.clamp(min=0), num_keep)


def measure_verify_steps(target: Target, cache: RaggedCache, need_aux: bool, tokens: tuple[int, ...], repeats: int,
                         tick=lambda: None) -> tuple[float, ...]:
    """Typical seconds of a verify step per token count; rounds interleave the counts against drift."""
    lens = cache.lens.clone()
    trees = {n: heap_tree(n, cache.batch_size, target.vocab_size, target.device) for n in tokens}
    for tree in trees.values():
        tree.ancestor_mask()  # computed by the tree builder in decoding, not by the verify step
    samples: dict[int, list[float]] = {n: [] for n in tokens}
    for round_index in range(repeats + 1):  # round 0 warms up
        for n in tokens:
            seconds = timed(target.device, lambda n=n: verify_step(target, cache, trees[n], need_aux))
            cache.rewind(lens)
            if round_index:
                samples[n].append(seconds)
            tick()
    return tuple(typical(samples[n]) for n in tokens)


@torch.no_grad()
def spot_check(target: Target, drafter, table: CostTable, tokens: tuple[int, ...] = SPOT_TOKENS,
               repeats: int = REPEATS) -> dict[int, float]:
    """Typical seconds of a verify step over each of `tokens` now, at the table's context and smallest batch:
    timed right after a table is measured (its `spot_seconds`) and again when a later process first uses it,
    whether the cached table still describes this machine (hosts with the same CPU model and flags differ up to
    threefold in memory bandwidth)."""
    need_aux = drafter is not None and drafter.reads_aux
    return verify_step_seconds(target, min(table.target_seconds), table.context, need_aux, tokens, repeats)


def verify_step_seconds(target: Target, batch: int, context: int, need_aux: bool,
                        tokens: tuple[int, ...] = SPOT_TOKENS, repeats: int = REPEATS) -> dict[int, float]:
    """Typical seconds of a verify step over each of `tokens` on a fresh cache of `context` tokens per row: the
    timing that spot checks repeat (of a cost table, and of `--dtype auto`'s choice of precision)."""
    cache, _, _ = prefilled_cache(target, batch, context, need_aux)
    return dict(zip(tokens, measure_verify_steps(target, cache, need_aux, tokens, repeats)))


def _draft_inputs(drafter, out, ids: Tensor, width: int, first: bool = False) -> DraftInputs:
    """The drafter's pairs for the first `width` prefill positions (`first`: as a prefill gives them)."""
    features = drafter.target_features(out.aux_hidden, out.last_hidden)[:, :width]
    next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)[:, :width]
    num_new = torch.full((ids.shape[0],), width, dtype=torch.long, device=ids.device)
    return DraftInputs(features, next_ids, num_new, first_ids=ids[:, 0] if first else None)


def _measure_drafter(drafter, target: Target, out, ids: Tensor, widths: tuple[int, ...], repeats: int,
                     tick) -> tuple[tuple[float, ...], float]:
    """(typical seconds of one expand per frontier width, typical fixed seconds per step).

    Each round opens a fresh decoding session on the prefill's first context-3 pairs (untimed), times
    one step's fixed work (advance 3 pairs, root candidates), then one first expansion per width."""
    batch, context = ids.shape
    device = target.device
    prompt_inputs = _draft_inputs(drafter, out, ids, context - ACCEPTED_PAIRS, first=True)
    step_inputs = _draft_inputs(drafter, out, ids, ACCEPTED_PAIRS)

    def fixed_step(session) -> None:
        session.advance(step_inputs)
        session.root_candidates(DRAFT_TOPK)

    def expand(session, width: int) -> None:  # every frontier node is a child of the root
        frontier = _token_ids(width, target.vocab_size, device).expand(batch, width)
        eye = torch.eye(width, dtype=torch.bool, device=device).expand(batch, width, width)
        session.expand(frontier, torch.zeros_like(frontier), eye, DRAFT_TOPK)

    fixed: list[float] = []
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for round_index in range(repeats + 1):  # round 0 warms up
        session = drafter.new_session(batch)
        session.advance(prompt_inputs)
        seconds = timed(device, lambda s=session: fixed_step(s))
        if round_index:
            fixed.append(seconds)
        for width in widths:
            session.root_candidates(DRAFT_TOPK)  # (re)starts a round at the root
            seconds = timed(device, lambda s=session, w=width: expand(s, w))
            session.end_round()
            if round_index:
                samples[width].append(seconds)
        tick()
    return tuple(typical(samples[w]) for w in widths), typical(fixed)


@torch.no_grad()
def measure_costs(
    target: Target,
    drafter=None,
    batch_sizes: tuple[int, ...] = (1,),
    context: int = 256,
    repeats: int = REPEATS,
    target_tokens: tuple[int, ...] = TARGET_TOKENS,
    draft_widths: tuple[int, ...] = DRAFT_WIDTHS,
    progress: bool = False,
) -> CostTable:
    """Time verify steps and drafting on this machine (warmed up, lower quartiles of `repeats` rounds).

    drafter: None, a neural `Drafter`, or any proposer with `new_session` (n-gram, hybrid)."""
    batch_sizes = tuple(sorted(set(batch_sizes)))
    if not batch_sizes or min(batch_sizes) < 1 or context < ACCEPTED_PAIRS + 1 or repeats < 1:
        raise ValueError(f"need batch sizes >= 1, context > {ACCEPTED_PAIRS} and repeats >= 1")
    widths = tuple(draft_widths) if drafter is not None else ()
    need_aux = drafter is not None and drafter.reads_aux
    bar = tqdm(total=len(batch_sizes) * (repeats + 1) * (len(target_tokens) + (1 if drafter else 0)),
               desc=f"mmvsd: measuring costs of {target.name}", disable=not progress, file=sys.stderr, leave=False)
    target_seconds, draft_seconds, fixed_seconds = {}, {}, {}
    for batch in batch_sizes:
        cache, ids, out = prefilled_cache(target, batch, context, need_aux)
        target_seconds[batch] = measure_verify_steps(target, cache, need_aux, tuple(target_tokens), repeats, bar.update)
        draft_seconds[batch], fixed_seconds[batch] = (), 0.0
        if drafter is not None:
            draft_seconds[batch], fixed_seconds[batch] = _measure_drafter(drafter, target, out, ids, widths,
                                                                          repeats, bar.update)
        del cache, out
    bar.close()
    table = CostTable(cost_key(target, drafter, batch_sizes, context), tuple(target_tokens), target_seconds,
                      widths, draft_seconds, fixed_seconds, context)
    check_table(table)
    return table
