"""Pure tensor math of the Variational Speculative Decoding (VSD) objective.

Paper: "Variational Speculative Decoding", Sec. 3-4 and Appendix "Algorithm" (Alg. 1, Alg. 2).
Every function here is pure and batched; sampling, models and the EM loop live elsewhere.

Glossary (shape letters):
    A  anchors: training prefixes x at which paths are drafted
    S  latent proposals sampled per anchor (the paper's S, 40 by default)
    L  max path length (the paper's sampling length L, 7 by default); index l = 1..L
    V  vocabulary

Terms:
    proposal   z~^{(s)}_{<=l}  a path drafted by q_psi (the E-step's latent proposal)
    final      z^{(s)}_{<=l}   the proposal if the oracle keeps it, else a target-sampled correction
    kappa      path-level validity probability prod_i min(1, p_theta(z_i|.) / q_psi(z_i|.))
    oracle     o = w(l) * 1[log kappa(z) >= log kappa(z_bar)], z_bar the target's greedy path
    o~, o'     the oracle of the proposal and of the final path (Alg. 1, M-step)

Indexing choice: Alg. 1 writes prefixes as z_{<l} for l = 1..L; z_{<1} would be empty, so we read
z_{<l} as "the prefix of length l", i.e. tensor index [..., l-1] holds the path z_1..z_l.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmvsd.training.distributed import Mean, batch_mean

SAMPLE_DIM = 1  # the S axis of every [A, S, L] tensor


def path_log_kappa(
    target_token_logprobs: Tensor, draft_token_logprobs: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Cumulative log kappa of every prefix (eq. kappa_vi_polished / survival_def, in log space).

    target_token_logprobs [..., L]: log p_theta(z_i | x, z_<i) of each drafted token
    draft_token_logprobs  [..., L]: log q_psi(z_i | x, z_<i) of the same tokens
    mask                  [..., L]: True where the token exists (padding contributes log 1 = 0)
    returns               [..., L]: log kappa(x, z_<=l) = sum_{i<=l} min(0, log p - log q) = log S_l
    """
    log_alpha = (target_token_logprobs - draft_token_logprobs).clamp(max=0.0)  # log min(1, p/q)
    if mask is not None:
        log_alpha = log_alpha.masked_fill(~mask.bool(), 0.0)  # not a product: -inf * 0 would be NaN
    return log_alpha.cumsum(-1)


def prefix_logprobs(token_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Path log-probability of every prefix: log q(z_<=l | x) = sum_{i<=l} log q(z_i | x, z_<i).

    token_logprobs [..., L] -> [..., L]; masked tokens contribute 0. Keeps autograd.
    """
    if mask is not None:
        token_logprobs = token_logprobs * mask.to(token_logprobs.dtype)
    return token_logprobs.cumsum(-1)


def length_weights(
    num_lengths: int, base: float = 1.05, *, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Oracle length weight w(l) = base**l for l = 1..L (Implementation Details: w(l) := 1.05^l).

    Not normalised: eq. basic / advance already divide by the total oracle weight. With the
    paper's L = 7, w stays inside the stated bound 1 < w(l) < 2.
    returns [L]
    """
    lengths = torch.arange(1, num_lengths + 1, device=device, dtype=dtype)
    return torch.as_tensor(base, dtype=dtype, device=device) ** lengths


def prefix_matches(path_ids: Tensor, greedy_ids: Tensor) -> Tensor:
    """Whether each prefix z_<=l of a path is token-identical to z_bar_<=l.

    path_ids [A, S, L], greedy_ids [A, L] -> [A, S, L] bool (True up to the first differing token).
    """
    same = path_ids == greedy_ids.unsqueeze(SAMPLE_DIM)
    return same.long().cumprod(-1).bool()


def oracle(
    log_kappa: Tensor, greedy_log_kappa: Tensor, weights: Tensor, mask: Tensor | None = None,
    ties: Tensor | None = None,
) -> Tensor:
    """Alg. 2: o(z_<=l, x) = w(l) * 1[log kappa(x, z_<=l) >= log kappa(x, z_bar_<=l)], per prefix.

    The oracle is evaluated separately for every prefix length l and sample s (Alg. 1 loops over
    l and s); it is not combined over l here. The combination is the sum over (l, s) normalised by
    sum o' in eq. basic / advance, done in `vsd_surrogate`.
    Ties: a prefix token-identical to z_bar_<=l has exactly z_bar's kappa, so ">=" holds; in
    practice the two are scored in different forwards and their log-probs differ by ~1e-6, which
    would make an identical path fail about half the time. `ties` (from `prefix_matches`) marks
    those prefixes, and they pass.
    log_kappa        [A, S, L]: log kappa of each sampled path's prefixes (`path_log_kappa`)
    greedy_log_kappa [A, L]:    log kappa of the target's greedy path z_bar (p_theta^(1)) under the
                                same drafter, i.e. `path_log_kappa` on the greedy tokens
    weights          [L]:       w(l) from `length_weights`
    mask             [A, S, L]: False on padded prefixes (oracle 0 there)
    ties             [A, S, L]: True where the prefix is token-identical to z_bar's (passes)
    returns          [A, S, L]
    """
    passed = log_kappa >= greedy_log_kappa.unsqueeze(SAMPLE_DIM)
    if ties is not None:
        passed = passed | ties.bool()
    if mask is not None:
        passed = passed & mask.bool()
    return passed.to(weights.dtype) * weights


def leave_one_out_mean(values: Tensor, weights: Tensor | None = None, *, sample_dim: int = SAMPLE_DIM) -> Tensor:
    """For every sample s, the `weights`-weighted mean of `values` over the other samples j != s of its axis
    (weights default 1: the plain mean of the others); 0 where the others weigh nothing (S = 1). Detached.
    values, weights [..., S, ...] -> [..., S, ...]
    """
    values = values.detach().float()
    weights = torch.ones_like(values) if weights is None else weights.detach().float()
    num_samples = values.shape[sample_dim]
    others = 1.0 - torch.eye(num_samples, device=values.device)  # [S, S], 0 on the diagonal
    # sums over j != s without the cancellation error of "total minus own"
    numerator = torch.movedim(torch.movedim(weights * values, sample_dim, -1) @ others, -1, sample_dim)
    denominator = torch.movedim(torch.movedim(weights, sample_dim, -1) @ others, -1, sample_dim)
    has_others = denominator > 0
    mean = numerator / torch.where(has_others, denominator, torch.ones_like(denominator))
    return torch.where(has_others, mean, torch.zeros_like(mean))


def leave_one_out_acceptance(
    proposal_passed: Tensor, final_oracle: Tensor | None = None, *, sample_dim: int = SAMPLE_DIM
) -> Tensor:
    """ARW coefficient beta (eq. beta_update / beta): leave-one-out acceptance rate of the others.

    beta^{(l,s)} = sum_{j != s} o'^{(l,j)} o~^{(l,j)} / sum_{j != s} o'^{(l,j)}, over the S axis.
    Following the text under eq. beta, o~ is the *binary* validity of proposal j and o' the weight
    of final path j; with o' = 1 this is the plain mean acceptance of the other S-1 proposals.
    Where the denominator is 0 (S = 1, or no other final path passes) beta = 0: no evidence of
    reliability, so the proposal-correction term is annealed away (the paper's beta -> 0 regime).
    proposal_passed [A, S, (L)]: o~ > 0 (bool or 0/1)
    final_oracle    [A, S, (L)]: o' (default all ones); masked entries must be 0
    returns         [A, S, (L)], detached, in [0, 1]
    """
    return leave_one_out_mean(proposal_passed, final_oracle, sample_dim=sample_dim)


CAR_NORMALISATIONS = ("sum", "mean")
CAR_SCALES = ("prob", "log")


def car_weights(
    draft_proposal_path_logprobs: Tensor,
    temperature: float = 0.2,
    mask: Tensor | None = None,
    *,
    on_log_scale: bool = False,
    normalisation: str = "sum",
    sample_dim: int = SAMPLE_DIM,
) -> Tensor:
    """CAR weight zeta (eq. zeta_update): softmax over the S proposals of draft confidence / tau.

    zeta^{(l,s)} = exp(c^{(l,s)} / tau) / sum_j exp(c^{(l,j)} / tau). Eq. zeta_update writes the
    confidence c as q_psi(z~_<=l | x), the path *probability*, which is the default here; with
    on_log_scale=True c = log q_psi(z~_<=l | x) instead (much sharper: path log-probs differ by
    whole nats). Implementation Details: tau = 0.2.
    normalisation="sum" is the literal softmax (sums to 1 over S, so beta*zeta is ~beta/S);
    "mean" multiplies it by the number of unmasked samples (mean 1 over S, so CAR only
    redistributes the ARW correction among the samples instead of shrinking it by ~1/S).
    draft_proposal_path_logprobs [A, S, L]: log q_psi(z~^{(s)}_<=l | x)
    mask                         [A, S, L]: False on padded prefixes (weight 0, not in the sum)
    returns                      [A, S, L], detached (0 where all S are masked)
    """
    if normalisation not in CAR_NORMALISATIONS:
        raise ValueError(f"normalisation={normalisation!r} is not one of {CAR_NORMALISATIONS}")
    logprobs = draft_proposal_path_logprobs.detach().float()
    confidence = logprobs if on_log_scale else logprobs.exp()
    scores = confidence / temperature
    if mask is not None:
        scores = scores.masked_fill(~mask.bool(), float("-inf"))
    zeta = torch.nan_to_num(torch.softmax(scores, dim=sample_dim), nan=0.0)  # a column with every sample masked
    if normalisation == "mean":
        valid = torch.ones_like(zeta) if mask is None else mask.to(zeta.dtype)
        zeta = zeta * valid.sum(sample_dim, keepdim=True)
    return zeta


def vsd_surrogate(
    draft_final_path_logprobs: Tensor,
    draft_proposal_path_logprobs: Tensor,
    *,
    final_oracle: Tensor,
    proposal_passed: Tensor,
    beta: Tensor,
    zeta: Tensor,
    mask: Tensor | None = None,
    use_arw: bool = True,
    use_car: bool = True,
    mean: Mean = batch_mean,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss whose gradient is minus the control-variate gradient g_hat of eq. advance.

    Per anchor x:
        g_hat = 1/sum_{l,s} o' * sum_{l,s} o'^{(l,s)} [grad log q(z^{(s)}_<=l) - beta*zeta * grad log q(z~^{(s)}_<=l)]
    The correction term applies to every proposal, kept or not, exactly as eq. advance is written
    (for a kept proposal z = z~ and the terms partly cancel, as the ARW paragraph describes).
    loss = - mean over anchors with sum o' > 0 of the bracketed surrogate (`mean`: of this batch, or of every
    process's anchors under data parallelism), so descending the loss
    ascends g_hat. Oracle weights, beta and zeta are detached (they are E-step constants).
    Switches (ablation, Tab. ab1): use_arw=False sets beta*zeta = 0, giving eq. basic (the
    "standard gradient" that ignores rejected proposals; CAR then has no effect); use_car=False
    sets zeta = 1, so rejected proposals are weighted by beta alone.

    draft_final_path_logprobs    [A, S, L]: log q_psi(z^{(s)}_<=l | x), with grad
    draft_proposal_path_logprobs [A, S, L]: log q_psi(z~^{(s)}_<=l | x), with grad
    final_oracle                 [A, S, L]: o' (0 where the final path fails the oracle)
    proposal_passed              [A, S, L]: o~ > 0, for metrics only
    beta, zeta                   [A, S, L]: from `leave_one_out_acceptance`, `car_weights`
    mask                         [A, S, L]: False on padded prefixes
    returns loss [], metrics {oracle_pass_rate (proposals kept), final_pass_rate, mean_beta,
                              zeta_peak (S x max zeta: 1 uniform, S one-hot), zeta_entropy (nats: log S uniform),
                              mean_correction (beta*zeta as applied), num_anchors_used}
    """
    valid = torch.ones_like(final_oracle, dtype=torch.bool) if mask is None else mask.bool()
    final_weight = final_oracle.detach() * valid.to(final_oracle.dtype)  # [A, S, L]
    if use_arw:
        correction = beta.detach() * (zeta.detach() if use_car else torch.ones_like(zeta))
    else:
        correction = torch.zeros_like(beta)
    per_path = draft_final_path_logprobs - correction * draft_proposal_path_logprobs  # [A, S, L]
    weighted = (final_weight * per_path.masked_fill(~valid, 0.0)).flatten(1).sum(1)  # [A]
    total_weight = final_weight.flatten(1).sum(1)  # [A]
    used = total_weight > 0
    per_anchor = weighted / torch.where(used, total_weight, torch.ones_like(total_weight))
    num_used = used.sum()
    loss = -mean((per_anchor * used).sum(), num_used)
    metrics = _surrogate_metrics(proposal_passed, final_weight, beta, zeta, correction, valid, num_used)
    return loss, metrics


PATH_SCORES = ("kappa", "log_kappa")


def rloo_surrogate(
    target_token_logprobs: Tensor, draft_token_logprobs: Tensor, mask: Tensor, *, score: str = "kappa",
    mean: Mean = batch_mean,
) -> tuple[Tensor, dict[str, Tensor]]:
    """VSD without the binary oracle: every prefix of the S proposals is scored by its kappa against the mean
    score of the other S-1 proposals (a leave-one-out baseline, RLOO), and the loss is minus an unbiased
    estimate of the expected score of a path drawn from q_psi.

    With R_l(z) = kappa(z_<=l) (`score="kappa"`: the probability that speculative sampling accepts a drafted
    chain z's first l tokens, so sum_l R_l is its expected accepted length; `"log_kappa"`: log kappa, the
    ELBO's E_q[log kappa] half) the objective per anchor is J = E_{z~q}[sum_l R_l(z)], and kappa depends on q
    itself, so its gradient has two parts:
        grad J = E[sum_l R_l grad log q(z_<=l)] + E[sum_l grad_psi R_l]          (score function + pathwise)
    estimated from the S proposals with b_l^(s) = mean_{j != s} R_l(z^(j)) (independent of z^(s), so the
    estimate stays unbiased; S = 1 leaves b = 0):
        g_hat = 1/S sum_s sum_l [(R_l^(s) - b_l^(s)) grad log q(z^(s)_<=l) + grad_psi R_l^(s)].
    loss = - mean over anchors with an unpadded prefix of the bracket's surrogate (`mean`: this batch, or every
    process's anchors under data parallelism).
    target_token_logprobs [A, S, L]: log p_theta of each proposal token (full vocabulary, no grad)
    draft_token_logprobs  [A, S, L]: log q_psi of the same tokens, with grad
    mask                  [A, S, L]: False on padded prefixes (past the answer's end, unused anchors)
    returns loss [], metrics {rloo_score (mean per anchor of sum_l R_l: with kappa, the expected accepted length
                              of the proposals' chains), rloo_advantage_rms, num_anchors_used}
    """
    if score not in PATH_SCORES:
        raise ValueError(f"score={score!r} is not one of {PATH_SCORES}")
    valid = mask.bool()
    weight = valid.to(draft_token_logprobs.dtype)
    log_kappa = path_log_kappa(target_token_logprobs.detach(), draft_token_logprobs, valid)  # pathwise grad via q
    reward = log_kappa.exp() if score == "kappa" else log_kappa
    baseline = leave_one_out_mean(reward, weight)
    advantage = (reward.detach() - baseline) * weight
    path_logprobs = prefix_logprobs(draft_token_logprobs, valid)
    num_samples = valid.shape[SAMPLE_DIM]
    per_anchor = ((advantage * path_logprobs + reward * weight).flatten(1).sum(1)) / num_samples  # [A]
    used = valid.flatten(1).any(1)
    num_used = used.sum()
    loss = -mean((per_anchor * used).sum(), num_used)
    count = valid.sum().clamp(min=1)
    scores = (reward.detach() * weight).flatten(1).sum(1) / num_samples
    metrics = {
        "rloo_score": (scores * used).sum() / num_used.clamp(min=1),
        "rloo_advantage_rms": ((advantage.detach() ** 2).sum() / count).sqrt(),
        "num_anchors_used": num_used.detach(),
    }
    return loss, metrics


def _surrogate_metrics(
    proposal_passed: Tensor, final_weight: Tensor, beta: Tensor, zeta: Tensor, correction: Tensor, valid: Tensor,
    num_used: Tensor,
) -> dict[str, Tensor]:
    """Detached diagnostics of one surrogate evaluation, averaged over unpadded prefixes."""
    count = valid.sum().clamp(min=1)

    def mean(values: Tensor) -> Tensor:
        return (values.detach().float() * valid).sum() / count

    return {
        "oracle_pass_rate": mean(proposal_passed.bool()),
        "final_pass_rate": mean(final_weight > 0),
        "mean_beta": mean(beta),
        "zeta_peak": _zeta_peak(zeta, valid),
        "zeta_entropy": _zeta_entropy(zeta, valid),
        "mean_correction": mean(correction),
        "num_anchors_used": num_used.detach(),
    }


def _zeta_columns(zeta: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """zeta renormalised over the S samples of each (anchor, length) column [A, S, L], the number of samples in
    each column [A, 1, L], and which columns have any."""
    weights = (zeta.detach().float() * valid).clamp(min=0)
    total = weights.sum(SAMPLE_DIM, keepdim=True)
    probs = weights / total.clamp(min=1e-30)
    size = valid.sum(SAMPLE_DIM, keepdim=True)
    return probs, size, (total > 0).squeeze(SAMPLE_DIM)


def _zeta_peak(zeta: Tensor, valid: Tensor) -> Tensor:
    """Mean over columns of S x max_s zeta: 1 when CAR weighs the S proposals alike, S when one takes it all (the
    mean of zeta is 1/S whatever the weights, so it says nothing)."""
    probs, size, used = _zeta_columns(zeta, valid)
    peak = probs.amax(SAMPLE_DIM) * size.squeeze(SAMPLE_DIM)
    return (peak * used).sum() / used.sum().clamp(min=1)


def _zeta_entropy(zeta: Tensor, valid: Tensor) -> Tensor:
    """Mean over columns of the entropy of zeta (nats): log S when CAR weighs the S proposals alike, 0 when one
    takes it all."""
    probs, _, used = _zeta_columns(zeta, valid)
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(SAMPLE_DIM)
    return (entropy * used).sum() / used.sum().clamp(min=1)


def oracle_diagnostics(
    proposal_log_kappa: Tensor, greedy_log_kappa: Tensor, correction_passed: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """E-step diagnostics beside the surrogate's: how hard the oracle's reference z_bar is to beat.

    correction_pass_rate   share of corrections (target samples) that pass the oracle
    greedy_kappa_one_rate  share of anchors with kappa(z_bar_<=L) = 1 (then only kappa = 1 passes)
    mean_log_kappa         mean over proposals of log kappa of the whole path (z~_<=L, or up to the answer's end)
    proposal_log_kappa [A, S, L], greedy_log_kappa [A, L], correction_passed [A, S, L] bool,
    mask [A, S, L] bool (an anchor is used when any of its prefixes is)
    """
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    anchor_used = valid.flatten(1).any(1)  # [A]
    lengths = valid.long().sum(-1)  # [A, S] prefixes per path (a path may stop at the answer's end)
    last_valid = lengths > 0
    anchor_lengths = lengths.max(-1).values  # [A] (every sample of an anchor shares its mask)
    greedy_last_log_kappa = greedy_log_kappa.detach().gather(-1, (anchor_lengths - 1).clamp(min=0)[:, None])[:, 0]
    last_log_kappa = proposal_log_kappa.detach().gather(-1, (lengths - 1).clamp(min=0)[..., None])[..., 0]
    return {
        "correction_pass_rate": (correction_passed.bool() & valid).sum() / count,
        "greedy_kappa_one_rate": ((greedy_last_log_kappa >= 0) & anchor_used).sum()
        / anchor_used.sum().clamp(min=1),
        "mean_log_kappa": (last_log_kappa * last_valid).sum() / last_valid.sum().clamp(min=1),
    }


def topk_renormalised_kl(target_logits: Tensor, draft_logits: Tensor, k: int = 10) -> Tensor:
    """KL(p^_theta || q^_psi) over the target's top-K tokens, both renormalised (App. MLLM, eq. klv).

    Omega^ = the K most probable tokens under the target; p^ and q^ are p_theta and q_psi
    restricted to Omega^ and renormalised, i.e. softmax of the logits gathered at Omega^.
    The direction is target || draft, as eq. klv takes the expectation under p^. Eq. klv writes the
    cross-entropy -sum p^ log q^; this KL differs from it by the target entropy H(p^), a constant in
    the drafter's parameters, so the gradient is the same, and it is 0 when q^ = p^.
    The target is detached. Computed in float32. The caller applies alpha (0.1 in the paper).
    target_logits [..., V], draft_logits [..., V] -> [...]
    """
    top_ids = target_logits.detach().topk(min(k, target_logits.shape[-1]), dim=-1).indices  # [..., K]
    target_top_logprobs = torch.log_softmax(target_logits.detach().float().gather(-1, top_ids), dim=-1)
    draft_top_logprobs = torch.log_softmax(draft_logits.float().gather(-1, top_ids), dim=-1)
    return (target_top_logprobs.exp() * (target_top_logprobs - draft_top_logprobs)).sum(-1)
