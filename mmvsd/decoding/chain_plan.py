"""Draft chains for engines that verify chains (llama.cpp): how many tokens to draft at most (n_max) and below
which draft probability to stop (p_min), chosen from measured step costs and the drafter's recorded chains.

Glossary:
- a *chain sample* is the drafter's argmax chain at one position of a held-out greedy continuation: each drafted
  token's own draft probability, and how many leading tokens the target accepted (`ChainRecorder` records them
  from mmvsd's exact T = 0 replay, `mmvsd.eval.acceptance.evaluate_acceptance`);
- under (n_max, p_min) a step drafts the leading tokens whose probability is >= p_min, at most n_max, as
  llama.cpp's drafting loop does: a forward of the drafter per drafted token, plus the one whose token stopped
  the chain (none after the n_max-th); it keeps the accepted ones and the target's bonus token;
- a step costs `verify_seconds[k - 1]` for k = 1 + drafted tokens verified, plus `draft_seconds` per drafter
  forward. The plan maximises expected tokens per second (total tokens / total seconds over the samples), and
  says when no chain beats plain decoding.
Pure arithmetic, apart from the recorder. Approximations: samples are taken where the recording's chains
started (every accepted prefix + 1), the drafter's forward cost does not grow with the tokens it re-reads, and
llama.cpp's draft probabilities are renormalised over its top 10 (slightly above the full-vocabulary ones here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

P_MIN_GRID = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class ChainSample:
    """The drafter's argmax chain at one position: its tokens' draft probabilities, and how many the target took."""

    draft_probs: tuple[float, ...]
    accepted: int


@dataclass(frozen=True)
class ChainCosts:
    """Measured seconds: a target step verifying k tokens (`verify_seconds[k - 1]`; k = 1 is plain decoding),
    and one forward of the drafter."""

    verify_seconds: tuple[float, ...]
    draft_seconds: float

    def verify(self, num_tokens: int) -> float:
        """A step verifying `num_tokens` tokens; beyond the measured sizes, the last measured slope continues."""
        known = self.verify_seconds
        if num_tokens <= len(known):
            return known[num_tokens - 1]
        slope = known[-1] - known[-2] if len(known) > 1 else known[-1]
        return known[-1] + slope * (num_tokens - len(known))


@dataclass(frozen=True)
class ChainPlan:
    """The chosen (n_max, p_min), its expected tokens per second, and plain decoding's."""

    n_max: int
    p_min: float
    rate: float
    plain_rate: float
    table: dict[tuple[int, float], float] = field(default_factory=dict, compare=False)  # every setting's rate

    @property
    def speedup(self) -> float:
        return self.rate / self.plain_rate

    def chain(self) -> str:
        """The plan as `N/PMIN` (the bench's --chain setting)."""
        return f"{self.n_max}/{self.p_min:g}"


def step_outcome(sample: ChainSample, n_max: int, p_min: float) -> tuple[int, int, int]:
    """(drafted tokens, accepted tokens, drafter forwards) of one step under (n_max, p_min)."""
    drafted = 0
    for prob in sample.draft_probs[:n_max]:
        if prob < p_min:
            break
        drafted += 1
    forwards = drafted if drafted == n_max else drafted + 1
    return drafted, min(sample.accepted, drafted), forwards


def expected_rate(samples: Sequence[ChainSample], costs: ChainCosts, n_max: int, p_min: float) -> float:
    """Expected tokens per second under (n_max, p_min): total tokens / total seconds over the samples."""
    tokens = seconds = 0.0
    for sample in samples:
        drafted, accepted, forwards = step_outcome(sample, n_max, p_min)
        tokens += 1 + accepted
        seconds += costs.verify(1 + drafted) + forwards * costs.draft_seconds
    return tokens / seconds


def plan_chain(samples: Sequence[ChainSample], costs: ChainCosts, max_n: int | None = None,
               p_values: Sequence[float] = P_MIN_GRID) -> ChainPlan:
    """The fastest (n_max, p_min) over n_max in 1..max_n (default: the recorded chains' length) and `p_values`."""
    if not samples:
        raise ValueError("no chain samples to plan from")
    max_n = max_n or max(len(s.draft_probs) for s in samples)
    table = {(n, p): expected_rate(samples, costs, n, p) for n in range(1, max_n + 1) for p in p_values}
    (n_max, p_min), rate = max(table.items(), key=lambda item: (item[1], -item[0][0], item[0][1]))
    return ChainPlan(n_max, p_min, rate, 1.0 / costs.verify(1), table)


class ChainRecorder:
    """A `ShapePlan` that drafts the argmax chain of `depth` tokens and records a `ChainSample` per row and step."""

    topk = 1

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.samples: list[ChainSample] = []

    def start(self, cond_logprobs: Tensor, scores: Tensor, batch: int) -> bool:
        return True

    def grow(self, parent_index: Tensor, cond_logprobs: Tensor, scores: Tensor, frontier: Tensor) -> bool:
        return True

    def num_nodes(self) -> int:
        return self.depth

    def observe(self, tree, verdict) -> None:
        """Record each row's chain: draft probabilities by depth (from the cumulative log-probs) and acceptance."""
        order = tree.depths.argsort(dim=1)  # root first, then depth 1, 2, ...
        cumulative = tree.draft_logprobs.gather(1, order).double()
        own = (cumulative[:, 1:] - cumulative[:, :-1]).exp()  # [B, N-1] each token's own draft probability
        for row in range(own.shape[0]):
            self.samples.append(ChainSample(tuple(own[row].tolist()), int(verdict.num_accepted[row])))
