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

from mmvsd.decoding.tree import DraftTree


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
    return verify_greedy_choices(tree, target_logits.argmax(-1))


def verify_greedy_choices(tree: DraftTree, target_next: Tensor) -> Verdict:
    """T = 0 verification from the target's choice after each node, target_next [B, N] (its argmax;
    the acceptance evaluator passes the known greedy continuation instead, so both share this rule)."""
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
    """Softmax of logits at `temperature` (> 0), in float32 for stable sampling. The max is taken off
    before dividing, so a tiny temperature gives the argmax one-hot, never inf - inf = NaN."""
    logits = target_logits.float()
    return torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)


DUPLICATE_STRIDE = 1_000_003  # seed offset of each repeat of one prompt within a batch
Generators = torch.Generator | list[torch.Generator] | None  # one for the batch, or one per row


def row_generator(generators: Generators, row: int) -> torch.Generator | None:
    """Row `row`'s generator: per-row generators make a row's sample independent of its batch-mates."""
    return generators[row] if isinstance(generators, (list, tuple)) else generators


def renormalised(residual: Tensor, node_logits: Tensor, tried: list[int]) -> Tensor:
    """`residual` / its sum; when float underflow left no mass (very low temperature), a one-hot on the
    target's argmax among the tokens not tried yet (the T -> 0 limit of the residual)."""
    total = residual.sum()
    if total > 0 and torch.isfinite(total):
        return residual / total
    logits = node_logits.float().cpu().clone()
    logits[tried] = float("-inf")
    fallback = torch.zeros_like(residual)
    fallback[int(logits.argmax())] = 1.0
    return fallback


def verify_sampling(
    tree: DraftTree, target_logits: Tensor, temperature: float, generator: Generators = None
) -> Verdict:
    """T > 0 lossless multi-candidate rejection sampling, one row at a time (cheap: N nodes).
    `generator`: one for the whole batch or a list with one per row."""
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
        row_gen = row_generator(generator, b)
        node, depth = 0, 0
        path_nodes[b, 0] = 0
        while True:
            residual = probs[b, node].clone()
            children = (parents[b] == node).nonzero().flatten()
            children = children[torch.argsort(scores[b, children], descending=True, stable=True)]
            accepted_child, tried = -1, []
            for child in children.tolist():
                token = int(token_ids[b, child])
                if torch.rand((), generator=row_gen) < residual[token]:
                    accepted_child = child
                    break
                residual[token] = 0.0
                tried.append(token)
                residual = renormalised(residual, target_logits[b, node], tried)
            if accepted_child < 0:
                bonus_ids[b] = int(torch.multinomial(residual, 1, generator=row_gen))
                break
            node, depth = accepted_child, depth + 1
            path_nodes[b, depth] = node
        num_accepted[b] = depth
    device = tree.token_ids.device
    return Verdict(path_nodes.to(device), num_accepted.to(device), bonus_ids.to(device))


def verify(tree: DraftTree, target_logits: Tensor, temperature: float, generator: Generators = None) -> Verdict:
    """Verify `tree` greedily (temperature 0) or by lossless rejection sampling."""
    if temperature <= 0:
        return verify_greedy(tree, target_logits)
    return verify_sampling(tree, target_logits, temperature, generator)


def sample_next(target_logits: Tensor, temperature: float, generator: Generators = None) -> Tensor:
    """The target's own next token from logits [B, V]: argmax at T = 0, else a sample (one generator for
    the batch, or a list with one per row)."""
    if temperature <= 0:
        return target_logits.argmax(-1)
    probs = target_probs(target_logits, temperature).cpu()  # [B, V]
    if not isinstance(generator, (list, tuple)):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(target_logits.device)
    rows = [torch.multinomial(probs[b], 1, generator=generator[b]) for b in range(probs.shape[0])]
    return torch.cat(rows).to(target_logits.device)


def row_generators(prompt_ids: list[list[int]], seed: int) -> list[torch.Generator]:
    """One CPU generator per sequence, seeded from `seed` alone, so a prompt's sample is the same alone or
    in a batch (as vLLM's per-request seeds). The k-th repeat of an identical prompt in one batch gets
    seed + k * DUPLICATE_STRIDE, so repeats are independent samples rather than copies."""
    seen: dict[tuple[int, ...], int] = {}
    generators = []
    for ids in prompt_ids:
        repeat = seen.get(tuple(ids), 0)
        seen[tuple(ids)] = repeat + 1
        generators.append(torch.Generator().manual_seed(seed + repeat * DUPLICATE_STRIDE))
    return generators
