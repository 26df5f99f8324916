"""Sampling corner cases: float underflow at very low temperature, and one generator per sequence."""

from __future__ import annotations

import torch

from conftest import random_prompts
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import DraftTree, TreeShape
from mmvsd.decoding.verify import renormalised, row_generators, sample_next, verify_greedy, verify_sampling


def chain_tree(token_ids: list[int]) -> DraftTree:
    """A root followed by a chain of drafted tokens."""
    n = len(token_ids)
    return DraftTree(torch.tensor([token_ids]), torch.tensor([[-1] + list(range(n - 1))]),
                     torch.arange(n)[None], -torch.arange(n, dtype=torch.float)[None])


def test_no_residual_mass_falls_back_to_the_argmax_of_the_untried_tokens():
    node_logits = torch.tensor([1.0, 5.0, 4.0, -2.0])
    residual = torch.zeros(4)  # everything underflowed or was tried
    assert renormalised(residual, node_logits, tried=[1]).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert renormalised(torch.tensor([0.0, 1.0, 3.0, 0.0]), node_logits, tried=[0]).tolist() == [0.0, 0.25, 0.75, 0.0]


def test_tiny_temperature_samples_the_argmax_without_nan():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 16, generator=gen) * 20  # logits / 1e-38 overflow to inf without the max shift
    tree = chain_tree([3, int(logits[0, 0].argmax()), 7, 2])  # the first draft is the target's choice
    greedy = verify_greedy(tree, logits)
    for _ in range(20):
        sampled = verify_sampling(tree, logits, temperature=1e-38, generator=gen)
        assert sampled.num_accepted.tolist() == greedy.num_accepted.tolist()
        assert sampled.bonus_ids.tolist() == greedy.bonus_ids.tolist()
    assert sample_next(logits[:, 0], 1e-38, gen).tolist() == logits[:, 0].argmax(-1).tolist()


def test_per_row_generators_make_a_row_independent_of_its_batch_mates():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    alone = sample_next(logits[1:2], 1.0, row_generators([[1]], 7))
    for _ in range(5):  # whatever the other rows are, row 1 draws from its own generator
        batch = sample_next(torch.cat([torch.randn(1, 50), logits[1:2], torch.randn(1, 50)]), 1.0,
                            row_generators([[0], [1], [2]], 7))
        assert batch[1] == alone[0]


def test_a_prompts_t1_sample_is_the_same_alone_and_in_a_batch(tiny_target, random_drafter):
    prompts = random_prompts(3, seed=5)
    config = DecodeConfig(max_new_tokens=12, temperature=1.0, tree=TreeShape(8, 3, 2), seed=11)
    for generate in (lambda p: vanilla_generate(tiny_target, p, config),
                     lambda p: speculative_generate(tiny_target, random_drafter, p, config)):
        together = [r.output_ids for r in generate(prompts)]
        alone = [generate([prompt])[0].output_ids for prompt in prompts]
        assert together == alone
        assert len({tuple(ids) for ids in together}) > 1  # the rows really are different samples
        repeats = [r.output_ids for r in generate([prompts[0]] * 4)]
        assert repeats[0] == alone[0] and len({tuple(ids) for ids in repeats}) > 1  # repeats: new samples


def test_drafter_constructors_leave_the_global_rng_alone(tiny_target):
    from mmvsd.drafters.eagle3 import Eagle3Drafter

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = Eagle3Drafter.from_target(tiny_target, seed=4)
    assert torch.equal(torch.rand(3), expected)  # the caller's stream was not reseeded
    second = Eagle3Drafter.from_target(tiny_target, seed=4)
    assert torch.equal(first.fc.weight, second.fc.weight)  # still a fixed init per seed
