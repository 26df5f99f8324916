"""The VSD E-step against naive computation: packed scoring, target rollouts, drafter pass, M-step."""

from __future__ import annotations

import pytest
import torch

from mmvsd.drafter import DraftInputs
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.estep import EStepPaths, choose_anchors, draft_pass, score_paths_packed, target_rollouts
from mmvsd.features import TokenBatch, capture_features
from mmvsd.objectives import ObjectiveConfig, vsd_m_step
from mmvsd.vsd import car_weights, path_log_kappa

VOCAB = 128


def make_batch(target, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 20), generator=gen)
    lengths = torch.tensor([20, 14])
    loss_mask = (torch.arange(20)[None] >= 5) & (torch.arange(20)[None] < lengths[:, None])
    tokens = TokenBatch(ids, loss_mask, lengths)
    return capture_features(target, tokens, keep_cache=True), gen


def full_logprobs(target, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(target.model(seq[None]).logits[0].float(), -1)


def test_anchors_are_distinct_loss_positions(tiny_target):
    batch, gen = make_batch(tiny_target)
    anchors, valid = choose_anchors(batch.tokens, 4, gen)
    assert valid.all()
    for b in range(2):
        assert len(set(anchors[b].tolist())) == 4
        assert all(batch.tokens.loss_mask[b, t + 2] for t in anchors[b].tolist())
    short = TokenBatch(batch.tokens.input_ids, batch.tokens.loss_mask & (torch.arange(20) < 8), batch.tokens.lengths)
    anchors, valid = choose_anchors(short, 6, gen)  # positions 5..7 are loss tokens: anchors 3..5 only
    assert valid.sum(1).tolist() == [3, 3] and sorted(anchors[0][valid[0]].tolist()) == [3, 4, 5]


def test_packed_scoring_equals_naive_per_path(tiny_target):
    batch, gen = make_batch(tiny_target)
    anchors, _ = choose_anchors(batch.tokens, 3, gen)
    paths = torch.randint(0, 3, (2, 3, 6, 4), generator=gen)  # few symbols: many shared prefixes
    paths[0, 0, 1] = paths[0, 0, 0]  # an exact duplicate path
    packed = score_paths_packed(tiny_target, batch.target_cache, batch, anchors, paths)
    for b in range(2):
        for a in range(3):
            t = int(anchors[b, a])
            for s in range(6):
                seq = torch.cat([batch.tokens.input_ids[b, : t + 2], paths[b, a, s, :-1]])
                ref = full_logprobs(tiny_target, seq)[t + 1 :].gather(-1, paths[b, a, s, :, None])[:, 0]
                torch.testing.assert_close(packed[b, a, s], ref, atol=2e-5, rtol=1e-4)
    # the cache is unchanged: the same scoring again gives the same numbers
    torch.testing.assert_close(score_paths_packed(tiny_target, batch.target_cache, batch, anchors, paths), packed)


def test_target_rollouts_sample_the_draft_vocab_and_score_like_naive(tiny_target):
    batch, gen = make_batch(tiny_target, seed=1)
    anchors, _ = choose_anchors(batch.tokens, 2, gen)
    in_vocab = torch.zeros(VOCAB, dtype=torch.bool)
    in_vocab[torch.arange(0, VOCAB, 2)] = True  # even ids only
    corrections, greedy = target_rollouts(tiny_target, batch.target_cache, batch, anchors, in_vocab, 5, 4, gen)
    assert corrections.token_ids.shape == (2, 2, 5, 4) and greedy.token_ids.shape == (2, 2, 1, 4)
    assert (corrections.token_ids % 2 == 0).all() and (greedy.token_ids % 2 == 0).all()
    for b in range(2):
        for a in range(2):
            t = int(anchors[b, a])
            prefix = batch.tokens.input_ids[b, : t + 2]
            seq = prefix.clone()  # greedy over the even ids, one token at a time
            for _ in range(4):
                logprobs = full_logprobs(tiny_target, seq)[-1]
                seq = torch.cat([seq, logprobs.masked_fill(~in_vocab, -torch.inf).argmax()[None]])
            assert greedy.token_ids[b, a, 0].tolist() == seq[t + 2 :].tolist()
            for s in range(5):
                path = corrections.token_ids[b, a, s]
                ref = full_logprobs(tiny_target, torch.cat([prefix, path[:-1]]))[t + 1 :].gather(-1, path[:, None])[:, 0]
                torch.testing.assert_close(corrections.target_logprobs[b, a, s], ref, atol=2e-5, rtol=1e-4)


def test_draft_pass_matches_decoding_session_token_by_token(tiny_target):
    """Teacher-forced E-step log-probs equal what the decoder's DraftSession computes for that chain."""
    batch, gen = make_batch(tiny_target, seed=2)
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=VOCAB, seed=3)
    anchors, _ = choose_anchors(batch.tokens, 2, gen)
    given = torch.randint(0, VOCAB, (2, 2, 3, 4), generator=gen)
    identity = torch.arange(VOCAB)
    drafted = draft_pass(drafter, batch, anchors, given, identity, 4, 4, gen)
    assert drafted.proposals.shape == (2, 2, 4, 4) and drafted.teacher_logprobs.shape == (2, 2, 3, 4)
    next_ids = torch.cat([batch.tokens.input_ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
    for b in range(2):
        for a in range(2):
            t = int(anchors[b, a])
            for s, path in enumerate([*given[b, a], *drafted.proposals[b, a]]):
                session = drafter.new_session(1)
                session.advance(DraftInputs(batch.features[b : b + 1, : t + 1], next_ids[b : b + 1, : t + 1],
                                            torch.tensor([t + 1])))
                hidden, reference = session.last_hidden, []
                for depth in range(4):
                    logprobs = drafter.draft_logprobs(hidden)[0]
                    reference.append(logprobs[path[depth]])
                    if depth < 3:
                        session.frontier_hidden = hidden[:, None]
                        session.expand(path[depth].view(1, 1), torch.zeros(1, 1, dtype=torch.long),
                                       torch.ones(1, 1, depth + 1, dtype=torch.bool), 1)
                        hidden = session.frontier_hidden[:, 0]
                got = drafted.teacher_logprobs[b, a, s] if s < 3 else drafted.proposal_logprobs[b, a, s - 3]
                torch.testing.assert_close(got.detach(), torch.stack(reference).detach(), atol=2e-5, rtol=1e-4)


def test_m_step_matches_a_direct_loop_over_anchors_samples_and_lengths():
    """vsd_m_step's loss equals Alg. 1's M-step written as explicit loops (eq. advance)."""
    gen = torch.Generator().manual_seed(0)
    num_anchors, num_samples, length = 3, 5, 4
    shape = (num_anchors, num_samples, length)
    rand = lambda *s: -torch.rand(*s, generator=gen) * 2
    paths = EStepPaths(
        proposal_target_lps=rand(*shape), proposal_draft_lps=rand(*shape).requires_grad_(),
        correction_target_lps=rand(*shape), correction_draft_lps=rand(*shape).requires_grad_(),
        greedy_target_lps=rand(num_anchors, length) * 0.3, greedy_draft_lps=rand(num_anchors, length),
        mask=torch.ones(shape, dtype=torch.bool), step0_hidden=torch.zeros(1),
    )
    config = ObjectiveConfig(length_weight_base=1.05, car_temperature=0.2)
    loss, metrics = vsd_m_step(paths, config)
    kappa = lambda p, q: path_log_kappa(p, q.detach())
    prop_k, corr_k = kappa(paths.proposal_target_lps, paths.proposal_draft_lps), kappa(
        paths.correction_target_lps, paths.correction_draft_lps)
    greedy_k = path_log_kappa(paths.greedy_target_lps, paths.greedy_draft_lps)
    prop_lp, corr_lp = paths.proposal_draft_lps.cumsum(-1), paths.correction_draft_lps.cumsum(-1)
    zeta = car_weights(prop_lp, 0.2)
    per_anchor = []
    for a in range(num_anchors):
        o_tilde = [[1.05 ** (l + 1) * float(prop_k[a, s, l] >= greedy_k[a, l]) for l in range(length)]
                   for s in range(num_samples)]
        o_final = [[o_tilde[s][l] if o_tilde[s][l] > 0 else 1.05 ** (l + 1) * float(corr_k[a, s, l] >= greedy_k[a, l])
                    for l in range(length)] for s in range(num_samples)]
        total, weight = 0.0, 0.0
        for l in range(length):
            for s in range(num_samples):
                others = [j for j in range(num_samples) if j != s]
                den = sum(o_final[j][l] for j in others)
                beta = sum(o_final[j][l] * (o_tilde[j][l] > 0) for j in others) / den if den > 0 else 0.0
                final_lp = prop_lp[a, s, l] if o_tilde[s][l] > 0 else corr_lp[a, s, l]
                total = total + o_final[s][l] * (final_lp - beta * zeta[a, s, l] * prop_lp[a, s, l])
                weight += o_final[s][l]
        if weight > 0:
            per_anchor.append(total / weight)
    expected = -torch.stack(per_anchor).mean()
    torch.testing.assert_close(loss, expected)
    assert 0 < metrics["oracle_pass_rate"] < 1  # a mix of kept and corrected proposals


@pytest.mark.parametrize("use_arw, use_car", [(True, True), (False, True), (True, False)])
def test_m_step_switches_change_only_the_correction_term(use_arw, use_car):
    gen = torch.Generator().manual_seed(1)
    shape = (2, 4, 3)
    paths = EStepPaths(*(-torch.rand(*shape, generator=gen) for _ in range(4)),
                       greedy_target_lps=-torch.rand(2, 3, generator=gen), greedy_draft_lps=-torch.rand(2, 3, generator=gen),
                       mask=torch.ones(shape, dtype=torch.bool), step0_hidden=torch.zeros(1))
    loss, _ = vsd_m_step(paths, ObjectiveConfig(use_arw=use_arw, use_car=use_car))
    basic, _ = vsd_m_step(paths, ObjectiveConfig(use_arw=False))
    assert torch.isfinite(loss)
    assert (loss == basic) == (not use_arw)
