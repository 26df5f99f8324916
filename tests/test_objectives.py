"""The `ce` and top-K KL objectives against explicit per-position loops."""

from __future__ import annotations

import torch

from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.features import TokenBatch, capture_features
from mmvsd.objectives import ObjectiveConfig, ce_loss, topk_kl_loss
from mmvsd.unroll import unroll_draft_steps

VOCAB = 128


def setup(target):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
    lengths = torch.tensor([12, 9])
    loss_mask = (torch.arange(12)[None] >= 3) & (torch.arange(12)[None] < lengths[:, None])
    batch = capture_features(target, TokenBatch(ids, loss_mask, lengths))
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=100, seed=1)
    drafter.set_draft_vocab(torch.arange(28, 128))  # target ids 0..27 are outside the draft vocabulary
    return batch, drafter


def test_ce_loss_matches_explicit_loop(tiny_target):
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(ttt_steps=3, ttt_decay=0.8)
    loss, metrics = ce_loss(drafter, tiny_target, batch, config)
    ids = batch.tokens.input_ids
    next_ids = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
    hiddens = unroll_draft_steps(drafter, batch.features, next_ids, 3)
    full_logits = tiny_target.logits(batch.target_hidden)  # [B, T, V]
    expected = 0.0
    for step in range(3):
        terms, hits = [], []
        for b in range(2):
            for t in range(int(batch.tokens.lengths[b])):
                label_pos = t + 2 + step  # the token step `step` at anchor t predicts
                if label_pos >= 12 or not batch.tokens.loss_mask[b, label_pos]:
                    continue
                target_row = full_logits[b, label_pos - 1]
                if int(target_row.argmax()) < 28:  # target top-1 outside the draft vocabulary: skipped
                    continue
                target_probs = torch.softmax(target_row[28:].float(), -1)
                draft_logprobs = torch.log_softmax(drafter.draft_logits(hiddens[step][b, t]).float(), -1)
                terms.append(-(target_probs * draft_logprobs).sum())
                hits.append(float(draft_logprobs.argmax() == target_probs.argmax()))
        expected = expected + 0.8**step * torch.stack(terms).mean()
        assert metrics[f"acc_{step}"] == sum(hits) / len(hits)
    torch.testing.assert_close(loss, expected)


def test_topk_kl_matches_explicit_loop(tiny_target):
    batch, drafter = setup(tiny_target)
    step0 = unroll_draft_steps(drafter, batch.features, torch.roll(batch.tokens.input_ids, -1, 1), 1)[0]
    kl = topk_kl_loss(drafter, tiny_target, batch, step0, top_k=5)
    full_logits = tiny_target.logits(batch.target_hidden)
    values = []
    for b in range(2):
        for t in range(10):
            if not batch.tokens.loss_mask[b, t + 2]:
                continue
            target_draft_logits = full_logits[b, t + 1, 28:].float()
            top = target_draft_logits.topk(5).indices
            p_hat = torch.softmax(target_draft_logits[top], -1)
            q_hat = torch.softmax(drafter.draft_logits(step0[b, t]).float()[top], -1)
            values.append((p_hat * (p_hat.log() - q_hat.log())).sum())
    torch.testing.assert_close(kl, torch.stack(values).mean())
