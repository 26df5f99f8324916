"""T > 0: speculative sampling reproduces the target's distribution (chi-square tests)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from conftest import random_prompts
from mmvsd.decoding.decode import DecodeConfig, speculative_generate
from mmvsd.decoding.tree import DraftTree, TreeShape
from mmvsd.decoding.verify import verify_greedy, verify_sampling

NUM_SAMPLES = 20_000


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit, pooling bins whose expected count is below `min_expected`."""
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(),
                           exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue)


def toy_tree(batch: int) -> DraftTree:
    # root -> {a=2, b=5, c=1}; a -> {d=3, e=0}; b -> {f=4}
    ids = torch.tensor([7, 2, 5, 1, 3, 0, 4]).expand(batch, -1)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2]).expand(batch, -1)
    depths = torch.tensor([0, 1, 1, 1, 2, 2, 2]).expand(batch, -1)
    scores = torch.tensor([0.0, -0.5, -1.0, -2.0, -1.0, -1.5, -2.0]).expand(batch, -1)
    return DraftTree(ids.clone(), parents.clone(), depths.clone(), scores.clone())


def test_verify_sampling_matches_target_distribution():
    vocab = 8
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=gen) * 1.5
    logits[0, 2] += 2.0  # make the drafted children likely enough to be accepted often
    logits[1, 3] += 2.0
    tree = toy_tree(NUM_SAMPLES)
    verdict = verify_sampling(tree, logits.expand(NUM_SAMPLES, -1, -1), temperature=1.0, generator=gen)
    probs = torch.softmax(logits, -1)
    first = [row[0] for row in verdict.accepted_ids(tree)]
    counts = torch.bincount(torch.tensor(first), minlength=vocab).float()
    assert chi_square_pvalue(counts, probs[0]) > 1e-3
    # given the first token is drafted child a (=2, node 1), the second follows the target at node 1
    second = [row[1] for row in verdict.accepted_ids(tree) if row[0] == 2]
    counts2 = torch.bincount(torch.tensor(second), minlength=vocab).float()
    assert counts2.sum() > 1000
    assert chi_square_pvalue(counts2, probs[1]) > 1e-3
    # and the drafts are really being accepted, not just resampled as bonus tokens
    assert (verdict.num_accepted >= 2).float().mean() > 0.05


def test_verify_sampling_detects_a_wrong_distribution():
    """The chi-square check has power: a biased sampler is rejected."""
    vocab = 8
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(1)), -1)
    biased = probs.clone()
    biased[0] += 0.05
    biased /= biased.sum()
    samples = torch.multinomial(biased, NUM_SAMPLES, replacement=True, generator=torch.Generator().manual_seed(2))
    assert chi_square_pvalue(torch.bincount(samples, minlength=vocab).float(), probs) < 1e-3


def test_verify_greedy_picks_longest_matching_path():
    tree = toy_tree(1)
    logits = torch.full((1, 7, 8), -5.0)
    logits[0, 0, 2] = 5  # target after root: 2 (node 1)
    logits[0, 1, 0] = 5  # after node 1: 0 (node 5)
    logits[0, 5, 6] = 5  # after node 5: bonus 6
    verdict = verify_greedy(tree, logits)
    assert verdict.path_nodes.tolist() == [[0, 1, 5]]
    assert verdict.num_accepted.tolist() == [2] and verdict.bonus_ids.tolist() == [6]
    logits[0, 0, 2], logits[0, 0, 7] = -5.0, 5.0  # first step matches no child
    verdict = verify_greedy(tree, logits)
    assert verdict.num_accepted.tolist() == [0] and verdict.bonus_ids.tolist() == [7]


def second_token_pvalue(target, drafter, prompt: list[int], rows: int, tree: TreeShape) -> float:
    """Chi-square p-value of the 2nd sampled token (T=1, `rows` copies of `prompt`) against the target's exact
    marginal of it, sum_x p(x) p(. | x)."""
    config = DecodeConfig(max_new_tokens=2, temperature=1.0, tree=tree, seed=5)
    second = torch.tensor([r.output_ids[1] for r in speculative_generate(target, drafter, [prompt] * rows, config)])
    vocab = target.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1], -1)
        ids = torch.cat([torch.tensor(prompt).expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2_given = torch.softmax(target.model(ids).logits[:, -1], -1)
    marginal = (p1[:, None] * p2_given).sum(0)
    return chi_square_pvalue(torch.bincount(second, minlength=vocab).float(), marginal)


def test_end_to_end_sampling_matches_target_marginal(tiny_target, random_drafter):
    """Batched tree decoding at T=1: the 2nd token's marginal equals the target's exact marginal."""
    prompt = random_prompts(1, seed=4)[0]
    assert second_token_pvalue(tiny_target, random_drafter, prompt, 3000, TreeShape(budget=12, depth=3, topk=3)) > 1e-3
