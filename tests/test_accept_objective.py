"""The exact-acceptance objective `accept` (sum_v min(p, q) along the training-time-test unroll): against an
explicit loop, its gradient's direction, and the two-context case where it beats cross-entropy by construction."""

from __future__ import annotations

import pytest
import torch
from test_objectives import setup, unrolled

from mmvsd.training.objectives import ObjectiveConfig, accept_loss, acceptance
from mmvsd.training.terms import make_objective


def test_acceptance_is_the_probability_a_sampled_draft_passes():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 9, generator=gen), -1)
    q = torch.log_softmax(torch.randn(4, 9, generator=gen), -1)
    # speculative sampling accepts x ~ q with probability min(1, p(x) / q(x))
    direct = (q.exp() * torch.clamp(p / q.exp(), max=1.0)).sum(-1)
    torch.testing.assert_close(acceptance(p, q), direct)
    assert torch.allclose(acceptance(p, p.log()), torch.ones(4))  # q = p: every draft passes


def test_accept_loss_matches_explicit_loop(tiny_target):
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(ttt_steps=3, ttt_decay=0.8)
    loss, metrics = accept_loss(drafter, tiny_target, batch, config)
    hiddens, full_logits = unrolled(tiny_target, batch, drafter, 3)
    full = torch.softmax(full_logits.float(), -1).detach()  # [B, T, V]
    expected = 0.0
    for step in range(3):
        rates = []
        for b in range(2):
            for t in range(int(batch.tokens.lengths[b])):
                label_pos = t + 2 + step
                if label_pos >= 12 or not batch.tokens.loss_mask[b, label_pos]:
                    continue
                p = full[b, label_pos - 1, 28:]  # the target's probability of each draft-vocabulary token
                q = torch.softmax(drafter.draft_logits(hiddens[step][b, t]).float(), -1).detach()
                rates.append(sum(min(float(pv), float(qv)) for pv, qv in zip(p, q, strict=True)))
        expected -= 0.8**step * sum(rates) / len(rates)
        assert metrics[f"accept_{step}"] == pytest.approx(sum(rates) / len(rates), abs=1e-5)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5)


def test_ce_plus_accept_is_ce_plus_weighted_accept(tiny_target):
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(ttt_steps=2, accept_weight=0.5)
    generator = torch.Generator().manual_seed(0)
    both, _ = make_objective("ce+accept", config)(drafter, tiny_target, batch, generator)
    ce, _ = make_objective("ce", config)(drafter, tiny_target, batch, generator)
    accept, _ = make_objective("accept", config)(drafter, tiny_target, batch, generator)
    torch.testing.assert_close(both, ce + 0.5 * accept)


def test_ce_plus_accept_runs_the_drafter_once_with_the_separate_terms_gradient(tiny_target, monkeypatch):
    """The terms share one unroll and one draft-LM-head pass per step (`objectives.Unroll`), and one target LM head
    (in fp32, as accept needs), and the shared passes give the very gradient of the two terms computed apart."""
    batch, drafter = setup(tiny_target)
    config = ObjectiveConfig(ttt_steps=3, accept_weight=0.5)
    generator = torch.Generator().manual_seed(0)

    def grads(objective):
        drafter.zero_grad()
        loss, _ = make_objective(objective, config)(drafter, tiny_target, batch, generator)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    ce_loss, ce_grads = grads("ce")
    accept_loss, accept_grads = grads("accept")
    calls = {"read_target": 0, "draft_logprobs": 0, "logits": 0, "float_logits": 0}
    for name in calls:
        owner = tiny_target if name in ("logits", "float_logits") else drafter
        method = getattr(owner, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    both_loss, both_grads = grads("ce+accept")
    # one unroll, one draft head pass per step, one fp32 target head
    assert calls == {"read_target": 1, "draft_logprobs": 3, "logits": 0, "float_logits": 1}
    calls.update(dict.fromkeys(calls, 0))
    grads("ce")
    assert (calls["logits"], calls["float_logits"]) == (1, 0)  # ce alone: the target's head in its own dtype
    torch.testing.assert_close(both_loss, ce_loss + 0.5 * accept_loss)
    for both, ce, accept in zip(both_grads, ce_grads, accept_grads, strict=True):
        torch.testing.assert_close(both, ce + 0.5 * accept)


def two_context_targets(vocab: int = 6, mode: float = 0.85) -> tuple[torch.Tensor, torch.Tensor]:
    """Two contexts the drafter cannot tell apart (60% and 40% of the data), each with its own 0.85 mode."""
    rest = (1 - mode) / (vocab - 1)
    p1, p2 = torch.full((vocab,), rest), torch.full((vocab,), rest)
    p1[0], p2[1] = mode, mode
    return p1, p2


def fit(objective: str, steps: int = 3000) -> torch.Tensor:
    """One drafter distribution q (free logits) shared by both contexts, trained by Adam on `objective`."""
    p1, p2 = two_context_targets()
    logits = torch.zeros(6, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.05)
    for _ in range(steps):
        logq = torch.log_softmax(logits, -1)
        if objective == "ce":
            loss = -(0.6 * (p1 * logq).sum() + 0.4 * (p2 * logq).sum())
        else:
            loss = -(0.6 * acceptance(p1, logq) + 0.4 * acceptance(p2, logq))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.log_softmax(logits.detach(), -1)


def expected_accepted_length(logq: torch.Tensor, depth: int = 7) -> float:
    """Tokens a depth-`depth` chain of sampled drafts gets accepted per step at T = 1 (every step alike)."""
    p1, p2 = two_context_targets()
    rate = float(0.6 * acceptance(p1, logq) + 0.4 * acceptance(p2, logq))
    return sum(rate**k for k in range(1, depth + 1))


def test_two_contexts_accept_beats_cross_entropy_by_construction():
    """CE learns the mixture 0.6 p1 + 0.4 p2; maximising acceptance moves q's mass onto the majority context's
    mode, where min(p, q) grows most. Here: 1.49 accepted tokens per depth-7 chain for ce, 1.91 for accept."""
    ce, accept = fit("ce"), fit("accept")
    p1, p2 = two_context_targets()
    torch.testing.assert_close(ce.exp(), 0.6 * p1 + 0.4 * p2, atol=2e-3, rtol=0)
    length_ce, length_accept = expected_accepted_length(ce), expected_accepted_length(accept)
    assert accept.exp()[0] > 0.8 and length_accept > 1.2 * length_ce


def test_expected_acceptance_reweights_the_continuation_and_keeps_the_product_beside_it(tiny_target):
    """expected_acceptance, per anchor t of a depth-3 chain (0 past the continuation), summed over the anchors whose
    token t+2 is in the continuation after its first token: total = sum_k r_1 ... r_{k-1} a_k, forced_total =
    sum_k a_1 ... a_k, with a_i the exact acceptance of unrolled step i and r_i = min(p, q_i)(y) / p(y) at the
    continuation's token y (0 outside the draft vocabulary, which holds target ids 28..127 here)."""
    from mmvsd.decoding.decode import Prompt
    from mmvsd.eval.acceptance import expected_acceptance
    from mmvsd.training.features import TokenBatch, capture_features

    _, drafter = setup(tiny_target)
    gen = torch.Generator().manual_seed(5)
    prompts = [Prompt(torch.randint(0, 128, (n,), generator=gen).tolist()) for n in (4, 6)]
    continuations = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (7, 3)]
    continuations[0][3] = 5  # a token outside the draft vocabulary: r = 0 there
    got = expected_acceptance(tiny_target, drafter, prompts, continuations, depth=3, batch_size=1)
    for chain, prompt, cont in zip(got, prompts, continuations, strict=True):
        ids = torch.tensor([prompt.token_ids + cont])
        start, end = len(prompt.token_ids), ids.shape[1]
        mask = (torch.arange(end) >= start)[None]
        batch = capture_features(tiny_target, TokenBatch(ids, mask, torch.tensor([end])))
        hiddens, full_logits = unrolled(tiny_target, batch, drafter, 3)
        p = torch.softmax(full_logits.float(), -1)[0]
        unbiased, forced, anchors = 0.0, 0.0, 0
        for t in range(end):
            if t + 2 >= end or t + 2 <= start:  # token `start` is the target's choice at prefill
                continue
            anchors += 1
            reweight, product = 1.0, 1.0
            for step in range(3):
                label = t + 2 + step
                rate = ratio = 0.0
                if label < end:
                    q = torch.softmax(drafter.draft_logits(hiddens[step][0, t]).float(), -1).detach()
                    rate = float(torch.minimum(p[label - 1, 28:], q).sum())
                    y = int(ids[0, label])
                    if y >= 28:
                        ratio = min(float(p[label - 1, y]), float(q[y - 28])) / float(p[label - 1, y])
                unbiased += reweight * rate
                reweight *= ratio
                product *= rate
                forced += product
        assert chain.anchors == anchors == len(cont) - 1
        assert chain.total == pytest.approx(unbiased, abs=1e-4)
        assert chain.forced_total == pytest.approx(forced, abs=1e-4)


def test_expected_acceptance_is_unbiased_for_the_sampled_chain_and_the_product_is_not(tiny_target):
    """At one anchor, depth 2: P(1st passes) + P(both pass) = a_1 + sum_x min(p_1, q_1)(x) a_2(x) exactly (the
    second draft's context is the accepted first one; p_1, q_1 computed here). The estimate from continuations
    y ~ p, averaged over every y with weight p_1(y), equals it; the product a_1 + a_1 a_2(y) averaged likewise
    does not (its second context follows p_1, not min(p_1, q_1) / a_1)."""
    from mmvsd.decoding.decode import Prompt
    from mmvsd.eval.acceptance import chain_steps
    from mmvsd.training.features import TokenBatch, capture_features

    _, drafter = setup(tiny_target)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(8.0)  # sharper drafts: the two laws of the second context differ more
    prompt, last = [3, 50, 77, 91], 60  # every continuation: the prefill's token 60, y, then one more token
    conts = [[last, y, 40] for y in range(128)]
    steps = chain_steps(tiny_target, drafter, [Prompt(prompt)] * 128, conts, depth=2)
    anchor = len(prompt) - 1  # its chain drafts y (step 1), then the token after y (step 2)
    rate1, ratio, rate2 = steps.rates[:, anchor, 0], steps.ratios[:, anchor, 0], steps.rates[:, anchor, 1]
    torch.testing.assert_close(rate1, rate1[:1].expand(128))  # step 1 does not see y
    ids = torch.tensor([prompt + conts[0]])
    batch = capture_features(tiny_target, TokenBatch(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([7])))
    hiddens, full_logits = unrolled(tiny_target, batch, drafter, 1)
    with torch.no_grad():
        p1 = torch.softmax(full_logits[0, anchor + 1].float(), -1)  # the target's law of the token after `last`
        q1 = torch.zeros(128)
        q1[28:] = torch.softmax(drafter.draft_logits(hiddens[0][0, anchor]).float(), -1)
    exact = float(rate1[0] + (torch.minimum(p1, q1) * rate2).sum())
    estimate = float((p1 * (rate1 + ratio * rate2)).sum())
    forced = float((p1 * (rate1 + rate1 * rate2)).sum())
    assert float(rate1[0]) == pytest.approx(float(torch.minimum(p1, q1).sum()), abs=1e-5)
    assert estimate == pytest.approx(exact, rel=1e-4)
    assert abs(forced - exact) > 0.01 * exact, (forced, exact)
