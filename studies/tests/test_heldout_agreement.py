"""studies/mmvsd_studies/heldout_agreement.py: teacher-forced top-1 agreement against direct computation."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from test_vsd_control import _random_sequences, _TargetOracle, tiny  # noqa: F401  (tiny: the fixture)

from mmvsd.decoding.decode import as_prompts
from mmvsd.eval.acceptance import prompt_continuation_batch
from mmvsd.training.features import capture_features
from mmvsd.training.objectives import step_distributions
from mmvsd_studies import heldout_agreement


def test_a_drafter_equal_to_the_target_agrees_everywhere(tiny):  # noqa: F811
    oracle = _TargetOracle.from_target(tiny, draft_vocab_size=None)
    oracle.oracle_target = tiny
    prompts, conts = _random_sequences(3)
    rows = heldout_agreement.agreement(tiny, oracle, as_prompts(prompts), conts)
    # every position whose token is a continuation token after the first
    assert rows == [{"positions": len(cont) - 1, "correct": len(cont) - 1} for cont in conts]


class _NoisyOracle(_TargetOracle):
    """The target's own next distribution plus a fixed random function of the hidden state: agrees in part."""

    def draft_logprobs(self, hidden):
        noise = hidden.float() @ self.noise.to(hidden.device)
        return torch.log_softmax(self.oracle_target.logits(hidden).float() + noise, -1)


def test_agreement_counts_the_target_top1_the_drafter_matches(tiny):  # noqa: F811
    drafter = _NoisyOracle.from_target(tiny, draft_vocab_size=None)
    drafter.oracle_target = tiny
    generator = torch.Generator().manual_seed(0)
    drafter.noise = torch.randn(tiny.model.config.hidden_size, tiny.vocab_size, generator=generator) * 0.3
    prompts, conts = _random_sequences(4, seed=1)
    rows = heldout_agreement.agreement(tiny, drafter, as_prompts(prompts), conts)
    for prompt, cont, row in zip(prompts, conts, rows):
        seq = torch.tensor([prompt + cont])
        with torch.no_grad():
            target_top1 = tiny.model(seq).logits[0].argmax(-1)  # position j's choice of token j + 1
            batch = capture_features(tiny, prompt_continuation_batch(tiny, as_prompts([prompt]), [cont]))
            mask, _, log_q = next(step_distributions(drafter, tiny, batch, 1))
        anchors = mask[0].nonzero()[:, 0]  # anchor t predicts token t + 2, the target's choice at t + 1
        correct = int((log_q.argmax(-1) == target_top1[anchors + 1]).sum())
        assert row == {"positions": len(cont) - 1, "correct": correct}
    assert 0 < sum(r["correct"] for r in rows) < sum(r["positions"] for r in rows)


def test_summary_pools_positions_per_domain():
    rows = [{"positions": 10, "correct": 5}, {"positions": 30, "correct": 3}, {"positions": 20, "correct": 20}]
    summary = heldout_agreement.summarise(rows, ["chat", "math", "chat"])
    assert summary == pytest.approx({"all": 28 / 60, "chat": 25 / 30, "math": 3 / 30})
    assert heldout_agreement.summarise(rows, []) == pytest.approx({"all": 28 / 60})


def test_versus_is_the_paired_difference_with_its_interval():
    base = [{"positions": 10, "correct": 5}, {"positions": 10, "correct": 4}, {"positions": 20, "correct": 10}]
    better = [{"positions": 10, "correct": 7}, {"positions": 10, "correct": 6}, {"positions": 20, "correct": 14}]
    out = heldout_agreement.versus(better, base, ["chat", "math", "chat"], resamples_count=200)
    assert out["all"][0] == pytest.approx(27 / 40 - 19 / 40) and out["all"][1] > 0  # better on every prompt
    assert out["math"] == pytest.approx([0.2, 0.2, 0.2])
    assert heldout_agreement.versus(base, base, [])["all"] == [0.0, 0.0, 0.0]


def test_split_by_the_targets_top1_probability_and_by_lookup(tiny):  # noqa: F811
    drafter = _NoisyOracle.from_target(tiny, draft_vocab_size=None)
    drafter.oracle_target = tiny
    drafter.noise = torch.randn(tiny.model.config.hidden_size, tiny.vocab_size,
                                generator=torch.Generator().manual_seed(0)) * 0.3
    prompts, conts = _random_sequences(4, seed=1)
    top1 = []  # per prompt, the target's top-1 probability at each scored label, computed directly
    for prompt, cont in zip(prompts, conts):
        with torch.no_grad():
            probs = torch.softmax(tiny.model(torch.tensor([prompt + cont])).logits[0].float(), -1)
        anchors = torch.arange(len(prompt) - 1, len(prompt) + len(cont) - 2)  # anchor t: its label's choice at t + 1
        top1.append(probs[anchors + 1].amax(-1))
    pooled = torch.cat(top1).sort().values
    edges = (0.0, float(pooled[len(pooled) // 3]), float(pooled[2 * len(pooled) // 3]), 1.0)  # thirds of the data
    split = heldout_agreement.agreement_split(tiny, drafter, as_prompts(prompts), conts, edges)
    rows = split["confidence"]
    totals = heldout_agreement.agreement(tiny, drafter, as_prompts(prompts), conts)
    for row, lookup, total, values in zip(rows, split["lookup"], totals, top1):
        for counts in (row, lookup):
            assert sum(counts["positions"]) == total["positions"] and sum(counts["correct"]) == total["correct"]
        assert row["positions"] == [int(((values >= lo) & ((values < hi) | (hi == 1.0))).sum())
                                    for lo, hi in pairwise(edges)]
    assert all(sum(row["positions"][k] for row in rows) > 0 for k in range(3))
    summary = heldout_agreement.split_summary(rows, ["chat", "math", "chat", "math"])
    assert sum(summary["all"]["share"]) == pytest.approx(1.0) and set(summary) == {"all", "chat", "math"}
    scored = [sum(row["positions"][k] for row in rows) for k in range(3)]
    matched = [sum(row["correct"][k] for row in rows) for k in range(3)]
    assert summary["all"]["agreement"] == pytest.approx([m / n for m, n in zip(matched, scored)])


def test_lookup_classes_is_a_bigram_prompt_lookup_over_the_context_so_far():
    tokens = [5, 6, 7, 1, 5, 6, 8, 5, 6, 9, 9]
    # anchor 4 (tokens 5, 6): the earlier 5, 6 was followed by 7; anchor 7: the latest 5, 6 (at 4) by 8; anchor 1
    # (6, 7) and anchor 8 (6, 9): no earlier occurrence; anchor 0 has no context at all
    assert heldout_agreement.lookup_classes(tokens, [0, 1, 4, 7, 8], [6, 1, 7, 9, 9]) == [0, 0, 1, 2, 0]
    assert heldout_agreement.lookup_classes(tokens, [7], [8]) == [1]  # the table is built up to the anchor at once
    assert heldout_agreement.lookup_classes([3, 3, 3, 3], [1, 2], [3, 4]) == [1, 2]  # a run: its own bigram, earlier
