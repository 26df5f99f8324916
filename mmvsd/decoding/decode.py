"""Decode loops on the target wrapper: speculative tree decoding and the vanilla baseline.

Both take a batch of prompts of different lengths (right-padded in one ragged cache); each row
accepts its own number of tokens per step and leaves the batch when it is finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from mmvsd.adapter_base import Prompt, padded_embeds, span_ids
from mmvsd.decoding.cost_cache import load_cost_table
from mmvsd.decoding.kv import sequence_block
from mmvsd.decoding.proposer import Proposer
from mmvsd.decoding.shape_policy import FULL, LIGHT, PLAIN, AcceptanceStats, AutoShape, StepCosts
from mmvsd.decoding.tree import ShapePlan, TreeShape, build_dynamic_tree, root_only_tree
from mmvsd.decoding.verify import row_generators, sample_next, verify
from mmvsd.drafter_base import DraftInputs, PairMedia
from mmvsd.errors import UserError
from mmvsd.target import Target


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode: length, temperature, tree shape, seed."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    tree: TreeShape | str = TreeShape()  # a fixed shape, or "auto": planned per step from measured costs
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tree, TreeShape) and self.tree != "auto":
            raise UserError(f"tree must be a TreeShape or 'auto', got {self.tree!r}")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class SequenceResult:
    """One prompt's generation and its counters."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    num_target_forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens per target forward (bonus counted)
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per step, root included (1: plain)
    wall_seconds: float = 0.0
    finished: bool = False

    @property
    def tau(self) -> float:
        """Mean new tokens per target forward, bonus included (prefill counts as one forward)."""
        return len(self.output_ids) / max(self.num_target_forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.wall_seconds if self.wall_seconds > 0 else 0.0


PromptLike = list[int] | Prompt  # token ids, or a Prompt from a modality adapter


def as_prompts(prompts: list[PromptLike]) -> list[Prompt]:
    return [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]


def _pad_prompts(prompts: list[Prompt], device: torch.device) -> tuple[Tensor, Tensor]:
    """Right-pad prompts: ids [B, P], lengths [B]."""
    lens = torch.tensor([len(p.token_ids) for p in prompts], dtype=torch.long, device=device)
    ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt.token_ids)] = torch.tensor(prompt.token_ids, dtype=torch.long)
    return ids, lens


def _check_prompts(target: Target, prompts: list[Prompt], config: DecodeConfig, lookahead: int) -> None:
    if not prompts:
        raise UserError("no prompts to decode")
    for prompt in prompts:
        target.check_length(len(prompt.token_ids), config.max_new_tokens, lookahead)


def _prompt_media(prompts: list[Prompt], embeds: Tensor | None) -> PairMedia | None:
    """What the drafter's prefill pairs see of the prompts' media (None without media)."""
    if embeds is None:
        return None
    return PairMedia.from_tokens(embeds, span_ids(prompts, embeds.shape[1], embeds.device))


def _prefill(target: Target, prompts: list[Prompt], need_aux: bool):
    """Run the prompts through the target; returns (cache, padded ids, lens, output, prompt media)."""
    ids, lens = _pad_prompts(prompts, target.device)
    batch, width = ids.shape
    cache = target.new_cache(batch)
    depths, causal = sequence_block(batch, width, ids.device)
    embeds = padded_embeds(target, prompts, ids)
    out = target.forward(cache, ids, depths, causal, need_aux=need_aux, logit_positions=(lens - 1)[:, None],
                         inputs_embeds=embeds)
    cache.keep(depths, lens)
    return cache, ids, lens, out, _prompt_media(prompts, embeds)


class _Tracker:
    """Appends accepted tokens per row, applies max length and EOS, and times each row."""

    def __init__(self, prompts: list[Prompt], target: Target, config: DecodeConfig,
                 row_max_new_tokens: list[int] | None = None) -> None:
        self.results = [SequenceResult(list(p.token_ids)) for p in prompts]
        self.active = list(range(len(prompts)))  # result index of each live batch row
        self.eos = target.eos_token_ids
        self.max_new = row_max_new_tokens or [config.max_new_tokens] * len(prompts)  # per result index
        self.start = time.perf_counter()

    def add(self, row: int, token_ids: list[int], num_nodes: int = 1) -> None:
        result = self.results[self.active[row]]
        max_new = self.max_new[self.active[row]]
        result.num_target_forwards += 1
        result.tree_sizes.append(num_nodes)
        room = max_new - len(result.output_ids)
        kept = token_ids[:room]
        for pos, token in enumerate(kept):
            if token in self.eos:
                kept = kept[: pos + 1]
                break
        result.output_ids.extend(kept)
        result.accept_lengths.append(len(token_ids))
        if len(result.output_ids) >= max_new or (kept and kept[-1] in self.eos):
            result.finished = True
            result.wall_seconds = time.perf_counter() - self.start

    def live_rows(self) -> Tensor:
        """Batch rows still decoding; drops the finished ones from `active`."""
        rows = [row for row, idx in enumerate(self.active) if not self.results[idx].finished]
        self.active = [self.active[row] for row in rows]
        return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def vanilla_generate(target: Target, prompts: list[PromptLike], config: DecodeConfig,
                     row_max_new_tokens: list[int] | None = None) -> list[SequenceResult]:
    """Plain autoregressive decoding on the same target wrapper: the speed-up denominator.

    `row_max_new_tokens`: a smaller budget per prompt (each at most `config.max_new_tokens`); a row leaves
    the batch when it is spent, as at EOS.
    """
    prompts = as_prompts(prompts)
    _check_prompts(target, prompts, config, lookahead=1)
    if row_max_new_tokens is not None and (
            len(row_max_new_tokens) != len(prompts)
            or not all(1 <= n <= config.max_new_tokens for n in row_max_new_tokens)):
        raise UserError(f"row_max_new_tokens needs one budget in [1, {config.max_new_tokens}] per prompt")
    generator = row_generators([p.token_ids for p in prompts], config.seed)  # one per row
    tracker = _Tracker(prompts, target, config, row_max_new_tokens)
    cache, _, _, out, _ = _prefill(target, prompts, need_aux=False)
    next_ids = sample_next(out.logits[:, 0], config.temperature, generator)  # [B]
    for row, token in enumerate(next_ids.tolist()):
        tracker.add(row, [token])
    while True:
        rows = tracker.live_rows()
        if rows.numel() == 0:
            break
        if rows.numel() < cache.batch_size:
            cache.select_rows(rows.to(cache.lens.device))
            next_ids = next_ids[rows.to(next_ids.device)]
            generator = [generator[row] for row in rows.tolist()]
        batch = rows.numel()
        zeros = torch.zeros(batch, 1, dtype=torch.long, device=target.device)
        ones = torch.ones(batch, 1, 1, dtype=torch.bool, device=target.device)
        out = target.forward(cache, next_ids[:, None], zeros, ones, need_aux=False)
        cache.keep(zeros, torch.ones(batch, dtype=torch.long, device=target.device))
        next_ids = sample_next(out.logits[:, 0], config.temperature, generator)
        for row, token in enumerate(next_ids.tolist()):
            tracker.add(row, [token])
    return tracker.results


@torch.no_grad()
def speculative_generate(
    target: Target, drafter: Proposer, prompts: list[PromptLike], config: DecodeConfig,
    costs: StepCosts | None = None, stats: AcceptanceStats | None = None,
) -> list[SequenceResult]:
    """Tree speculative decoding: draft a tree, verify it in one target forward, repeat.

    With `config.tree == "auto"` the shape is planned per step from `costs` (measured and cached on
    first use when None) and acceptance learnt while decoding (into `stats`, which callers pass again
    to carry it from call to call), and each step is plain, n-gram-only or fully drafted, whichever
    is measured to commit tokens fastest (`StepChooser`); the neural drafter, idle on the first two,
    reads the pairs they committed when it next drafts.
    """
    prompts = as_prompts(prompts)
    plan = make_shape(config.tree, target, drafter, len(prompts), costs, stats)
    chooser = plan.stats.chooser() if isinstance(plan, AutoShape) else None
    _check_prompts(target, prompts, config, lookahead=plan.depth + 1)
    for prompt in prompts:
        drafter.check_media(len(prompt.spans))
    generator = row_generators([p.token_ids for p in prompts], config.seed)  # one per row
    tracker = _Tracker(prompts, target, config)
    cache, ids, lens, out, media = _prefill(target, prompts, need_aux=drafter.reads_aux)
    roots = sample_next(out.logits[:, 0], config.temperature, generator)  # [B]
    rows = torch.arange(len(prompts), device=ids.device)
    next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    next_ids[rows, lens - 1] = roots
    session = drafter.new_session(len(prompts))
    features = drafter.target_features(out.aux_hidden, out.last_hidden)
    session.advance(DraftInputs(features, next_ids, lens, media, first_ids=ids[:, 0]))
    light = session.light_expander() if chooser is not None else None  # n-gram branches alone, if any
    light_plan = plan.without_drafter() if light is not None else None
    for row, token in enumerate(roots.tolist()):
        tracker.add(row, [token])
    while True:
        live = tracker.live_rows()
        if live.numel() == 0:
            break
        if live.numel() < cache.batch_size:
            live = live.to(target.device)
            cache.select_rows(live)
            session.select_rows(live)
            roots = roots[live]
            generator = [generator[row] for row in live.tolist()]
        start = time.perf_counter()
        kind = FULL if chooser is None else chooser.step_kind(light is not None and light.has_proposals())
        if kind == PLAIN:
            tree = root_only_tree(roots)
        elif kind == LIGHT:
            tree = build_dynamic_tree(roots, light, light_plan)
        else:
            tree = build_dynamic_tree(roots, session, plan)
        out = target.forward(cache, tree.token_ids, tree.depths, tree.ancestor_mask(), need_aux=drafter.reads_aux)
        verdict = verify(tree, out.logits, config.temperature, generator)
        num_kept = verdict.num_accepted + 1  # root + accepted draft tokens
        cache.keep(verdict.path_nodes.clamp(min=0), num_kept)
        features = drafter.target_features(out.aux_hidden, out.last_hidden)
        inputs = _next_draft_inputs(tree.token_ids, features, verdict)
        if kind == FULL:
            session.advance(inputs)
            plan.observe(tree, verdict)
        else:  # the neural drafter stays idle; it reads these pairs when it next drafts
            session.defer(inputs)
            if kind == LIGHT:
                light_plan.observe(tree, verdict)
        roots = verdict.bonus_ids
        for row, token_ids in enumerate(verdict.accepted_ids(tree)):
            tracker.add(row, token_ids, tree.num_nodes)
        if chooser is not None:
            chooser.record(kind, int(num_kept.sum()), time.perf_counter() - start)
    return tracker.results


def make_shape(tree: TreeShape | str, target: Target, drafter: Proposer, batch: int = 1,
               costs: StepCosts | None = None, stats: AcceptanceStats | None = None) -> ShapePlan:
    """The plan a resolved tree option (`mmvsd.tree_options`) grows trees with: a fixed shape as given, or for
    "auto" the cost-aware plan on `costs` (this machine's cached profile at batch size `batch` when None),
    learning acceptance into `stats` (fresh when None)."""
    if isinstance(tree, TreeShape):
        return tree
    if tree != "auto":
        raise UserError(f"tree must be a TreeShape or 'auto', got {tree!r}")
    if costs is None:
        costs = load_cost_table(target, drafter, batch_sizes=(batch,))
    return AutoShape(costs, stats if stats is not None else AcceptanceStats())


def _next_draft_inputs(tree_ids: Tensor, tree_features: Tensor, verdict) -> DraftInputs:
    """Pairs for the drafter: target features at root..last accepted, each with the next token."""
    num_new = verdict.num_accepted + 1  # [B]
    width = int(num_new.max())
    nodes = verdict.path_nodes[:, :width].clamp(min=0)  # [B, A]
    features = tree_features.gather(1, nodes[:, :, None].expand(-1, -1, tree_features.shape[-1]))
    following = torch.cat([tree_ids.gather(1, nodes)[:, 1:], verdict.bonus_ids[:, None]], dim=1)
    rows = torch.arange(nodes.shape[0], device=nodes.device)
    following[rows, num_new - 1] = verdict.bonus_ids  # the bonus follows the last accepted node
    return DraftInputs(features, following, num_new)


def generate_each(target: Target, drafter: Proposer | None, prompts: list[PromptLike],
                  config: DecodeConfig) -> list[SequenceResult]:
    """Each prompt decoded alone, prompt i with seed `config.seed + i` (vanilla without a drafter): at T > 0 the
    rows of one call share the call's seed (per-request seeds), so their samples would be correlated."""
    results = []
    for i, prompt in enumerate(prompts):
        alone = replace(config, seed=config.seed + i)
        results += (vanilla_generate(target, [prompt], alone) if drafter is None
                    else speculative_generate(target, drafter, [prompt], alone))
    return results
