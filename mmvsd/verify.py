"""Pure verification of draft trees against the target's logits.

T = 0: keep the deepest node whose whole root-to-node path matches the target's argmax at every
step, then the target's argmax after it is the bonus token.
T > 0: multi-candidate rejection with deterministic drafts (SpecInfer / EAGLE): walking down from
the root, try the children in order of draft score; accept child x with probability p(x), where p
is the target's current (residual) distribution; on rejection set p(x) = 0 and renormalise. When a
node has no child left, the bonus token is sampled from the residual p. The output distribution is
exactly the target's, whatever the drafter proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmvsd.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """What the target accepted from one draft tree per row."""

    path_nodes: Tensor  # [B, D+1] accepted node indices from the root, -1 padded
    num_accepted: Tensor  # [B] accepted draft tokens (root excluded)
    bonus_ids: Tensor  # [B] the target's own next token after the accepted path

    def accepted_ids(self, tree: DraftTree) -> list[list[int]]:
        """Per row: accepted draft token ids followed by the bonus token."""
        out = []
        for b in range(self.path_nodes.shape[0]):
            nodes = self.path_nodes[b, 1 : 1 + int(self.num_accepted[b])]
            out.append(tree.token_ids[b, nodes].tolist() + [int(self.bonus_ids[b])])
        return out


def verify_greedy(tree: DraftTree, target_logits: Tensor) -> Verdict:
    """T = 0 verification. target_logits [B, N, V]: the target's logits at every tree node."""
    target_next = target_logits.argmax(-1)  # [B, N] the target's choice after each node
    parent_choice = target_next.gather(1, tree.parents.clamp(min=0))
    matches = tree.token_ids == parent_choice
    matches[:, 0] = True  # the root is committed already
    ancestors = tree.ancestor_mask()  # [B, N, N]
    path_ok = ~(ancestors & ~matches[:, None, :]).any(-1)  # every node on the path matches
    depth_if_ok = torch.where(path_ok, tree.depths, torch.full_like(tree.depths, -1))
    best = depth_if_ok.argmax(1)  # [B] first deepest fully-matching node
    rows = torch.arange(best.shape[0], device=best.device)
    return Verdict(tree.path_to(best), tree.depths[rows, best], target_next[rows, best])


def target_probs(target_logits: Tensor, temperature: float) -> Tensor:
    """Softmax of logits at `temperature` (> 0), in float32 for stable sampling."""
    return torch.softmax(target_logits.float() / temperature, dim=-1)


def verify_sampling(
    tree: DraftTree, target_logits: Tensor, temperature: float, generator: torch.Generator | None = None
) -> Verdict:
    """T > 0 lossless multi-candidate rejection sampling, one row at a time (cheap: N nodes)."""
    probs = target_probs(target_logits, temperature).cpu()  # [B, N, V]
    token_ids = tree.token_ids.cpu()
    parents = tree.parents.cpu()
    scores = tree.draft_logprobs.cpu()
    batch = token_ids.shape[0]
    max_depth = tree.max_depth
    path_nodes = torch.full((batch, max_depth + 1), -1, dtype=torch.long)
    num_accepted = torch.zeros(batch, dtype=torch.long)
    bonus_ids = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        node, depth = 0, 0
        path_nodes[b, 0] = 0
        while True:
            residual = probs[b, node].clone()
            children = (parents[b] == node).nonzero().flatten()
            children = children[torch.argsort(scores[b, children], descending=True, stable=True)]
            accepted_child = -1
            for child in children.tolist():
                token = int(token_ids[b, child])
                if torch.rand((), generator=generator) < residual[token]:
                    accepted_child = child
                    break
                residual[token] = 0.0
                residual /= residual.sum()
            if accepted_child < 0:
                bonus_ids[b] = int(torch.multinomial(residual, 1, generator=generator))
                break
            node, depth = accepted_child, depth + 1
            path_nodes[b, depth] = node
        num_accepted[b] = depth
    device = tree.token_ids.device
    return Verdict(path_nodes.to(device), num_accepted.to(device), bonus_ids.to(device))


def verify(
    tree: DraftTree, target_logits: Tensor, temperature: float, generator: torch.Generator | None = None
) -> Verdict:
    """Verify `tree` greedily (temperature 0) or by lossless rejection sampling."""
    if temperature <= 0:
        return verify_greedy(tree, target_logits)
    return verify_sampling(tree, target_logits, temperature, generator)


def sample_next(target_logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """The target's own next token from logits [B, V]: argmax at T = 0, else a sample."""
    if temperature <= 0:
        return target_logits.argmax(-1)
    probs = target_probs(target_logits, temperature)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(target_logits.device)
