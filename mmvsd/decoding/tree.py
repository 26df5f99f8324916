"""Draft trees: the `DraftTree` value object and the EAGLE-2 dynamic tree builder.

Nodes are stored in topological order (a parent always comes before its children); node 0 is the
root, i.e. the last committed token, which the target has not yet seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class TreeShape:
    """How big a draft tree may grow: total nodes (root included), max depth, children per node. The defaults
    are the paper's text tree (`mmvsd.tree_options.TEXT_TREE`); commands resolve their tree options there."""

    budget: int = 60
    depth: int = 7
    topk: int = 10

    def __post_init__(self) -> None:
        if self.budget < 1 or self.depth < 0 or self.topk < 1:
            raise ValueError(f"invalid tree shape {self}: need budget >= 1, depth >= 0, topk >= 1")

    # A fixed shape as a `ShapePlan`: always grow to `depth`, keep `budget - 1` nodes.
    def start(self, cond_logprobs: Tensor, scores: Tensor, batch: int) -> bool:
        return self.budget > 1

    def grow(self, parent_index: Tensor, cond_logprobs: Tensor, scores: Tensor, frontier: Tensor) -> bool:
        return True

    def num_nodes(self) -> int:
        return self.budget - 1

    def observe(self, tree: DraftTree, verdict) -> None:
        """A fixed shape learns nothing from verify results."""

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """`BUDGET/DEPTH/TOPK`, e.g. "60/7/10" (ValueError with the reason otherwise)."""
        parts = text.split("/")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"tree shape {text!r} is not BUDGET/DEPTH/TOPK (e.g. 60/7/10) or 'auto'")
        return cls(*(int(p) for p in parts))


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees with the same number of nodes N each."""

    token_ids: Tensor  # [B, N] long, target-vocabulary ids; column 0 is the root
    parents: Tensor  # [B, N] long, parent node index, -1 for the root
    depths: Tensor  # [B, N] long, 0 for the root
    draft_logprobs: Tensor  # [B, N] float, cumulative draft log-prob of the root-to-node path

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    @property
    def max_depth(self) -> int:
        return int(self.depths.max().item()) if self.token_ids.numel() else 0

    def ancestor_mask(self) -> Tensor:
        """[B, N, N] bool: entry [b, i, j] is True iff node j is node i or one of its ancestors."""
        return self._ancestors

    @cached_property
    def _ancestors(self) -> Tensor:
        """Computed once per tree: decoding, verification and path lookup all read it."""
        batch, num_nodes = self.parents.shape
        eye = torch.eye(num_nodes, dtype=torch.bool, device=self.parents.device)
        mask = eye.expand(batch, num_nodes, num_nodes).clone()
        rows = torch.arange(batch, device=self.parents.device)[:, None].expand(batch, num_nodes)
        cols = torch.arange(num_nodes, device=self.parents.device)[None].expand(batch, num_nodes)
        ancestor = self.parents.clone()  # [B, N] current ancestor at distance d, -1 when past root
        for _ in range(self.max_depth):
            valid = ancestor >= 0
            mask[rows[valid], cols[valid], ancestor[valid]] = True
            ancestor = torch.where(valid, self.parents.gather(1, ancestor.clamp(min=0)), ancestor)
        return mask

    def path_to(self, nodes: Tensor) -> Tensor:
        """[B, D+1] node indices from the root to `nodes` ([B]), padded with -1 after the node."""
        batch = self.parents.shape[0]
        ancestors = self.ancestor_mask()[torch.arange(batch), nodes]  # [B, N]
        paths = torch.full((batch, self.max_depth + 1), -1, dtype=torch.long, device=nodes.device)
        b_idx, node_idx = ancestors.nonzero(as_tuple=True)
        paths[b_idx, self.depths[b_idx, node_idx]] = node_idx
        return paths

    def leaves(self) -> Tensor:
        """[B, N] bool: True for nodes that are nobody's parent."""
        batch, num_nodes = self.parents.shape
        is_parent = torch.zeros(batch, num_nodes + 1, dtype=torch.bool, device=self.parents.device)
        is_parent.scatter_(1, self.parents + 1, True)  # index 0 collects the root's "-1 parent"
        return ~is_parent[:, 1:]


class TreeExpander(Protocol):
    """What the tree builder needs from a drafter's decoding session."""

    def root_candidates(self, topk: int) -> tuple[Tensor, Tensor]:
        """Top-k children of the root: (target ids [B, K], draft log-probs [B, K])."""

    def expand(
        self, token_ids: Tensor, parent_slots: Tensor, block_mask: Tensor, topk: int
    ) -> tuple[Tensor, Tensor]:
        """Feed frontier nodes, return their top-k children: (ids [B, K, k], log-probs [B, K, k]).

        token_ids [B, K]: frontier tokens; parent_slots [B, K]: index of each node's parent in the
        previous `expand` call's frontier (0 for children of the root); block_mask [B, K, M]:
        which of the M tree entries fed so far this round (these K last) each node attends to.
        Log-probs of -inf mark absent children (a proposer with fewer than k proposals).
        """

    def end_round(self) -> None:
        """Forget every tree entry fed since the last commit."""


class ShapePlan(Protocol):
    """How far the builder grows a tree this step: a fixed `TreeShape` or `shape_policy.AutoShape`."""

    topk: int  # children per expanded node, and frontier width
    depth: int  # maximum depth

    def start(self, cond_logprobs: Tensor, scores: Tensor, batch: int) -> bool:
        """The root's candidates ([B, K]) are known: whether to expand them (`num_nodes` still
        decides how many candidates the tree keeps, 0 for a plain step)."""

    def grow(self, parent_index: Tensor, cond_logprobs: Tensor, scores: Tensor, frontier: Tensor) -> bool:
        """A depth of candidates was added ([B, C'] each; parent_index: candidate index of each one's
        parent); frontier [B, K]: the candidates that would be expanded next. Whether to expand them."""

    def num_nodes(self) -> int:
        """How many candidates (root excluded) the tree keeps."""

    def observe(self, tree: DraftTree, verdict) -> None:
        """What the target accepted of the last tree (verify.Verdict): plans that learn, learn here."""


def build_dynamic_tree(root_ids: Tensor, expander: TreeExpander, shape: ShapePlan) -> DraftTree:
    """EAGLE-2 dynamic tree: per-depth top-k expansion by cumulative log-prob, global rerank.

    root_ids [B]. Candidates at depth 1 are the root's top-k children; at each further depth the
    K best frontier nodes are expanded by their top-k children and the best K of the K*k become
    the next frontier, for as long as `shape` says growing pays (up to `shape.depth`). Finally the
    best `shape.num_nodes()` candidates are kept; a stable sort on scores that never increase along
    a path keeps the kept set closed under ancestors.
    """
    batch = root_ids.shape[0]
    device = root_ids.device
    if shape.depth == 0:
        return root_only_tree(root_ids)
    ids, scores = expander.root_candidates(shape.topk)  # [B, K]
    grow = shape.start(scores, scores, batch)
    width = ids.shape[1]
    cand_ids, cand_scores = [ids], [scores]
    cand_parents = [torch.full_like(ids, -1)]  # -1: parent is the root
    cand_depths = [torch.ones_like(ids)]
    frontier_global = torch.arange(width, device=device).expand(batch, width)
    frontier_ids, frontier_scores = ids, scores
    parent_slots = torch.zeros_like(ids)
    block_mask = torch.eye(width, dtype=torch.bool, device=device).expand(batch, width, width)
    num_cands = width
    for _ in range(shape.depth - 1):
        if not grow:
            break
        child_ids, child_logprobs = expander.expand(frontier_ids, parent_slots, block_mask, shape.topk)
        k_child = child_ids.shape[2]
        child_scores = (frontier_scores[:, :, None] + child_logprobs).flatten(1)  # [B, K*k]
        child_parents = frontier_global[:, :, None].expand(-1, -1, k_child).flatten(1)
        cand_ids.append(child_ids.flatten(1))
        cand_scores.append(child_scores)
        cand_parents.append(child_parents)
        cand_depths.append(torch.full_like(child_scores, len(cand_depths) + 1, dtype=torch.long))
        best = child_scores.topk(min(width, child_scores.shape[1]), dim=1).indices  # [B, K]
        grow = shape.grow(child_parents, child_logprobs.flatten(1), child_scores, num_cands + best)
        parent_slots = best // k_child
        prev_rows = block_mask.gather(1, parent_slots[:, :, None].expand(-1, -1, block_mask.shape[2]))
        new_eye = torch.eye(best.shape[1], dtype=torch.bool, device=device).expand(batch, -1, -1)
        block_mask = torch.cat([prev_rows, new_eye], dim=2)
        frontier_ids = child_ids.flatten(1).gather(1, best)
        frontier_scores = child_scores.gather(1, best)
        frontier_global = num_cands + best
        num_cands += child_scores.shape[1]
    expander.end_round()
    all_scores = torch.cat(cand_scores, 1)
    num_real = int(torch.isfinite(all_scores).sum(1).max())  # absent (-inf) children are never needed
    num_keep = min(shape.num_nodes(), num_real)
    if num_keep == 0:
        return root_only_tree(root_ids)
    return _select_nodes(
        root_ids,
        torch.cat(cand_ids, 1),
        all_scores,
        torch.cat(cand_parents, 1),
        torch.cat(cand_depths, 1),
        num_keep,
    )


def root_only_tree(root_ids: Tensor) -> DraftTree:
    """The tree of a plain step: the root alone ([B] ids)."""
    zeros = torch.zeros_like(root_ids)[:, None]
    return DraftTree(root_ids[:, None], zeros - 1, zeros, zeros.float())


def _select_nodes(
    root_ids: Tensor,
    cand_ids: Tensor,
    cand_scores: Tensor,
    cand_parents: Tensor,
    cand_depths: Tensor,
    num_keep: int,
) -> DraftTree:
    """Keep the best `num_keep` candidates ([B, C] each) and renumber them as tree nodes 1.."""
    batch, num_cands = cand_ids.shape
    num_keep = min(num_keep, num_cands)
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :num_keep]
    kept = torch.sort(order, dim=1).values  # candidate order is topological (by depth)
    node_of_cand = torch.full((batch, num_cands), -1, dtype=torch.long, device=cand_ids.device)
    node_of_cand.scatter_(1, kept, torch.arange(1, num_keep + 1, device=cand_ids.device).expand(batch, -1))
    kept_parents = cand_parents.gather(1, kept)
    parent_nodes = torch.where(
        kept_parents >= 0, node_of_cand.gather(1, kept_parents.clamp(min=0)), torch.zeros_like(kept_parents)
    )
    if (parent_nodes < 0).any():
        raise AssertionError("selected draft nodes are not closed under ancestors")
    parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.long, device=cand_ids.device), parent_nodes], 1)
    depths = torch.cat([torch.zeros_like(parents[:, :1]), cand_depths.gather(1, kept)], 1)
    token_ids = torch.cat([root_ids[:, None], cand_ids.gather(1, kept)], 1)
    logprobs = torch.cat([torch.zeros(batch, 1, device=cand_ids.device), cand_scores.gather(1, kept)], 1)
    return DraftTree(token_ids, parents, depths, logprobs)
