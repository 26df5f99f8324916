"""`--tree auto`: the shape chooser against brute force, acceptance learning, the speed guard, and
lossless decoding in every mode it can take (auto, plain and n-gram-only steps, probing again)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from conftest import PROMPT_POOL
from mmvsd.decoding import shape_policy
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.shape_policy import (
    FULL,
    LIGHT,
    PLAIN,
    AcceptanceStats,
    AutoShape,
    SpeedGuard,
    StepChooser,
    StepCosts,
    best_num_nodes,
    )
from mmvsd.decoding.tree import DraftTree, TreeShape
from mmvsd.drafter_base import DraftInputs
from mmvsd.drafters.hybrid import with_ngram
from mmvsd.errors import UserError


class LinearCosts:
    """A synthetic cost table: target step = base + per_token * (n - 1) (+ a knee), drafter linear in width."""

    def __init__(self, base=0.030, per_token=0.004, knee=8, after_knee=0.010, expand=0.003, per_width=0.0005,
                 fixed=0.002):
        self.base, self.per_token, self.knee, self.after_knee = base, per_token, knee, after_knee
        self.expand, self.per_width, self.fixed = expand, per_width, fixed

    def target_step(self, num_nodes: int, batch: int = 1) -> float:
        extra = self.per_token * (min(num_nodes, self.knee) - 1) + self.after_knee * max(num_nodes - self.knee, 0)
        return batch * 0.2 * self.base + 0.8 * self.base + extra * batch

    def draft_expand(self, width: int, batch: int = 1) -> float:
        return self.expand + self.per_width * width * batch

    def draft_fixed(self, batch: int = 1) -> float:
        return self.fixed


def brute_force_num_nodes(path_probs, costs, draft_seconds, max_nodes):
    best = None
    for n in range(0, min(max_nodes, path_probs.shape[1]) + 1):
        tokens = sum(1.0 + float(row[:n].sum()) for row in path_probs)
        rate = tokens / (costs.target_step(n + 1, path_probs.shape[0]) + draft_seconds)
        if best is None or rate > best[1] + 1e-12:
            best = (n, rate)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("batch", [1, 3])
def test_best_num_nodes_equals_brute_force(seed, batch):
    gen = torch.Generator().manual_seed(seed)
    # path probabilities in keep order: non-increasing within a row, as the builder's order gives
    probs = torch.sort(torch.rand(batch, 30, generator=gen) ** (1 + seed), dim=1, descending=True).values
    costs = LinearCosts(per_token=0.002 * (seed + 1), knee=4 + seed)
    n, rate = best_num_nodes(probs, costs, draft_seconds=0.004, max_nodes=25)
    bn, brate = brute_force_num_nodes(probs, costs, 0.004, 25)
    assert n == bn and math.isclose(rate, brate, rel_tol=1e-5)


def all_trees(max_nodes):
    """Every rooted ordered tree with <= max_nodes non-root nodes, as (depth, rank-path) node lists."""
    trees = {()}
    frontier = {()}
    for _ in range(max_nodes):
        grown = set()
        for tree in frontier:
            nodes = set(tree) | {()}
            for node in nodes:
                siblings = [n for n in tree if len(n) == len(node) + 1 and n[:-1] == node]
                candidate = tuple(sorted(tree + (node + (len(siblings),),)))
                grown.add(candidate)
        trees |= grown
        frontier = grown
    return trees


def tree_rate(tree, accept_by_rank, costs, batch=1):
    rank_rate = [float(r) for r in accept_by_rank] + [0.0] * 8  # ranks past the model: never accepted
    tokens = 1.0 + sum(math.prod(rank_rate[r] for r in node) for node in tree)
    parents_by_depth = {}
    for node in tree:
        parents_by_depth.setdefault(len(node), set()).add(node[:-1])
    draft = costs.draft_fixed(batch) + sum(costs.draft_expand(len(p), batch)
                                           for d, p in parents_by_depth.items() if d > 1)
    if not tree:
        return batch / costs.target_step(1, batch)
    return batch * tokens / (costs.target_step(len(tree) + 1, batch) + draft)


@pytest.mark.parametrize("rates", [(0.8, 0.1, 0.05), (0.5, 0.3, 0.1), (0.95, 0.02, 0.01), (0.05, 0.01, 0.0)])
@pytest.mark.parametrize("per_token", [0.0005, 0.004, 0.02])
def test_best_static_tree_equals_brute_force(rates, per_token):
    accept = torch.tensor(rates)
    costs = LinearCosts(per_token=per_token, knee=100, expand=0.002, per_width=0.0)
    parents, rate = best_static_tree(accept, costs, max_nodes=6)
    brute = max(tree_rate(t, accept, costs) for t in all_trees(6))
    assert math.isclose(rate, brute, rel_tol=1e-6)
    assert len(parents) <= 6


def test_stats_learn_acceptance_from_verified_trees():
    stats = AcceptanceStats(prior_weight=1.0)
    # chain root -> 1 -> 2 and a sibling 3 of node 1; drafter said 0.9, 0.9 for the chain, 0.05 for 3
    parents = torch.tensor([[-1, 0, 1, 0]])
    depths = torch.tensor([[0, 1, 2, 1]])
    cond = torch.tensor([[0.0, math.log(0.9), math.log(0.9), math.log(0.05)]])
    for _ in range(50):
        stats.update(cond, parents, depths, torch.tensor([[0, 1, -1]]))  # node 1 accepted, node 2 rejected
    c = stats.calibrated(torch.tensor([math.log(0.9), math.log(0.05)]))
    assert 0.45 < float(c[0]) < 0.55  # 50 accepted of 100 tried at p = 0.9 (nodes 1 and 2), prior 1
    assert float(c[1]) < 0.05  # tried 50 times, never accepted
    by_rank = stats.by_rank()
    assert 0.45 < float(by_rank[0]) < 0.55 and float(by_rank[1]) == 0.0


def test_auto_shape_skips_a_useless_drafter_and_grows_for_a_good_one():
    costs = LinearCosts()
    useless = AcceptanceStats(prior_weight=1.0)
    zeros = torch.zeros(1, 4)
    for _ in range(200):  # drafter sure of itself, target never agrees
        useless.update(torch.cat([zeros[:, :1], torch.full((1, 3), -0.01)], 1), torch.tensor([[-1, 0, 0, 0]]),
                       torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0, -1]]))
    plan = AutoShape(costs, useless, topk=3)
    confident = torch.full((1, 3), -0.01)
    assert not plan.start(confident, confident, batch=1) and plan.num_nodes() == 0
    good = AcceptanceStats(prior_weight=1.0)
    for _ in range(200):
        good.update(torch.tensor([[0.0, -0.01, -0.01]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]),
                    torch.tensor([[0, 1, 2]]))
    plan = AutoShape(costs, good, topk=3)
    assert plan.start(confident, confident, batch=1)
    assert plan.grow(torch.tensor([[0, 0, 0]]), confident, confident - 0.01, torch.tensor([[3, 4, 5]]))
    assert plan.num_nodes() >= 2


def test_speed_guard_falls_back_and_probes_again():
    guard = SpeedGuard(probe_steps=4, backoff=5)
    for _ in range(4):  # the cheap kind is measured first
        assert guard.cheap_step()
        guard.record(True, 1, 0.01)  # 100 tokens/s
    for _ in range(4):
        assert not guard.cheap_step()
        guard.record(False, 1, 0.02)  # 50 tokens/s < 100
    assert guard.cheap_step()
    for _ in range(5):
        assert guard.cheap_step()
        guard.record(True, 1, 0.01)
    assert not guard.cheap_step()  # probing again
    for _ in range(4):
        guard.record(False, 4, 0.02)  # 200 tokens/s: speculation wins now
    assert not guard.cheap_step() and guard.backoff == 5


class FixedGuardCosts(LinearCosts):
    """Verification so costly that no tree pays: auto must decode by plain steps only."""

    def target_step(self, num_nodes: int, batch: int = 1) -> float:
        return 0.01 if num_nodes == 1 else 10.0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("costs", [LinearCosts(per_token=0.0005), FixedGuardCosts()], ids=["cheap", "costly"])
def test_auto_is_lossless(tiny_target, fitted_drafter, batch, costs):
    prompts = PROMPT_POOL[:1] if batch == 1 else PROMPT_POOL[2 : 2 + batch]
    config = DecodeConfig(max_new_tokens=40, tree="auto")
    spec = speculative_generate(tiny_target, fitted_drafter, prompts, config, costs=costs)
    for prompt, result in zip(prompts, spec):
        ref = vanilla_generate(tiny_target, [prompt], DecodeConfig(max_new_tokens=40))[0]
        assert result.output_ids == ref.output_ids
        assert len(result.tree_sizes) == result.num_target_forwards and result.tree_sizes[0] == 1  # prefill: 1
    if isinstance(costs, FixedGuardCosts):
        assert all(size == 1 for r in spec for size in r.tree_sizes)
    else:
        assert max(max(r.accept_lengths) for r in spec) >= 3  # real trees were drafted and accepted


@pytest.mark.parametrize("trees_win", [True, False])
def test_the_choice_of_step_kinds_carries_from_call_to_call(tiny_target, fitted_drafter, monkeypatch, trees_win):
    """A second answer decoded with the first's statistics goes on with the guards' measurements: it does not
    start over with probing plain steps (a 20-step answer paid a fifth of its steps for them). The guards'
    rates are made tokens per step (trees win) or their inverse (trees lose), not wall time."""
    def per_step(log):
        rate = sum(t for t, _ in log) / max(len(log), 1)
        return rate if trees_win else 1.0 / max(rate, 1e-9)

    monkeypatch.setattr(shape_policy, "_rate", per_step)
    stats = AcceptanceStats()
    config = DecodeConfig(max_new_tokens=40, tree="auto")
    costs = LinearCosts(per_token=0.0005)
    first = speculative_generate(tiny_target, fitted_drafter, PROMPT_POOL[:1], config, costs=costs, stats=stats)
    chooser = stats.chooser()
    guard = chooser.guards[PLAIN]
    assert stats.chooser() is chooser and guard.costly_log  # it measured trees (whether they won: wall time)
    plain_left = guard.cheap_left  # 0 where trees won, else the back-off still to serve
    assert (plain_left == 0) == trees_win
    second = speculative_generate(tiny_target, fitted_drafter, PROMPT_POOL[1:2], config, costs=costs, stats=stats)
    assert stats.chooser() is chooser
    assert first[0].tree_sizes[1:5] == [1, 1, 1, 1]  # the first answer opened with the guard's plain probes
    sizes = second[0].tree_sizes[1:]
    leading_plain = next((i for i, size in enumerate(sizes) if size > 1), len(sizes))
    assert leading_plain == min(plain_left, len(sizes))  # the second went on where the first left off
    reference = vanilla_generate(tiny_target, PROMPT_POOL[1:2], DecodeConfig(max_new_tokens=40))[0]
    assert second[0].output_ids == reference.output_ids


def test_guard_fallback_then_probe_is_lossless(tiny_target, fitted_drafter, monkeypatch):
    """Plain steps queue the drafter's pairs; when drafting resumes it must see them all (lossless,
    and still accepting drafts afterwards)."""
    pattern = itertools.cycle([True] * 5 + [False] * 3)
    monkeypatch.setattr(SpeedGuard, "cheap_step", lambda self: next(pattern))
    prompts = PROMPT_POOL[2:5]
    config = DecodeConfig(max_new_tokens=48, tree="auto")
    spec = speculative_generate(tiny_target, fitted_drafter, prompts, config, costs=LinearCosts(per_token=0.0005))
    for prompt, result in zip(prompts, spec):
        ref = vanilla_generate(tiny_target, [prompt], DecodeConfig(max_new_tokens=48))[0]
        assert result.output_ids == ref.output_ids
    assert max(max(r.accept_lengths) for r in spec) >= 3


def test_bad_tree_values():
    with pytest.raises(UserError):
        DecodeConfig(tree="big")
    with pytest.raises(ValueError):
        TreeShape.parse("60/7")
    assert TreeShape.parse("16/4/4") == TreeShape(16, 4, 4)


def test_observe_ignores_root_only_trees():
    plan = AutoShape(LinearCosts(), AcceptanceStats())
    root = torch.tensor([5])
    tree = DraftTree(root[:, None], torch.full((1, 1), -1), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1))
    plan.observe(tree, None)
    assert float(plan.stats.rank_tried.sum()) == 0


def test_speed_guard_reprobes_the_cheap_kind():
    guard = SpeedGuard(probe_steps=2, backoff=3, reprobe_every=5)
    for _ in range(2):
        assert guard.cheap_step()
        guard.record(True, 2, 0.01)  # cheap: 200 tokens/s
    for _ in range(2):
        assert not guard.cheap_step()
        guard.record(False, 6, 0.02)  # costly: 300 tokens/s wins
    for _ in range(3):
        assert not guard.cheap_step()
        guard.record(False, 6, 0.02)
    assert guard.cheap_step()  # 5 costly steps in a row: measure the cheap kind again
    for _ in range(2):
        guard.record(True, 9, 0.01)  # cheap now 900 tokens/s
    for _ in range(2):
        assert not guard.cheap_step()
        guard.record(False, 6, 0.02)
    assert guard.cheap_step() and guard.cheap_left == 3  # the costly kind lost: back off


def test_step_chooser_keeps_a_guard_per_situation():
    chooser = StepChooser()
    kinds = []
    for _ in range(8):  # 4 light steps are measured, then 4 full ones
        kinds.append(chooser.step_kind(light_ready=True))
        chooser.record(kinds[-1], 3 if kinds[-1] == LIGHT else 1, 0.01)  # light: 300 tokens/s, full: 100
    assert kinds == [LIGHT] * 4 + [FULL] * 4
    assert chooser.step_kind(light_ready=True) == LIGHT  # full lost: back to n-gram-only trees
    kinds = []
    for _ in range(8):  # the plain-vs-full guard saw none of the steps above: it measures both afresh
        kinds.append(chooser.step_kind(light_ready=False))
        chooser.record(kinds[-1], 2 if kinds[-1] == FULL else 1, 0.01)  # full: 200 tokens/s, plain: 100
    assert kinds == [PLAIN] * 4 + [FULL] * 4
    assert chooser.step_kind(light_ready=False) == FULL


def test_deferred_pairs_reach_the_drafter_as_if_fed_each_step(tiny_target, fitted_drafter):
    """Ragged pairs of several steps, deferred, then fed in one advance: same drafter state."""
    torch.manual_seed(0)
    width = 3 * tiny_target.hidden_size  # an EAGLE-3 drafter reads three target layers
    steps = []
    for num_new in ([3, 1], [1, 2], [2, 3]):
        num_new = torch.tensor(num_new)
        steps.append(DraftInputs(torch.randn(2, 3, width), torch.randint(0, 100, (2, 3)), num_new))
    eager, lazy = fitted_drafter.new_session(2), fitted_drafter.new_session(2)
    for inputs in steps:
        eager.advance(inputs)
    for inputs in steps[:-1]:
        lazy.defer(inputs)
    lazy.advance(steps[-1])
    torch.testing.assert_close(lazy.last_hidden, eager.last_hidden, atol=1e-4, rtol=1e-4)  # other GEMM shapes
    assert torch.equal(lazy.cache.lens, eager.cache.lens)
    ids_eager, lp_eager = eager.root_candidates(4)
    lazy2 = fitted_drafter.new_session(2)
    for inputs in steps:
        lazy2.defer(inputs)
    ids_lazy, lp_lazy = lazy2.root_candidates(4)  # drafting catches up on its own
    assert torch.equal(ids_lazy, ids_eager)
    torch.testing.assert_close(lp_lazy, lp_eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 4])
def test_auto_mixing_plain_light_and_full_steps_is_lossless(tiny_target, fitted_drafter, monkeypatch, batch):
    """A hybrid under `--tree auto` takes all three kinds of step in turn: the neural drafter must
    catch up on the pairs of plain and n-gram-only steps (lossless, and still accepting drafts)."""
    kinds = itertools.cycle([FULL, PLAIN, PLAIN, FULL])
    taken = []

    def step_kind(self, light_ready):  # every other step n-gram-only where the lookup finds something
        kind = LIGHT if light_ready and len(taken) % 2 else next(kinds)
        self.cheap = LIGHT if light_ready else PLAIN
        taken.append(kind)
        return kind

    monkeypatch.setattr(StepChooser, "step_kind", step_kind)
    prompts = PROMPT_POOL[:batch]
    config = DecodeConfig(max_new_tokens=48, tree="auto")
    spec = speculative_generate(tiny_target, with_ngram(fitted_drafter), prompts, config,
                                costs=LinearCosts(per_token=0.0005))
    for prompt, result in zip(prompts, spec):
        ref = vanilla_generate(tiny_target, [prompt], DecodeConfig(max_new_tokens=48))[0]
        assert result.output_ids == ref.output_ids
    assert all(taken.count(kind) >= 2 for kind in (PLAIN, LIGHT, FULL))
    assert max(max(r.accept_lengths) for r in spec) >= 3


def test_light_plan_keeps_its_own_statistics_and_carries_them():
    stats = AcceptanceStats()
    plan = AutoShape(LinearCosts(), stats)
    light = plan.without_drafter()
    assert light.stats is stats.light() and light.stats is not stats
    assert AutoShape(LinearCosts(), stats).without_drafter().stats is light.stats  # the next call learns on
    assert light.costs.draft_fixed() == 0.0 and light.costs.draft_expand(4) == 0.0
    assert light.costs.target_step(5) == plan.costs.target_step(5)


# the brute-force reference the shape policy is tested against (test-only code)


def best_static_tree(accept_by_rank: Tensor, costs: StepCosts, max_nodes: int,
                     batch: int = 1) -> tuple[list[int], float]:
    """The best fixed tree for a (rank -> acceptance) model: parents list (node i+1's parent, 0 = root)
    and its expected tokens per second (Sequoia's question, on measured costs).

    Under such a model a node's path probability is the product of its ancestors' rank acceptances,
    so for a depth limit D the best n-node tree is the n largest path probabilities of depth <= D
    (ancestor-closed: every factor is <= 1 and ranks are sorted). Each depth past the first costs one
    drafter expand; the search runs over D and n. Exact when an expand's cost does not depend on its
    width (otherwise widths are those of the chosen tree, a close approximation)."""
    rates = torch.sort(accept_by_rank.float().clamp(0, 1), descending=True).values.tolist()
    best_rate, best_parents = batch / costs.target_step(1, batch), []
    for depth_limit in range(1, max_nodes + 1):
        nodes = _best_first_nodes(rates, max_nodes, depth_limit)
        for n in range(1, len(nodes) + 1):
            rate = _static_rate(nodes[:n], costs, batch)
            if rate > best_rate:
                best_rate, best_parents = rate, [parent for _, parent, _, _ in nodes[:n]]
    return best_parents, best_rate


def _best_first_nodes(rates: list[float], max_nodes: int, depth_limit: int) -> list[tuple[float, int, int, int]]:
    """Nodes (path prob, parent node, rank, depth) in decreasing path probability, depth <= depth_limit."""
    nodes: list[tuple[float, int, int, int]] = []
    frontier = [(rates[0], 0, 0, 1)]
    while frontier and len(nodes) < max_nodes:
        frontier.sort(key=lambda node: -node[0])
        prob, parent, rank, depth = frontier.pop(0)
        nodes.append((prob, parent, rank, depth))
        if depth < depth_limit:
            frontier.append((prob * rates[0], len(nodes), 0, depth + 1))
        if rank + 1 < len(rates):
            sibling = prob / rates[rank] * rates[rank + 1] if rates[rank] > 0 else 0.0
            frontier.append((sibling, parent, rank + 1, depth))
    return nodes


def _static_rate(nodes: list[tuple[float, int, int, int]], costs: StepCosts, batch: int) -> float:
    """Expected tokens/s of a fixed tree given as (path prob, parent, rank, depth) per node."""
    tokens = 1.0 + sum(prob for prob, *_ in nodes)
    parents_by_depth: dict[int, set[int]] = {}
    for _, parent, _, depth in nodes:
        parents_by_depth.setdefault(depth, set()).add(parent)
    # depth 1 comes with the root's candidates; each deeper depth is one expand of its parents
    draft = costs.draft_fixed(batch) + sum(costs.draft_expand(len(p), batch)
                                           for d, p in parents_by_depth.items() if d > 1)
    return batch * tokens / (costs.target_step(len(nodes) + 1, batch) + draft)
