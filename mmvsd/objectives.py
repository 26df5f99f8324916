"""Training objectives: each maps a feature batch to a scalar loss plus metrics.

Names and exactly what they compute (docs/objectives.md has the derivations):
    ce       EAGLE-3 training-time test: sum_i decay^i * soft-CE(p_theta restricted to the draft
             vocab, q_psi) over `ttt_steps` unrolled steps, at loss positions whose target top-1
             token is in the draft vocabulary.
    vsd      the paper's EM (Alg. 1): E-step paths at random anchors, M-step surrogate whose
             gradient is eq. "advance" (ARW beta, CAR zeta; switches use_arw / use_car).
    vsd-kl   vsd + kl_alpha * top-K renormalised KL(p^ || q^) (eq. klv) at every loss position
             of draft step 0: the paper's "VSD (KL)".
    ce+vsd   ce + vsd_weight * vsd: the paper's Implementation paragraph (the original objective
             plus the VSD term) for training on from a trained drafter.
The objectives never look at which drafter they train: only the `Drafter` interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mmvsd.drafter import Drafter, target_to_draft_ids
from mmvsd.errors import UserError
from mmvsd.estep import EStepPaths, run_estep
from mmvsd.features import FeatureBatch, draft_step0_inputs
from mmvsd.target import Target
from mmvsd.unroll import shifted, unroll_draft_steps
from mmvsd.vsd import (
    car_weights,
    leave_one_out_acceptance,
    length_weights,
    oracle,
    path_log_kappa,
    prefix_logprobs,
    topk_renormalised_kl,
    vsd_surrogate,
)


@dataclass
class ObjectiveConfig:
    """The knobs of every objective (TrainConfig copies them from its own fields)."""

    ttt_steps: int = 7
    ttt_decay: float = 0.8
    num_samples: int = 40  # S
    path_length: int = 7  # L
    num_anchors: int = 4  # anchors per sequence
    length_weight_base: float = 1.05  # w(l) = base^l
    car_temperature: float = 0.2  # tau of CAR
    use_arw: bool = True
    use_car: bool = True
    kl_alpha: float = 0.1
    kl_topk: int = 10
    vsd_weight: float = 1.0


Metrics = dict[str, float]
Objective = Callable[[Drafter, Target, FeatureBatch, torch.Generator], tuple[Tensor, Metrics]]


def draft_vocab_logits(target: Target, drafter: Drafter, target_hidden: Tensor) -> tuple[Tensor, Tensor]:
    """Target logits over the draft vocabulary [..., Vd] and whether the full top-1 is in it [...]."""
    logits = target.logits(target_hidden)  # [..., V]
    in_vocab = target_to_draft_ids(drafter, logits.shape[-1]) >= 0
    return logits[..., drafter.draft_vocab_target_ids()].float(), in_vocab[logits.argmax(-1)]


def ce_loss(drafter: Drafter, target: Target, batch: FeatureBatch, config: ObjectiveConfig) -> tuple[Tensor, Metrics]:
    """EAGLE-3 training-time test with soft labels and per-step top-1 accuracy."""
    tokens = batch.tokens
    features, next_ids, media = draft_step0_inputs(drafter, batch)
    hiddens = unroll_draft_steps(drafter, features, next_ids, config.ttt_steps, media)
    # step i at anchor t predicts token t+2+i, whose target distribution sits at position t+1+i
    target_logits, top1_in_vocab = draft_vocab_logits(target, drafter, batch.target_hidden)  # [B, T, Vd], [B, T]
    total = torch.zeros((), device=target_logits.device)
    metrics: Metrics = {}
    for step, hidden in enumerate(hiddens):
        step_logits = shifted(target_logits, step + 1)
        mask = shifted(tokens.loss_mask, step + 2, False) & shifted(top1_in_vocab, step + 1, False)
        draft_logprobs = drafter.draft_logprobs(hidden)  # [B, T, Vd]
        soft_ce = -(torch.softmax(step_logits, -1) * draft_logprobs).sum(-1)  # [B, T]
        count = mask.sum().clamp(min=1)
        total = total + config.ttt_decay**step * (soft_ce * mask).sum() / count
        correct = (draft_logprobs.argmax(-1) == step_logits.argmax(-1)) & mask
        metrics[f"acc_{step}"] = float(correct.sum() / count)
    metrics["ce"] = float(total.detach())
    return total, metrics


def vsd_loss(drafter: Drafter, target: Target, batch: FeatureBatch, config: ObjectiveConfig,
             generator: torch.Generator) -> tuple[Tensor, Metrics, Tensor]:
    """The VSD EM term (Alg. 1 with eq. advance); also returns the drafter's step-0 hidden states."""
    paths = run_estep(drafter, target, batch, config.num_anchors, config.num_samples, config.path_length, generator)
    loss, metrics = vsd_m_step(paths, config)
    return loss, metrics, paths.step0_hidden


def vsd_m_step(paths: EStepPaths, config: ObjectiveConfig) -> tuple[Tensor, Metrics]:
    """Oracle, final paths, ARW beta and CAR zeta for every (anchor, sample, length), then eq. advance."""
    weights = length_weights(paths.mask.shape[-1], config.length_weight_base, device=paths.mask.device)
    greedy_log_kappa = path_log_kappa(paths.greedy_target_lps, paths.greedy_draft_lps)
    proposal_oracle = oracle(path_log_kappa(paths.proposal_target_lps, paths.proposal_draft_lps.detach()),
                             greedy_log_kappa, weights, paths.mask)
    correction_oracle = oracle(path_log_kappa(paths.correction_target_lps, paths.correction_draft_lps.detach()),
                               greedy_log_kappa, weights, paths.mask)
    passed = proposal_oracle > 0  # o~ > 0: the proposal is kept, else the correction replaces it
    final_oracle = torch.where(passed, proposal_oracle, correction_oracle)  # o'
    proposal_path_lps = prefix_logprobs(paths.proposal_draft_lps)
    final_path_lps = torch.where(passed, proposal_path_lps, prefix_logprobs(paths.correction_draft_lps))
    loss, raw = vsd_surrogate(
        final_path_lps, proposal_path_lps, final_oracle=final_oracle, proposal_passed=passed,
        beta=leave_one_out_acceptance(passed, final_oracle),
        zeta=car_weights(proposal_path_lps, config.car_temperature, paths.mask), mask=paths.mask,
        use_arw=config.use_arw, use_car=config.use_car,
    )
    metrics = {k: float(v) for k, v in raw.items()}
    metrics["vsd"] = float(loss.detach())
    return loss, metrics


def topk_kl_loss(drafter: Drafter, target: Target, batch: FeatureBatch, step0_hidden: Tensor,
                 top_k: int) -> Tensor:
    """Mean top-K renormalised KL between target and draft step 0 at the loss positions."""
    target_logits, _ = draft_vocab_logits(target, drafter, shifted(batch.target_hidden, 1))
    mask = shifted(batch.tokens.loss_mask, 2, False)
    kl = topk_renormalised_kl(target_logits, drafter.draft_logprobs(step0_hidden), top_k)  # [B, T]
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def make_objective(name: str, config: ObjectiveConfig) -> Objective:
    """The objective called `name` (see the module docstring), closed over its config."""

    def ce(drafter, target, batch, generator):
        return ce_loss(drafter, target, batch, config)

    def vsd(drafter, target, batch, generator):
        loss, metrics, _ = vsd_loss(drafter, target, batch, config, generator)
        return loss, metrics

    def vsd_kl(drafter, target, batch, generator):
        loss, metrics, step0 = vsd_loss(drafter, target, batch, config, generator)
        kl = topk_kl_loss(drafter, target, batch, step0, config.kl_topk)
        metrics["topk_kl"] = float(kl.detach())
        return loss + config.kl_alpha * kl, metrics

    def ce_vsd(drafter, target, batch, generator):
        ce_value, metrics = ce_loss(drafter, target, batch, config)
        vsd_value, vsd_metrics, _ = vsd_loss(drafter, target, batch, config, generator)
        return ce_value + config.vsd_weight * vsd_value, {**metrics, **vsd_metrics}

    table = {"ce": ce, "vsd": vsd, "vsd-kl": vsd_kl, "ce+vsd": ce_vsd}
    if name not in table:
        raise UserError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVE_NAMES)}")
    return table[name]


OBJECTIVE_NAMES = ("ce", "vsd", "vsd-kl", "ce+vsd")
