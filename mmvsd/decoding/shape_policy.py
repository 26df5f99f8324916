"""Draft shapes chosen from measured costs and acceptance statistics (`--tree auto`).

Glossary:
- a node's *acceptance* c is the probability that the target accepts it given that it accepts the
  node's parent; its *path probability* is the product of c from the root's child down to it;
- a verify step over a tree of n draft nodes commits 1 + (sum of the nodes' path probabilities)
  tokens in expectation (the bonus token always comes);
- a step costs `costs.target_step(n + 1, B)` (the root is verified too) plus the drafter's time:
  `costs.draft_fixed(B)` per step and `costs.draft_expand(K, B)` per expanded depth of width K.
The plan maximises expected committed tokens per second. Everything here is pure arithmetic on
tensors and the cost table, except `AcceptanceStats`, which learns c online from verify results.

Shape letters: B batch, C candidates, N tree nodes, D depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

# Draft probability bins of the calibration table (upper edges; the last bin ends at 1).
PROB_EDGES = (0.01, 0.03, 0.07, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.93, 0.98, 1.0)
MAX_RANK = 8  # sibling ranks >= this share one cell of the (depth, rank) table
MAX_STAT_DEPTH = 12


class StepCosts(Protocol):
    """What the planner reads of a `mmvsd.decoding.costs.CostTable`."""

    def target_step(self, num_nodes: int, batch: int = 1) -> float: ...

    def draft_expand(self, width: int, batch: int = 1) -> float: ...

    def draft_fixed(self, batch: int = 1) -> float: ...


class FreeDrafting:
    """`StepCosts` of the same target with a drafter that costs nothing (an n-gram lookup takes
    tens of microseconds against a target step of tens of milliseconds)."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs

    def target_step(self, num_nodes: int, batch: int = 1) -> float:
        return self.costs.target_step(num_nodes, batch)

    def draft_expand(self, width: int, batch: int = 1) -> float:
        return 0.0

    def draft_fixed(self, batch: int = 1) -> float:
        return 0.0


class AcceptanceStats:
    """Acceptance of draft nodes learnt online: by draft-probability bin (the calibration the
    per-step plan uses) and by (depth, sibling rank) (what a static shape is built from).

    A node counts as *tried* when its parent was accepted, and as *accepted* when it is on the
    accepted path. Prior: each probability bin starts at its own mid-point (the drafter is taken
    as calibrated) with `prior_weight` pseudo-observations, so the first steps follow the drafter's
    confidence and later ones what the target really accepted.
    """

    def __init__(self, prior_weight: float = 4.0) -> None:
        edges = torch.tensor((0.0,) + PROB_EDGES)
        mids = (edges[1:] + edges[:-1]) / 2
        self.edges = torch.tensor(PROB_EDGES)
        self.bin_tried = torch.full((len(PROB_EDGES),), prior_weight, dtype=torch.float64)
        self.bin_accepted = mids.double() * prior_weight
        self.rank_tried = torch.zeros(MAX_STAT_DEPTH, MAX_RANK, dtype=torch.float64)
        self.rank_accepted = torch.zeros(MAX_STAT_DEPTH, MAX_RANK, dtype=torch.float64)
        self.prior_weight = prior_weight
        self._light: AcceptanceStats | None = None
        self._chooser: StepChooser | None = None

    def light(self) -> AcceptanceStats:
        """The statistics of n-gram-only trees, kept beside these (a caller carrying these from call
        to call carries both): what n-gram-only trees accept is not what mixed trees accept."""
        if self._light is None:
            self._light = AcceptanceStats(self.prior_weight)
        return self._light

    def chooser(self) -> StepChooser:
        """The choice of step kinds, carried with these statistics: its guards' measured rates go on from
        one call to the next, so a short answer does not pay for probing the cheap kinds afresh."""
        if self._chooser is None:
            self._chooser = StepChooser()
        return self._chooser

    def calibrated(self, cond_logprobs: Tensor) -> Tensor:
        """Estimated acceptance c (same shape) of nodes with these conditional draft log-probs."""
        rate = (self.bin_accepted / self.bin_tried).to(torch.float32)
        return rate[self._bins(cond_logprobs)]

    def _bins(self, cond_logprobs: Tensor) -> Tensor:
        probs = cond_logprobs.float().exp().clamp(0.0, 1.0).cpu()
        return torch.bucketize(probs, self.edges).clamp(max=len(PROB_EDGES) - 1)

    def update(self, cond_logprobs: Tensor, parents: Tensor, depths: Tensor, path_nodes: Tensor) -> None:
        """Count one verified tree per row: cond_logprobs, parents, depths [B, N]; path_nodes [B, D+1]."""
        cond_logprobs, parents, depths, path_nodes = (t.cpu() for t in (cond_logprobs, parents, depths, path_nodes))
        batch, num_nodes = parents.shape
        on_path = torch.zeros(batch, num_nodes + 1, dtype=torch.bool)
        on_path.scatter_(1, path_nodes.clamp(min=-1) + 1, True)  # index 0 collects the -1 padding
        on_path = on_path[:, 1:]
        tried = on_path.gather(1, parents.clamp(min=0)) & (parents >= 0)  # parent accepted
        accepted = on_path & tried
        bins = self._bins(cond_logprobs)
        self.bin_tried.index_add_(0, bins[tried], torch.ones(int(tried.sum()), dtype=torch.float64))
        self.bin_accepted.index_add_(0, bins[accepted], torch.ones(int(accepted.sum()), dtype=torch.float64))
        ranks = sibling_ranks(parents, cond_logprobs).clamp(max=MAX_RANK - 1)
        cells = (depths - 1).clamp(0, MAX_STAT_DEPTH - 1) * MAX_RANK + ranks
        self.rank_tried.view(-1).index_add_(0, cells[tried], torch.ones(int(tried.sum()), dtype=torch.float64))
        self.rank_accepted.view(-1).index_add_(
            0, cells[accepted], torch.ones(int(accepted.sum()), dtype=torch.float64))

    def by_rank(self, prior: float = 0.0) -> Tensor:
        """[MAX_RANK] acceptance of the r-th best child over all depths (`prior` where never tried)."""
        tried, accepted = self.rank_tried.sum(0), self.rank_accepted.sum(0)
        rates = torch.where(tried > 0, accepted / tried.clamp(min=1), torch.full_like(tried, prior))
        return rates.to(torch.float32)


def sibling_ranks(parents: Tensor, scores: Tensor) -> Tensor:
    """[B, N] rank of each node among its siblings by score (0 = best; the root gets 0)."""
    same_parent = parents[:, :, None] == parents[:, None, :]  # [B, N, N]
    better = scores[:, None, :] > scores[:, :, None]
    earlier_tie = (scores[:, None, :] == scores[:, :, None]) & (
        torch.arange(parents.shape[1])[None, :] < torch.arange(parents.shape[1])[:, None])
    return (same_parent & (better | earlier_tie)).sum(-1)


def best_num_nodes(path_probs: Tensor, costs: StepCosts, draft_seconds: float, max_nodes: int) -> tuple[int, float]:
    """How many of the candidates to verify: (n, expected tokens/s), n in [0, max_nodes].

    path_probs [B, C]: candidates' path probabilities in the order they would be kept (the tree
    builder's score order, closed under ancestors); row b keeps its first n. n = 0 is a plain step.
    """
    batch, num_cands = path_probs.shape
    limit = min(max_nodes, num_cands)
    gains = torch.cat([torch.zeros(batch, 1), path_probs[:, :limit].float().cpu().cumsum(1)], dim=1)  # [B, n+1]
    tokens = (1.0 + gains).sum(0)  # [n+1] expected tokens of the batch
    seconds = torch.tensor([costs.target_step(n + 1, batch) for n in range(limit + 1)]) + draft_seconds
    rates = tokens / seconds
    best = int(rates.argmax())
    return best, float(rates[best])


@dataclass
class PlanState:
    """One round's candidates as the tree builder grows them (path probabilities, cost so far)."""

    path_probs: Tensor  # [B, C] path probability of every candidate so far
    scores: Tensor  # [B, C] the builder's ranking scores (cumulative draft log-probs)
    draft_seconds: float  # drafter time spent this step so far


class AutoShape:
    """`--tree auto`: grow each step's tree while the next depth is expected to pay, then keep the
    number of nodes that maximises expected tokens per second (EAGLE-2's confidence-based expansion
    with Sequoia's hardware-aware sizing, on measured costs)."""

    def __init__(self, costs: StepCosts, stats: AcceptanceStats, topk: int = 8, depth: int = 10,
                 budget: int = 64) -> None:
        self.costs, self.stats = costs, stats
        self.topk, self.depth, self.budget = topk, depth, budget
        self.state: PlanState | None = None

    def start(self, cond_logprobs: Tensor, scores: Tensor, batch: int) -> bool:
        """Root candidates ([B, K]) are known: whether expanding them is expected to pay."""
        probs = self.stats.calibrated(cond_logprobs)
        self.state = PlanState(probs, scores.float().cpu(), self.costs.draft_fixed(batch))
        return self._worth_another_depth(probs, self.state.scores, batch)

    def grow(self, parent_index: Tensor, cond_logprobs: Tensor, scores: Tensor, frontier: Tensor) -> bool:
        """A depth was added: parent_index [B, C'] (candidate index of each new candidate's parent),
        cond_logprobs / scores [B, C']; frontier [B, K'] indices of the candidates to expand next.
        Returns whether expanding that frontier is expected to pay."""
        state = self.state
        batch, width = parent_index.shape[0], frontier.shape[1]
        parent_probs = state.path_probs.gather(1, parent_index.cpu())
        new_probs = parent_probs * self.stats.calibrated(cond_logprobs)
        state.path_probs = torch.cat([state.path_probs, new_probs], 1)
        state.scores = torch.cat([state.scores, scores.float().cpu()], 1)
        state.draft_seconds += self.costs.draft_expand(width, batch)
        frontier = frontier.cpu()
        return self._worth_another_depth(state.path_probs.gather(1, frontier), state.scores.gather(1, frontier), batch)

    def _worth_another_depth(self, frontier_probs: Tensor, frontier_scores: Tensor, batch: int) -> bool:
        """Compare the best rate now with an optimistic rate after one more depth: every frontier node
        gets one child the drafter is sure of (ranked right after its parent)."""
        state = self.state
        now = best_num_nodes(self._ordered(state.path_probs, state.scores), self.costs, state.draft_seconds,
                             self.budget - 1)[1]
        best_child = float(self.stats.calibrated(torch.zeros(1))[0])  # a child the drafter is sure of
        hopeful = frontier_probs * best_child
        probs = torch.cat([state.path_probs, hopeful], 1)
        scores = torch.cat([state.scores, frontier_scores - 1e-6], 1)
        spend = state.draft_seconds + self.costs.draft_expand(frontier_probs.shape[1], batch)
        later = best_num_nodes(self._ordered(probs, scores), self.costs, spend, self.budget - 1)[1]
        return later > now

    @staticmethod
    def _ordered(path_probs: Tensor, scores: Tensor) -> Tensor:
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        return path_probs.gather(1, order)

    def num_nodes(self) -> int:
        """Draft nodes to keep (root excluded) for the candidates grown this step."""
        state = self.state
        nodes, _ = best_num_nodes(self._ordered(state.path_probs, state.scores), self.costs, state.draft_seconds,
                                  self.budget - 1)
        return nodes

    def without_drafter(self) -> AutoShape:
        """The same plan for trees that cost no drafter time (n-gram-only trees), on their own statistics."""
        return AutoShape(FreeDrafting(self.costs), self.stats.light(), self.topk, self.depth, self.budget)

    def observe(self, tree, verdict) -> None:
        """Learn acceptance from a verified tree (mmvsd.decoding.tree.DraftTree, mmvsd.decoding.verify.Verdict)."""
        if tree.num_nodes < 2:
            return
        parent_scores = tree.draft_logprobs.gather(1, tree.parents.clamp(min=0))
        cond_logprobs = tree.draft_logprobs - parent_scores  # each node's own draft log-prob
        self.stats.update(cond_logprobs, tree.parents, tree.depths, verdict.path_nodes)


class SpeedGuard:
    """Never slower than the cheaper of two kinds of step: compares the measured tokens/s of the
    costly kind (a tree from the whole drafter) with that of the cheap kind (a plain step, or an
    n-gram-only tree); while the costly kind loses, takes cheap steps for a back-off period
    (doubling each time a probe loses again, reset when one wins), then probes again.

    The cheap kind is measured first, on this text: a cost profile's plain step is timed at another
    context length without sampling, and an n-gram-only tree's rate depends on the text.
    `reprobe_every`: after that many costly steps in a row, measure the cheap kind again (0: never),
    for cheap kinds whose rate changes as the text goes on (n-gram matches).
    """

    def __init__(self, probe_steps: int = 4, window: int = 8, backoff: int = 16, max_backoff: int = 512,
                 margin: float = 0.02, reprobe_every: int = 0) -> None:
        self.probe_steps, self.window, self.margin = probe_steps, window, margin
        self.first_backoff, self.backoff, self.max_backoff = backoff, backoff, max_backoff
        self.reprobe_every = reprobe_every
        self.cheap_log: list[tuple[int, float]] = []  # (tokens, seconds)
        self.costly_log: list[tuple[int, float]] = []
        self.cheap_left = probe_steps  # cheap steps still to take before the next probe of the costly kind
        self.costly_run = 0  # costly steps since the last cheap one

    def cheap_step(self) -> bool:
        """Whether the next step should be a cheap one."""
        return self.cheap_left > 0

    def record(self, cheap: bool, tokens: int, seconds: float) -> None:
        """Account one step: committed tokens of the batch and its wall time."""
        log = self.cheap_log if cheap else self.costly_log
        log.append((tokens, seconds))
        del log[: -self.window]
        if cheap:
            self.costly_run = 0
            self.cheap_left -= 1
            if self.cheap_left == 0:
                self.costly_log.clear()  # the next probe is judged on fresh steps
            return
        self.costly_run += 1
        if len(self.costly_log) < self.probe_steps:
            return
        if _rate(self.costly_log) < _rate(self.cheap_log) * (1 - self.margin):
            self.cheap_left = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
        else:
            self.backoff = self.first_backoff
            if self.reprobe_every and self.costly_run >= self.reprobe_every:
                self.cheap_left = self.probe_steps


PLAIN, LIGHT, FULL = "plain", "light", "full"  # the kinds of step (`StepChooser`)


class StepChooser:
    """`--tree auto`'s choice of step: `full` (the whole drafter: a neural drafter, with its n-gram
    branches in a hybrid), `light` (a tree of the n-gram branches alone: no drafter time) or `plain`
    (no tree). Where n-gram proposals exist the choice is light vs full, else plain vs full; each
    choice is a `SpeedGuard` on the rates measured in its own situation."""

    def __init__(self) -> None:
        self.guards = {PLAIN: SpeedGuard(), LIGHT: SpeedGuard(reprobe_every=64)}
        self.cheap = PLAIN

    def step_kind(self, light_ready: bool) -> str:
        """The next step's kind; `light_ready`: an n-gram-only tree would have proposals."""
        self.cheap = LIGHT if light_ready else PLAIN
        return self.cheap if self.guards[self.cheap].cheap_step() else FULL

    def record(self, kind: str, tokens: int, seconds: float) -> None:
        """Account the step `step_kind` chose: committed tokens of the batch and its wall time."""
        self.guards[self.cheap].record(kind != FULL, tokens, seconds)


def _rate(log: list[tuple[int, float]]) -> float:
    """Tokens per second over a log of (tokens, seconds) steps (0 for an empty log)."""
    return sum(t for t, _ in log) / max(sum(s for _, s in log), 1e-12)
