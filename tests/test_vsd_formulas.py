"""The VSD objective's tensor math (mmvsd/training/vsd.py) against direct loop / numpy / scipy computation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.special import rel_entr
from scipy.special import softmax as scipy_softmax
from torch import Tensor

from mmvsd.training.estep import EStepPaths
from mmvsd.training.objectives import ObjectiveConfig, vsd_m_step
from mmvsd.training.vsd import (
    car_weights,
    leave_one_out_acceptance,
    length_weights,
    oracle,
    oracle_diagnostics,
    path_log_kappa,
    prefix_logprobs,
    topk_renormalised_kl,
    vsd_surrogate,
)


def random_logprobs(*shape: int, seed: int) -> torch.Tensor:
    """Token log-probs of random categorical distributions, float64, for exact comparisons."""
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(*shape, 6, generator=gen, dtype=torch.float64), -1)[..., 0]


# ---------------------------------------------------------------- kappa, weights, oracle


def test_path_log_kappa_matches_product_of_acceptance_probs() -> None:
    target_lp, draft_lp = random_logprobs(2, 5, 4, seed=0), random_logprobs(2, 5, 4, seed=1)
    mask = torch.ones(2, 5, 4, dtype=torch.bool)
    mask[0, 1, 2:] = False
    got = path_log_kappa(target_lp, draft_lp, mask).exp().numpy()
    p, q = target_lp.exp().numpy(), draft_lp.exp().numpy()
    for a, s in itertools.product(range(2), range(5)):
        kappa = 1.0
        for l in range(4):
            if mask[a, s, l]:
                kappa *= min(1.0, p[a, s, l] / q[a, s, l])
            assert got[a, s, l] == pytest.approx(kappa, rel=1e-12)
    assert (np.diff(got, axis=-1) <= 1e-15).all()  # kappa never grows with the prefix


def test_prefix_logprobs_is_masked_cumulative_sum() -> None:
    token_lp = random_logprobs(3, 4, seed=2)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    got = prefix_logprobs(token_lp, mask)
    for r in range(3):
        for l in range(4):
            want = sum(float(token_lp[r, i]) for i in range(l + 1) if mask[r, i])
            assert float(got[r, l]) == pytest.approx(want, rel=1e-12)


def test_length_weights_follow_implementation_details() -> None:
    weights = length_weights(7, 1.05, dtype=torch.float64)
    assert weights.tolist() == pytest.approx([1.05**l for l in range(1, 8)])
    assert (weights > 1).all() and (weights < 2).all()  # the paper's bound 1 < w(l) < 2


def test_oracle_matches_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    log_kappa = -torch.rand(3, 6, 4, generator=gen, dtype=torch.float64).cumsum(-1)
    greedy_log_kappa = -torch.rand(3, 4, generator=gen, dtype=torch.float64).cumsum(-1)
    log_kappa[1, 2] = greedy_log_kappa[1]  # ties pass (>=)
    mask = torch.rand(3, 6, 4, generator=gen) > 0.2
    weights = length_weights(4, dtype=torch.float64)
    got = oracle(log_kappa, greedy_log_kappa, weights, mask)
    for a, s, l in itertools.product(range(3), range(6), range(4)):
        ok = bool(mask[a, s, l]) and float(log_kappa[a, s, l]) >= float(greedy_log_kappa[a, l])
        assert float(got[a, s, l]) == (1.05 ** (l + 1) if ok else 0.0)
    assert (got[1, 2] > 0).eq(mask[1, 2]).all()
    assert 0 < (got > 0).float().mean() < 1  # the test data exercise both outcomes
    ties = torch.zeros(3, 6, 4, dtype=torch.bool)
    ties[0, :, 0] = True  # declared ties pass whatever their log kappa, unless masked
    with_ties = oracle(log_kappa, greedy_log_kappa, weights, mask, ties)
    assert ((with_ties[0, :, 0] > 0) == mask[0, :, 0]).all()
    assert (with_ties[:, :, 1:] == got[:, :, 1:]).all() and (with_ties[1:] == got[1:]).all()
    assert (got[0, :, 0] == 0).any()  # the ties changed something


# ---------------------------------------------------------------- ARW beta, CAR zeta


def test_leave_one_out_acceptance_matches_explicit_loop() -> None:
    gen = torch.Generator().manual_seed(4)
    num_anchors, num_samples, num_lengths = 3, 5, 4
    passed = torch.rand(num_anchors, num_samples, num_lengths, generator=gen) > 0.5
    weights = length_weights(num_lengths, dtype=torch.float64)
    final_passed = passed | (torch.rand(passed.shape, generator=gen) > 0.5)  # kept or corrected and valid
    final_passed[0, :, 0] = False  # nobody valid: beta = 0
    final_passed[1, :, 1] = False
    final_passed[1, 2, 1] = True  # only one valid: its beta has no others -> 0
    final_oracle = final_passed.double() * weights
    got = leave_one_out_acceptance(passed, final_oracle)
    for a, s, l in itertools.product(range(num_anchors), range(num_samples), range(num_lengths)):
        others = [j for j in range(num_samples) if j != s]
        num = sum(float(final_oracle[a, j, l]) * float(passed[a, j, l]) for j in others)
        den = sum(float(final_oracle[a, j, l]) for j in others)
        assert float(got[a, s, l]) == pytest.approx(num / den if den > 0 else 0.0, abs=1e-6)
    assert ((got >= 0) & (got <= 1)).all()


def test_leave_one_out_acceptance_plain_mean_of_others() -> None:
    accept = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    got = leave_one_out_acceptance(accept)  # [A, S]
    want = [[2 / 3, 1.0, 2 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3, 0.0]]
    assert got.tolist() == [pytest.approx(row) for row in want]
    assert leave_one_out_acceptance(torch.ones(2, 1)).tolist() == [[0.0], [0.0]]  # S = 1


def test_car_weights_match_scipy_softmax() -> None:
    path_lp = random_logprobs(2, 7, 3, seed=5).cumsum(-1)
    got = car_weights(path_lp, temperature=0.2)
    want = scipy_softmax(np.exp(path_lp.numpy()) / 0.2, axis=1)  # eq. zeta_update: exp(q/tau)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    got_log = car_weights(path_lp, temperature=0.2, on_log_scale=True)
    np.testing.assert_allclose(got_log.numpy(), scipy_softmax(path_lp.numpy() / 0.2, axis=1), rtol=1e-5)
    np.testing.assert_allclose(got.sum(1).numpy(), 1.0, rtol=1e-6)


def test_car_mean_normalisation_is_num_valid_times_softmax() -> None:
    path_lp = random_logprobs(2, 5, 3, seed=12).cumsum(-1)
    mask = torch.ones(2, 5, 3, dtype=torch.bool)
    mask[0, 1:3, 2] = False
    literal = car_weights(path_lp, 0.2, mask)
    mean = car_weights(path_lp, 0.2, mask, normalisation="mean")
    num_valid = mask.sum(1, keepdim=True)
    torch.testing.assert_close(mean, literal * num_valid)
    torch.testing.assert_close(mean.sum(1), num_valid[:, 0].float())  # mean 1 over the valid samples
    assert (mean[~mask] == 0).all()
    log_mean = car_weights(path_lp, 0.2, mask, normalisation="mean", on_log_scale=True)
    torch.testing.assert_close(log_mean, car_weights(path_lp, 0.2, mask, on_log_scale=True) * num_valid)
    with pytest.raises(ValueError):
        car_weights(path_lp, 0.2, normalisation="max")


def test_car_weights_limits_and_mask() -> None:
    path_lp = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.05], [0.02, 0.6, 0.2, 0.1]]))[..., None]  # [A, S, 1]
    sharp = car_weights(path_lp, temperature=1e-4)
    assert sharp[..., 0].tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]  # one-hot on argmax
    flat = car_weights(path_lp, temperature=1e6)
    np.testing.assert_allclose(flat.numpy(), 0.25, rtol=1e-5)  # uniform as tau -> infinity
    mask = torch.tensor([[True, False, True, True], [False, False, False, False]])[..., None]
    masked = car_weights(path_lp, temperature=0.2, mask=mask)
    assert masked[0, 1, 0] == 0 and float(masked[0].sum()) == pytest.approx(1.0)
    assert masked[1].abs().sum() == 0  # nothing valid: no weight, no NaN


# ---------------------------------------------------------------- surrogate gradient = eq. advance


def toy_prefix_logprob(draft_logits: torch.Tensor, path_ids: list[int]) -> torch.Tensor:
    """log q(z_1..z_l) of a context-free per-step drafter, computed one token at a time."""
    draft_logprobs = torch.log_softmax(draft_logits, -1)  # [L, V]
    return sum(draft_logprobs[i, tok] for i, tok in enumerate(path_ids))


def make_surrogate_inputs(seed: int):
    """Random paths (one independent path per prefix length, as Alg. 1 allows) and E-step weights."""
    gen = torch.Generator().manual_seed(seed)
    num_anchors, num_samples, num_lengths, vocab = 3, 4, 3, 5
    final_ids = torch.randint(0, vocab, (num_anchors, num_samples, num_lengths, num_lengths), generator=gen)
    proposal_ids = torch.randint(0, vocab, final_ids.shape, generator=gen)
    passed = torch.rand(num_anchors, num_samples, num_lengths, generator=gen) > 0.5
    final_valid = passed | (torch.rand(passed.shape, generator=gen) > 0.4)
    final_valid[2] = False  # an anchor with no valid path is left out of the mean
    mask = torch.ones_like(passed)
    mask[1, 3, 2] = False
    weights = length_weights(num_lengths, dtype=torch.float64)
    final_oracle = final_valid.double() * weights  # not masked: vsd_surrogate must apply the mask
    beta = leave_one_out_acceptance(passed & mask, final_oracle * mask).double()
    proposal_lp_detached = torch.randn(passed.shape, generator=gen, dtype=torch.float64) - 3
    zeta = car_weights(proposal_lp_detached, 0.2, mask).double()
    draft_logits = torch.randn(num_lengths, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    return draft_logits, final_ids, proposal_ids, passed, mask, final_oracle, beta, zeta


def batched_path_logprobs(draft_logits: torch.Tensor, path_ids: torch.Tensor) -> torch.Tensor:
    """[A, S, L, L] per-prefix paths -> [A, S, L] log q(prefix l), vectorised like a trainer would."""
    num_lengths = path_ids.shape[-1]
    draft_logprobs = torch.log_softmax(draft_logits, -1)  # [L, V]
    positions = torch.arange(num_lengths).expand_as(path_ids)
    token_lp = draft_logprobs[positions, path_ids]  # [A, S, L(prefix), L(position)]
    return prefix_logprobs(token_lp).diagonal(dim1=-2, dim2=-1)  # prefix l read at position l


@pytest.mark.parametrize("use_arw,use_car", [(True, True), (True, False), (False, True)])
def test_surrogate_gradient_equals_eq_advance(use_arw: bool, use_car: bool) -> None:
    draft_logits, final_ids, proposal_ids, passed, mask, final_oracle, beta, zeta = make_surrogate_inputs(6)
    loss, metrics = vsd_surrogate(
        batched_path_logprobs(draft_logits, final_ids),
        batched_path_logprobs(draft_logits, proposal_ids),
        final_oracle=final_oracle, proposal_passed=passed, beta=beta, zeta=zeta, mask=mask,
        use_arw=use_arw, use_car=use_car,
    )
    (autograd_grad,) = torch.autograd.grad(loss, draft_logits)

    num_anchors, num_samples, num_lengths = passed.shape
    per_anchor_g_hat = []
    for a in range(num_anchors):
        masked_oracle = final_oracle * mask
        total = sum(float(masked_oracle[a, s, l]) for s in range(num_samples) for l in range(num_lengths))
        if total == 0:
            continue
        g_hat = torch.zeros_like(draft_logits)
        for s, l in itertools.product(range(num_samples), range(num_lengths)):
            o_prime = float(masked_oracle[a, s, l])
            if o_prime == 0:
                continue
            final_lp = toy_prefix_logprob(draft_logits, final_ids[a, s, l, : l + 1].tolist())
            proposal_lp = toy_prefix_logprob(draft_logits, proposal_ids[a, s, l, : l + 1].tolist())
            (grad_final,) = torch.autograd.grad(final_lp, draft_logits)
            (grad_prop,) = torch.autograd.grad(proposal_lp, draft_logits)
            cv = float(beta[a, s, l]) * (float(zeta[a, s, l]) if use_car else 1.0) if use_arw else 0.0
            g_hat += o_prime * (grad_final - cv * grad_prop)  # eq. advance (eq. basic when cv = 0)
        per_anchor_g_hat.append(g_hat / total)
    expected = -torch.stack(per_anchor_g_hat).mean(0)  # loss descends along g_hat
    torch.testing.assert_close(autograd_grad, expected, rtol=1e-9, atol=1e-12)
    assert float(metrics["num_anchors_used"]) == 2
    assert float(metrics["oracle_pass_rate"]) == pytest.approx(float((passed & mask).sum() / mask.sum()))
    if use_arw:  # the correction term really contributes
        basic_loss, _ = vsd_surrogate(
            batched_path_logprobs(draft_logits, final_ids), batched_path_logprobs(draft_logits, proposal_ids),
            final_oracle=final_oracle, proposal_passed=passed, beta=beta, zeta=zeta, mask=mask, use_arw=False,
        )
        (basic_grad,) = torch.autograd.grad(basic_loss, draft_logits)
        assert (basic_grad - autograd_grad).abs().max() > 1e-4


def test_surrogate_does_not_backprop_into_weights() -> None:
    draft_logits, final_ids, proposal_ids, passed, mask, final_oracle, beta, zeta = make_surrogate_inputs(7)
    beta, zeta = beta.clone().requires_grad_(), zeta.clone().requires_grad_()
    loss, _ = vsd_surrogate(
        batched_path_logprobs(draft_logits, final_ids), batched_path_logprobs(draft_logits, proposal_ids),
        final_oracle=final_oracle, proposal_passed=passed, beta=beta, zeta=zeta, mask=mask,
    )
    assert torch.autograd.grad(loss, [beta, zeta], allow_unused=True) == (None, None)


# ---------------------------------------------------------------- top-K renormalised KL


def test_topk_renormalised_kl_matches_manual() -> None:
    gen = torch.Generator().manual_seed(8)
    target_logits = torch.randn(3, 4, 20, generator=gen) * 2
    draft_logits = torch.randn(3, 4, 20, generator=gen) * 2
    got = topk_renormalised_kl(target_logits, draft_logits, k=10)
    assert got.shape == (3, 4)
    target_probs = scipy_softmax(target_logits.numpy().astype(np.float64), -1)
    draft_probs = scipy_softmax(draft_logits.numpy().astype(np.float64), -1)
    for idx in itertools.product(range(3), range(4)):
        top = np.argsort(-target_probs[idx])[:10]
        p_hat = target_probs[idx][top] / target_probs[idx][top].sum()
        q_hat = draft_probs[idx][top] / draft_probs[idx][top].sum()
        assert float(got[idx]) == pytest.approx(rel_entr(p_hat, q_hat).sum(), rel=1e-4)
    assert (got > 0).all()


def test_topk_renormalised_kl_zero_cases_and_full_vocab() -> None:
    gen = torch.Generator().manual_seed(9)
    target_logits = torch.randn(5, 12, generator=gen)
    assert topk_renormalised_kl(target_logits, target_logits.clone(), k=4).abs().max() < 1e-6
    assert topk_renormalised_kl(target_logits, target_logits + 3.0, k=4).abs().max() < 1e-6
    # the draft may differ outside the target's top-K: renormalisation makes that invisible
    outside = target_logits.clone()
    bottom = target_logits.topk(8, largest=False).indices
    outside.scatter_(-1, bottom, torch.randn(5, 8, generator=gen) * 5)
    assert topk_renormalised_kl(target_logits, outside, k=4).abs().max() < 1e-6
    # K = V is the ordinary KL(p_target || q_draft)
    draft_logits = torch.randn(5, 12, generator=gen)
    full = torch.nn.functional.kl_div(
        torch.log_softmax(draft_logits, -1), torch.log_softmax(target_logits, -1), log_target=True, reduction="none"
    ).sum(-1)
    torch.testing.assert_close(topk_renormalised_kl(target_logits, draft_logits, k=12), full, rtol=1e-5, atol=1e-6)
    reverse = topk_renormalised_kl(draft_logits, target_logits, k=12)
    assert (reverse - full).abs().max() > 1e-3  # the direction matters, and is target || draft


# ---------------------------------------------------------------- expected accepted length


def test_expected_accepted_length_matches_enumeration() -> None:
    gen = torch.Generator().manual_seed(10)
    num_lengths, vocab = 3, 4
    target_probs = torch.softmax(torch.randn(num_lengths, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    draft_probs = torch.softmax(torch.randn(num_lengths, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    brute = 0.0
    for path in itertools.product(range(vocab), repeat=num_lengths):  # eq. EA_def, sum over all z
        path_prob, survival, accepted = 1.0, 1.0, 0.0
        for i, tok in enumerate(path):
            path_prob *= float(draft_probs[i, tok])
            survival *= min(1.0, float(target_probs[i, tok] / draft_probs[i, tok]))  # S_k, eq. survival_def
            accepted += survival
        brute += path_prob * accepted
    assert float(expected_accepted_length(target_probs, draft_probs)) == pytest.approx(brute, rel=1e-12)
    assert float(expected_accepted_length(target_probs, target_probs)) == pytest.approx(num_lengths)
    batched = expected_accepted_length(
        torch.stack([target_probs, target_probs]), torch.stack([draft_probs, target_probs])
    )
    assert batched.tolist() == pytest.approx([brute, num_lengths])


# ---------------------------------------------------------------- toy EM: the objective helps


def toy_problem(seed: int = 11, num_lengths: int = 4, vocab: int = 6):
    """Context-free per-step target log-probs [L, V] and drafter logits [L, V] (the drafter's parameters)."""
    gen = torch.Generator().manual_seed(seed)
    target_logprobs = torch.log_softmax(torch.randn(num_lengths, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    draft_logits = (torch.randn(num_lengths, vocab, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    return target_logprobs, draft_logits


def toy_e_step(target_logprobs: torch.Tensor, draft_logits: torch.Tensor, num_anchors: int, num_samples: int,
               gen: torch.Generator) -> EStepPaths:
    """Alg. 1's E-step for `num_anchors` copies of one context-free prefix, as `run_estep` returns it."""
    num_lengths = target_logprobs.shape[0]
    draft_logprobs = torch.log_softmax(draft_logits, -1)  # [L, V], with grad
    steps = torch.arange(num_lengths)

    def draw(logprobs: torch.Tensor) -> torch.Tensor:  # [A, S, L] ids, each step independent
        flat = torch.multinomial(logprobs.detach().exp(), num_anchors * num_samples, replacement=True, generator=gen)
        return flat.T.reshape(num_anchors, num_samples, num_lengths)

    proposal_ids, correction_ids = draw(draft_logprobs), draw(target_logprobs)
    greedy_ids = target_logprobs.argmax(-1).expand(num_anchors, -1)  # z_bar from p_theta^(1)
    return EStepPaths(
        proposal_target_lps=target_logprobs[steps, proposal_ids],
        proposal_draft_lps=draft_logprobs[steps, proposal_ids],
        correction_target_lps=target_logprobs[steps, correction_ids],
        correction_draft_lps=draft_logprobs[steps, correction_ids],
        greedy_target_lps=target_logprobs[steps, greedy_ids],
        greedy_draft_lps=draft_logprobs[steps, greedy_ids].detach(),
        mask=torch.ones(num_anchors, num_samples, num_lengths, dtype=torch.bool), step0_hidden=torch.zeros(1),
        proposal_ids=proposal_ids, correction_ids=correction_ids, greedy_ids=greedy_ids,
    )


def reference_m_step_loss(paths: EStepPaths, config: ObjectiveConfig) -> torch.Tensor:
    """Alg. 1 and 2 written out from the paper, one (anchor, l, s) at a time, sharing no code with mmvsd.

    o(z_<=l) = 1.05^l * [log kappa(z_<=l) >= log kappa(z_bar_<=l) or z_<=l == z_bar_<=l];
    beta = sum_{j!=s} o'_j o~_j / sum_{j!=s} o'_j (binary o~); zeta = softmax_s(c / tau) with
    c = q(z~_<=l) (or log q), times S for `car_normalisation=mean`; loss = -mean_x of eq. advance.
    """
    num_anchors, num_samples, num_lengths = paths.mask.shape
    per_anchor = []
    for a in range(num_anchors):
        def log_kappa(target_lps, draft_lps, l):
            return sum(min(0.0, float(target_lps[i]) - float(draft_lps[i].detach())) for i in range(l + 1))

        def o(kind: str, s: int, l: int, a: int = a) -> float:
            ids = getattr(paths, f"{kind}_ids")[a, s, : l + 1].tolist()
            greedy = paths.greedy_ids[a, : l + 1].tolist()
            mine = log_kappa(getattr(paths, f"{kind}_target_lps")[a, s], getattr(paths, f"{kind}_draft_lps")[a, s], l)
            ref = log_kappa(paths.greedy_target_lps[a], paths.greedy_draft_lps[a], l)
            return config.length_weight_base ** (l + 1) * float(mine >= ref or ids == greedy)

        total, weight = 0.0, 0.0
        for l in range(num_lengths):
            o_tilde = [o("proposal", s, l) for s in range(num_samples)]
            o_final = [o_tilde[s] if o_tilde[s] > 0 else o("correction", s, l) for s in range(num_samples)]
            proposal_lp = [paths.proposal_draft_lps[a, s, : l + 1].sum() for s in range(num_samples)]
            final_lp = [proposal_lp[s] if o_tilde[s] > 0 else paths.correction_draft_lps[a, s, : l + 1].sum()
                        for s in range(num_samples)]
            confidence = [float(lp.detach()) if config.car_scale == "log" else float(lp.detach().exp())
                          for lp in proposal_lp]
            scores = [np.exp(c / config.car_temperature) for c in confidence]
            for s in range(num_samples):
                den = sum(o_final[j] for j in range(num_samples) if j != s)
                num = sum(o_final[j] * (o_tilde[j] > 0) for j in range(num_samples) if j != s)
                beta = num / den if den > 0 else 0.0
                zeta = scores[s] / sum(scores) * (num_samples if config.car_normalisation == "mean" else 1.0)
                correction = (beta * (zeta if config.use_car else 1.0)) if config.use_arw else 0.0
                total = total + o_final[s] * (final_lp[s] - correction * proposal_lp[s])
                weight += o_final[s]
        if weight > 0:
            per_anchor.append(total / weight)
    return -sum(per_anchor) / len(per_anchor)


TOY_CONFIGS = {
    "paper": ObjectiveConfig(),
    "car-mean-log": ObjectiveConfig(car_normalisation="mean", car_scale="log", car_temperature=2.0),
    "no-car": ObjectiveConfig(use_car=False),
}


def run_toy_em(config: ObjectiveConfig, sign: float = 1.0, seed: int = 11, check_reference: bool = True):
    """8 EM iterations of 10 Adam M-steps through `vsd_m_step`; each E-step's loss and gradient are
    checked against `reference_m_step_loss`. Returns the exact expected accepted length (eq. EA_def)
    before and after, and the mean share of kept proposals."""
    target_logprobs, draft_logits = toy_problem(seed)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam([draft_logits], lr=0.05)

    def accepted_length() -> float:
        return float(expected_accepted_length(target_logprobs.exp(), torch.softmax(draft_logits.detach(), -1)))

    start, pass_rates = accepted_length(), []
    for _ in range(8):
        paths = toy_e_step(target_logprobs, draft_logits, num_anchors=3, num_samples=12, gen=gen)
        samples = {k: getattr(paths, k).detach() for k in ("proposal_draft_lps", "correction_draft_lps")}
        proposal_ids, correction_ids = paths.proposal_ids, paths.correction_ids
        steps = torch.arange(target_logprobs.shape[0])
        for m_step in range(10):
            draft_logprobs = torch.log_softmax(draft_logits, -1)  # fresh log q of the fixed E-step paths
            paths.proposal_draft_lps = draft_logprobs[steps, proposal_ids]
            paths.correction_draft_lps = draft_logprobs[steps, correction_ids]
            loss, metrics = vsd_m_step(paths, config)
            if m_step == 0:
                pass_rates.append(metrics["oracle_pass_rate"])
                torch.testing.assert_close(paths.proposal_draft_lps.detach(), samples["proposal_draft_lps"])
                if check_reference:
                    reference = reference_m_step_loss(paths, config)
                    (got,) = torch.autograd.grad(loss, draft_logits, retain_graph=True)
                    (want,) = torch.autograd.grad(reference, draft_logits, retain_graph=True)
                    # zeta is computed in float32 (car_weights): agreement to ~1e-7, far below any real error
                    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-9)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
            optimizer.zero_grad()
            (sign * loss).backward()
            optimizer.step()
    return start, accepted_length(), float(np.mean(pass_rates))


@pytest.mark.parametrize("name", sorted(TOY_CONFIGS))
def test_toy_em_matches_the_paper_written_out_and_raises_accepted_length(name: str) -> None:
    start, end, pass_rate = run_toy_em(TOY_CONFIGS[name])
    assert end > start + 0.3, (start, end)
    assert 0.05 < pass_rate < 0.95  # both kept and corrected proposals are exercised


def test_toy_em_the_wrong_way_lowers_accepted_length() -> None:
    start, end_ascending_wrong_way, _ = run_toy_em(ObjectiveConfig(), sign=-1.0, check_reference=False)
    assert end_ascending_wrong_way < start, (start, end_ascending_wrong_way)


def test_oracle_diagnostics_on_hand_made_paths() -> None:
    proposal_log_kappa = torch.tensor([[[-0.1, -0.5], [0.0, -2.0]], [[0.0, 0.0], [-1.0, -1.0]]])
    greedy_log_kappa = torch.tensor([[0.0, 0.0], [-0.2, -0.3]])
    correction_passed = torch.tensor([[[True, False], [False, False]], [[True, True], [True, False]]])
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    got = oracle_diagnostics(proposal_log_kappa, greedy_log_kappa, correction_passed, mask)
    assert float(got["correction_pass_rate"]) == pytest.approx(4 / 8)
    assert float(got["greedy_kappa_one_rate"]) == pytest.approx(1 / 2)  # anchor 0's z_bar has kappa 1
    assert float(got["mean_log_kappa"]) == pytest.approx((-0.5 - 2.0 + 0.0 - 1.0) / 4)  # at l = L
    mask[1] = False  # an unused anchor counts in none of them
    got = oracle_diagnostics(proposal_log_kappa, greedy_log_kappa, correction_passed, mask)
    assert float(got["greedy_kappa_one_rate"]) == 1.0 and float(got["mean_log_kappa"]) == pytest.approx(-1.25)


# the paper's eq. EA_def in closed form for context-free drafts: the reference the estimators are checked against


def expected_accepted_length(target_step_probs: Tensor, draft_step_probs: Tensor) -> Tensor:
    """Exact eq. EA_def for context-free drafts: A(q) = E_{z~q}[sum_{k=1}^L S_k(x, z)].

    When every step's distributions do not depend on the earlier tokens, the tokens of z ~ q are
    independent, so E_q[S_k] = prod_{i<=k} E_{z_i~q_i}[min(1, p_i/q_i)] = prod_{i<=k} sum_v min(p_i, q_i).
    target_step_probs [..., L, V]: p_theta(. | step i);  draft_step_probs [..., L, V]: q_psi(. | step i)
    returns [...]
    """
    step_accept = torch.minimum(target_step_probs, draft_step_probs).sum(-1)  # [..., L] E[alpha_i]
    return step_accept.cumprod(-1).sum(-1)
