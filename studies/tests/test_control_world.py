"""The control's synthetic world (studies/mmvsd_studies/control_world.py): the Markov language, the target's training
positions and true next-word distributions, and the target's KL to the chain, against direct computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmvsd_studies import control_world


@pytest.fixture(scope="module")
def world():
    return control_world


def test_language_is_a_normalised_branching_chain(world):
    config = world.ControlConfig()
    language = world.make_language(config)
    assert language.next_probs.shape == (64, 64, 64)
    torch.testing.assert_close(language.next_probs.sum(-1), torch.ones(64, 64))
    support = (language.next_probs > 0).sum(-1)
    assert set(support[language.kinds == 0].tolist()) == {3} and set(support[language.kinds == 1].tolist()) == {2}
    assert set(support[language.kinds == 3].tolist()) == {config.high_entropy_support}
    shares = torch.bincount(language.kinds.flatten(), minlength=4) / 64**2
    assert torch.allclose(shares, torch.tensor(config.kind_shares), atol=0.03)
    words = language.sample(20, 30, torch.Generator().manual_seed(0))
    steps = language.next_probs[words[:, :-2], words[:, 1:-1], words[:, 2:]]
    assert (steps > 0).all()  # every sampled transition is one the chain allows


def test_training_positions_and_true_distributions_skip_the_markers(world):
    config = world.parse_overrides(world.ControlConfig(), ["num_tokens=8", "prompt_min=5", "prompt_max=5",
                                                               "answer_tokens=6"])
    language = world.make_language(config)
    ids, mask = world.target_batch(config, language, torch.Generator().manual_seed(0), 3)
    assert ids[0, 0] == world.USER_ID and ids[0, 6] == world.ASSISTANT_ID and ids.shape == (3, 13)
    predicted = ids[:, 1:][mask[:, :-1]]
    assert (predicted >= len(world.SPECIALS)).all() and mask.sum() == 3 * (3 + 6)  # words 3..5 and the answer
    truth = world.true_next_probs(language, ids)
    words = ids - len(world.SPECIALS)
    # the assistant marker (position 6) predicts the first answer word from the last two prompt words
    torch.testing.assert_close(truth[:, 6, 4:], language.next_probs[words[:, 4], words[:, 5]])
    torch.testing.assert_close(truth[:, 8, 4:], language.next_probs[words[:, 7], words[:, 8]])
    assert (truth[:, :, :4] == 0).all()


class _ChainModel(torch.nn.Module):
    """A 'target' whose logits are log(p + eps) of a given next-word table: the chain itself, or uniform."""

    def __init__(self, world, language, uniform: bool = False):
        super().__init__()
        self.world, self.language, self.uniform = world, language, uniform

    def forward(self, ids):
        truth = self.world.true_next_probs(self.language, ids)
        logits = torch.zeros_like(truth) if self.uniform else (truth + 1e-12).log()
        return type("Out", (), {"logits": logits})


def test_target_kl_is_zero_for_the_chain_and_matches_a_direct_value_for_uniform(world):
    config = world.parse_overrides(world.ControlConfig(), ["num_tokens=8"])
    language = world.make_language(config)
    assert world.target_kl(_ChainModel(world, language), language, config, num=64) == pytest.approx(0, abs=1e-6)
    ids, mask = world.target_batch(config, language, torch.Generator().manual_seed(12345), 64)
    truth = world.true_next_probs(language, ids)[mask]
    entropy = float(-(truth * truth.clamp_min(1e-30).log()).sum(-1).mean())
    uniform = world.target_kl(_ChainModel(world, language, uniform=True), language, config, num=64)
    assert uniform == pytest.approx(np.log(12) - entropy, rel=1e-5)  # KL(p || uniform over 8 + 4 ids)
