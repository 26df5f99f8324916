"""Ragged KV cache: tree forwards and compaction equal recomputing the accepted prefix."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama, random_prompts
from mmvsd.decoding.decode import _prefill, as_prompts
from mmvsd.decoding.tree import DraftTree
from mmvsd.target import Target


def random_tree(batch: int, num_nodes: int, vocab: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, num_nodes), -1)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    depths = torch.zeros_like(parents)
    for i in range(1, num_nodes):
        depths[:, i] = depths.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    ids = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    return DraftTree(ids, parents, depths, torch.zeros(batch, num_nodes))


def full_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_and_keep_equal_recompute(attn):
    target = Target(make_tiny_llama(seed=2, attn=attn), None, "tiny")
    prompts = random_prompts(3, seed=9, min_len=2, max_len=9)
    cache, _, _, _, _ = _prefill(target, as_prompts(prompts), need_aux=False)
    seqs = [list(p) for p in prompts]
    for step in range(3):
        tree = random_tree(3, 9, target.vocab_size, seed=step)
        out = target.forward(cache, tree.token_ids, tree.depths, tree.ancestor_mask(), need_aux=False)
        # every tree node's logits equal a plain forward over its committed sequence + path
        for b in range(3):
            for node in range(tree.num_nodes):
                path = [n for n in tree.path_to(torch.tensor([node] * 3))[b].tolist() if n >= 0]
                ref = full_logits(target.model, seqs[b] + tree.token_ids[b, path].tolist())[-1]
                torch.testing.assert_close(out.logits[b, node], ref, atol=2e-5, rtol=1e-4)
        # keep a different-length random path per row
        leaves = torch.tensor([int(tree.leaves()[b].nonzero()[step % 2]) for b in range(3)])
        paths = tree.path_to(leaves)
        keep = torch.tensor([1, 2 + step, 1 + (step % 2)]).clamp(max=(paths >= 0).sum(1))
        cache.keep(paths.clamp(min=0), keep)
        for b in range(3):
            seqs[b] += tree.token_ids[b, paths[b, : keep[b]]].tolist()
        assert cache.lens.tolist() == [len(s) for s in seqs]
    # the compacted cache continues exactly like a fresh forward over the whole sequence
    probe = torch.tensor([[5], [6], [7]])
    out = target.forward(cache, probe, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, 1, dtype=torch.bool),
                         need_aux=False)
    for b in range(3):
        torch.testing.assert_close(out.logits[b, 0], full_logits(target.model, seqs[b] + [5 + b])[-1],
                                   atol=2e-5, rtol=1e-4)


def test_select_rows_drops_finished_sequences():
    target = Target(make_tiny_llama(seed=3), None, "tiny")
    prompts = random_prompts(3, seed=2)
    cache, _, _, _, _ = _prefill(target, as_prompts(prompts), need_aux=False)
    cache.select_rows(torch.tensor([2, 0]))
    assert cache.lens.tolist() == [len(prompts[2]), len(prompts[0])]
    assert cache.committed_len == max(len(prompts[2]), len(prompts[0]))
    out = target.forward(cache, torch.tensor([[1], [1]]), torch.zeros(2, 1, dtype=torch.long),
                         torch.ones(2, 1, 1, dtype=torch.bool), need_aux=False)
    torch.testing.assert_close(out.logits[0, 0], full_logits(target.model, prompts[2] + [1])[-1], atol=2e-5, rtol=1e-4)
