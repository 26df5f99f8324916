"""The loss terms of the training objectives and their knobs (`ObjectiveConfig`): batch -> loss plus metrics.

An objective is a weighted sum of terms (docs/training.md, "Objectives", has the formulas):
    ce       EAGLE-3 training-time test: sum_i decay^i * soft-CE(p_theta restricted to the draft
             vocab, q_psi) over `ttt_steps` unrolled steps, at loss positions whose target top-1
             token is in the draft vocabulary.
    vsd      the paper's EM term (Alg. 1): E-step paths at random anchors, M-step surrogate whose
             gradient is eq. "advance" (ARW beta, CAR zeta). It is the ELBO's E_q[log kappa] half
             only; the paper always adds it to an original loss that stands in for the KL half.
    topk_kl  sum_i decay^i * top-K renormalised KL(p^ || q^) (eq. klv) over the unrolled steps
             (`kl_depth=all`) or draft step 0 only (`kl_depth=first`).
    accept   - sum_i decay^i * mean acceptance sum_{v in draft vocab} min(p(v), q_i(v)) (1 - total
             variation, with p the full-vocabulary target distribution): the exact probability that a
             token the drafter samples is accepted, along the same unroll, no sampling.
    vsd_rloo VSD's proposals without its binary oracle: S drafted paths per anchor, each prefix scored by
             kappa (its acceptance probability) against the mean of the other S-1 (a leave-one-out
             baseline); with loss.rloo_score=kappa an unbiased gradient of the expected accepted length of
             the drafter's own chains.
Objectives are TERM or TERM+TERM over these terms, with their weights, metrics and costs, in the registry
`mmvsd.training.terms` (the paper's recipe is `ce+vsd`, ce + 0.1 * vsd; `vsd` alone is an ABLATION, the ELBO
without its KL half, never "VSD" as the paper trains it; `vsd-kl` is the paper's "VSD (KL)").
The objectives never look at which drafter they train: only the `Drafter` interface.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from mmvsd.drafter_base import Drafter
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.training.distributed import Mean, batch_mean
from mmvsd.training.estep import EStepPaths, run_estep, sample_proposals
from mmvsd.training.features import FeatureBatch, draft_step0_inputs
from mmvsd.training.unroll import shifted, unroll_draft_steps
from mmvsd.training.vsd import (
    CAR_NORMALISATIONS,
    CAR_SCALES,
    PATH_SCORES,
    car_weights,
    leave_one_out_acceptance,
    length_weights,
    oracle,
    oracle_diagnostics,
    path_log_kappa,
    prefix_logprobs,
    prefix_matches,
    rloo_surrogate,
    topk_renormalised_kl,
    vsd_surrogate,
)

# The paper's alpha = 0.1 (Implementation Details, LLM setting): `ce+vsd` is the original loss plus alpha times
# the VSD term, ce + 0.1 * vsd. The other reading, vsd + 0.1 * ce (loss.ce_weight=0.1 loss.vsd_weight=1), made the
# VSD gradient (2-5x CE's in norm) the whole update (docs/training.md, "ce+vsd").
PAPER_ALPHA = 0.1

KL_DEPTHS = ("all", "first")
ZBAR_VOCABS = ("draft", "full")


@dataclass
class ObjectiveConfig:
    """The knobs of every objective (the `loss:` block of TrainConfig)."""

    ttt_steps: int = 7
    ttt_decay: float = 0.8
    num_samples: int = 40  # S
    path_length: int = 7  # L (a training run's default: the depth of its eval_tree, the tree the drafter is used with)
    num_anchors: int = 4  # anchors per sequence
    length_weight_base: float = 1.05  # w(l) = base^l
    car_temperature: float = 0.2  # tau of CAR
    car_normalisation: str = "sum"  # sum: literal softmax over S | mean: S x softmax
    car_scale: str = "prob"  # prob: confidence q(z~) as eq. zeta_update | log: log q(z~)
    use_arw: bool = True
    use_car: bool = True
    zbar_vocab: str = "draft"  # z_bar = target argmax over the draft vocabulary | the full vocabulary
    kl_alpha: float = 0.1  # vsd-kl: weight of topk_kl
    kl_topk: int = 10
    kl_depth: str = "all"  # all: every unrolled step with ttt_decay | first: draft step 0 only
    # a term's weight in a mixture (a term alone weighs 1; mmvsd.training.terms)
    ce_weight: float = 1.0  # ce
    vsd_weight: float = PAPER_ALPHA  # vsd and vsd-kl (ce+vsd: the paper's alpha)
    accept_weight: float = 1.0  # accept
    rloo_weight: float = 1.0  # vsd-rloo
    rloo_score: str = "kappa"  # vsd_rloo's path score: kappa (expected accepted length) | log_kappa

    def validate(self) -> None:
        """Raise UserError on values no run can use (what an objective's weights train: `terms.check_objective`)."""
        choices = {"car_normalisation": CAR_NORMALISATIONS, "car_scale": CAR_SCALES, "kl_depth": KL_DEPTHS,
                   "zbar_vocab": ZBAR_VOCABS, "rloo_score": PATH_SCORES}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise UserError(f"loss.{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        for key in ("ttt_steps", "num_samples", "path_length", "num_anchors", "kl_topk"):
            if getattr(self, key) < 1:
                raise UserError(f"loss.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("ce_weight", "vsd_weight", "kl_alpha", "ttt_decay", "accept_weight", "rloo_weight"):
            if not getattr(self, key) >= 0:  # also refuses NaN
                raise UserError(f"loss.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("car_temperature", "length_weight_base"):
            if not getattr(self, key) > 0:
                raise UserError(f"loss.{key} must be > 0, got {getattr(self, key)}")


Metrics = dict[str, float]


@dataclass
class TargetLabels:
    """The target's side of a batch, as the unrolled terms read it."""

    draft_logits: Tensor  # [B, T, Vd] fp32 logits over the draft vocabulary
    top1_in_vocab: Tensor  # [B, T] whether a full-vocabulary top-1 (any of them, when tied) is in the draft vocabulary
    log_normaliser: Tensor | None  # [B, T] logsumexp over the full vocabulary (precise labels only)
    precise: bool  # computed from fp32 logits (`Target.float_logits`)

    def full_probs(self) -> Tensor:
        """[B, T, Vd] the target's full-vocabulary probabilities of the draft vocabulary's tokens (not
        renormalised over it)."""
        return (self.draft_logits - self.log_normaliser.unsqueeze(-1)).exp()


class Unroll:
    """One batch through the training-time test, shared by the terms that read it (ce, accept, topk_kl): an
    objective of several of them runs the drafter's unroll and LM head once, and the target's LM head once
    (`target_labels`). Step i at anchor t predicts token t+2+i; `label_mask(i)` marks the anchors whose label is
    a loss token, `draft_logprobs(i, n)` holds the drafter's log-probabilities there (rows in the mask's order).
    `precise_labels`: the target's head in fp32 from the start (an objective with `accept`, which needs it)."""

    def __init__(self, drafter: Drafter, batch: FeatureBatch, precise_labels: bool = False) -> None:
        self.drafter = drafter
        self.batch = batch
        self.precise_labels = precise_labels
        self._hiddens: list[Tensor] = []
        self._logprobs: dict[int, Tensor] = {}
        self._labels: TargetLabels | None = None

    def target_labels(self, target: Target, precise: bool = False) -> TargetLabels:
        """The target's logits over the draft vocabulary and what the terms read of the full ones, from one LM head
        over the batch. `precise` (or `precise_labels`): from fp32 logits, as acceptance needs (a bf16 head's
        logits carry ~0.1 nats of error); otherwise as the step computes (`Target.logits`: the target's dtype, or
        autocast's), a fraction of the fp32 head's cost on a CPU, enough for ce's soft labels. Precise labels, once
        made, serve every request."""
        precise = precise or self.precise_labels
        if self._labels is None or (precise and not self._labels.precise):
            hidden = self.batch.target_hidden
            logits = target.float_logits(hidden) if precise else target.logits(hidden)  # [B, T, V]
            draft = logits[..., self.drafter.draft_vocab_target_ids()]  # [B, T, Vd]
            # a maximum, not an argmax: a fifth of its time over a 152k vocabulary in bf16 on a CPU
            self._labels = TargetLabels(draft_logits=draft.float(), top1_in_vocab=draft.amax(-1) >= logits.amax(-1),
                                        log_normaliser=torch.logsumexp(logits, -1) if precise else None,
                                        precise=precise)
        return self._labels

    def hiddens(self, num_steps: int) -> list[Tensor]:
        """The hidden outputs [B, T, H] of the first `num_steps` steps (a longer unroll's prefix: step i reads
        no later step, so the first steps of any unroll are the same)."""
        if len(self._hiddens) < num_steps:
            features, next_ids, media = draft_step0_inputs(self.drafter, self.batch)
            self._hiddens = unroll_draft_steps(self.drafter, features, next_ids, num_steps, media)
            self._logprobs.clear()
        return self._hiddens[:num_steps]

    def label_mask(self, step: int) -> Tensor:
        """[B, T] whether token t+2+step, step `step`'s label at anchor t, is a loss token."""
        return shifted(self.batch.tokens.loss_mask, step + 2, False)

    def draft_logprobs(self, step: int, num_steps: int) -> Tensor:
        """[N, Vd] the drafter's log-probabilities at step `step` of a `num_steps` unroll over the N anchors of
        `label_mask(step)` (only the positions that count go through the draft LM head)."""
        hidden = self.hiddens(num_steps)[step]
        if step not in self._logprobs:
            self._logprobs[step] = self.drafter.draft_logprobs(hidden[self.label_mask(step)])
        return self._logprobs[step]


def label_rows(values: Tensor, step: int, mask: Tensor) -> Tensor:
    """values [B, T, ...] at position t+1+step for every anchor t of `mask` [B, T] (rows in the mask's order), read
    in place: the same rows as `shifted(values, step + 1)[mask]` without copying the shifted tensor. The mask's
    last step + 2 anchors must be False (`Unroll.label_mask` makes them so: their label lies past the sequence)."""
    width = max(values.shape[1] - step - 1, 0)  # a sequence shorter than step + 2 tokens has no labels at all
    if mask[:, width:].any():
        raise ValueError(f"label_rows: anchors in the last {step + 2} positions have no label at step {step}")
    return values[:, step + 1 :][mask[:, :width]]


def ce_loss(drafter: Drafter, target: Target, batch: FeatureBatch, config: ObjectiveConfig,
            mean: Mean = batch_mean, unroll: Unroll | None = None) -> tuple[Tensor, Metrics]:
    """EAGLE-3 training-time test with soft labels and per-step top-1 accuracy (`mean`: over this batch's
    positions, or over every process's, mmvsd.training.distributed)."""
    unroll = unroll or Unroll(drafter, batch)
    # step i at anchor t predicts token t+2+i, whose target distribution sits at position t+1+i
    labels = unroll.target_labels(target)
    top1_in_vocab = labels.top1_in_vocab  # [B, T]
    # each position's label distribution and top-1, once: step i reads position t+1+i of anchor t
    target_probs, target_top1 = torch.softmax(labels.draft_logits, -1), labels.draft_logits.argmax(-1)
    total = torch.zeros((), device=target_probs.device)
    metrics: Metrics = {}
    for step in range(config.ttt_steps):
        label = unroll.label_mask(step)
        # [N] per label anchor: a target top-1 outside the draft vocabulary has no label there, so its row weighs 0
        # (cheaper than gathering the other rows of the [N, Vd] log-probabilities and scattering their gradient)
        counted = shifted(top1_in_vocab, step + 1, False)[label]
        draft_logprobs = unroll.draft_logprobs(step, config.ttt_steps)  # [N, Vd]
        soft_ce = -(label_rows(target_probs, step, label) * draft_logprobs).sum(-1)  # [N]
        count = counted.sum()
        total = total + config.ttt_decay**step * mean((soft_ce * counted).sum(), count)
        correct = (draft_logprobs.argmax(-1) == label_rows(target_top1, step, label)) & counted
        metrics[f"acc_{step}"] = float(mean(correct.sum().float(), count))
        if step == 0:  # over every label, out-of-draft-vocabulary ones counted wrong: as public heads report it
            metrics["acc_0_all"] = float(mean(correct.sum().float(), label.sum()))
    metrics["ce"] = float(total.detach())
    return total, metrics


def vsd_loss(drafter: Drafter, target: Target, batch: FeatureBatch, config: ObjectiveConfig,
             generator: torch.Generator, mean: Mean = batch_mean) -> tuple[Tensor, Metrics]:
    """The VSD EM term (Alg. 1 with eq. advance) at `num_anchors` random anchors per row."""
    paths = run_estep(drafter, target, batch, config.num_anchors, config.num_samples, config.path_length, generator,
                      greedy_full_vocab=config.zbar_vocab == "full")
    return vsd_m_step(paths, config, mean)


@dataclass
class Oracles:
    """Alg. 2 applied to every (anchor, sample, length) of an E-step: [A, S, L] unless noted."""

    greedy_log_kappa: Tensor  # [A, L] log kappa(z_bar_<=l)
    proposal_log_kappa: Tensor
    proposal_oracle: Tensor  # o~
    correction_oracle: Tensor
    passed: Tensor  # bool, o~ > 0: the proposal is kept, else the correction replaces it
    final_oracle: Tensor  # o'


def estep_oracles(paths: EStepPaths, config: ObjectiveConfig) -> Oracles:
    """The oracle of proposals and corrections against z_bar; token-identical prefixes of z_bar pass."""
    weights = length_weights(paths.mask.shape[-1], config.length_weight_base, device=paths.mask.device)
    greedy_log_kappa = path_log_kappa(paths.greedy_target_lps, paths.greedy_draft_lps.detach())
    proposal_log_kappa = path_log_kappa(paths.proposal_target_lps, paths.proposal_draft_lps.detach())
    correction_log_kappa = path_log_kappa(paths.correction_target_lps, paths.correction_draft_lps.detach())
    has_ids = paths.greedy_ids is not None
    proposal_ties = prefix_matches(paths.proposal_ids, paths.greedy_ids) if has_ids else None
    correction_ties = prefix_matches(paths.correction_ids, paths.greedy_ids) if has_ids else None
    proposal_oracle = oracle(proposal_log_kappa, greedy_log_kappa, weights, paths.mask, proposal_ties)
    correction_oracle = oracle(correction_log_kappa, greedy_log_kappa, weights, paths.mask, correction_ties)
    passed = proposal_oracle > 0
    final_oracle = torch.where(passed, proposal_oracle, correction_oracle)
    return Oracles(greedy_log_kappa, proposal_log_kappa, proposal_oracle, correction_oracle, passed, final_oracle)


def vsd_m_step(paths: EStepPaths, config: ObjectiveConfig, mean: Mean = batch_mean) -> tuple[Tensor, Metrics]:
    """Oracle, final paths, ARW beta and CAR zeta for every (anchor, sample, length), then eq. advance."""
    oracles = estep_oracles(paths, config)
    passed = oracles.passed
    proposal_path_lps = prefix_logprobs(paths.proposal_draft_lps)
    final_path_lps = torch.where(passed, proposal_path_lps, prefix_logprobs(paths.correction_draft_lps))
    zeta = car_weights(proposal_path_lps, config.car_temperature, paths.mask, on_log_scale=config.car_scale == "log",
                       normalisation=config.car_normalisation)
    loss, raw = vsd_surrogate(
        final_path_lps, proposal_path_lps, final_oracle=oracles.final_oracle, proposal_passed=passed,
        beta=leave_one_out_acceptance(passed, oracles.final_oracle), zeta=zeta, mask=paths.mask,
        use_arw=config.use_arw, use_car=config.use_car, mean=mean,
    )
    raw.update(oracle_diagnostics(oracles.proposal_log_kappa, oracles.greedy_log_kappa,
                                  oracles.correction_oracle > 0, paths.mask))
    metrics = {k: float(v) for k, v in raw.items()}
    metrics["vsd"] = float(loss.detach())
    return loss, metrics


def vsd_rloo_loss(drafter: Drafter, target: Target, batch: FeatureBatch, config: ObjectiveConfig,
                  generator: torch.Generator, mean: Mean = batch_mean) -> tuple[Tensor, Metrics]:
    """VSD's proposals at `num_anchors` random anchors per row, scored against a leave-one-out baseline."""
    paths = sample_proposals(drafter, target, batch, config.num_anchors, config.num_samples, config.path_length,
                             generator)
    loss, raw = rloo_surrogate(paths.target_lps, paths.draft_lps, paths.mask, score=config.rloo_score, mean=mean)
    metrics = {k: float(v) for k, v in raw.items()}
    metrics["vsd_rloo"] = float(loss.detach())
    return loss, metrics


def topk_kl_loss(drafter: Drafter, target: Target, batch: FeatureBatch, config: ObjectiveConfig,
                 mean: Mean = batch_mean, unroll: Unroll | None = None) -> tuple[Tensor, Metrics]:
    """sum_i ttt_decay^i * mean top-K renormalised KL at unrolled step i (every step, or step 0 only).

    Step i at anchor t predicts token t+2+i, whose target distribution sits at position t+1+i, at
    the positions whose token t+2+i is a loss token (the same unrolling and decay as `ce`).
    """
    unroll = unroll or Unroll(drafter, batch)
    num_steps = config.ttt_steps if config.kl_depth == "all" else 1
    target_logits = unroll.target_labels(target).draft_logits  # [B, T, Vd]
    total = torch.zeros((), device=target_logits.device)
    metrics: Metrics = {}
    for step in range(num_steps):
        label = unroll.label_mask(step)
        kl = topk_renormalised_kl(label_rows(target_logits, step, label), unroll.draft_logprobs(step, num_steps),
                                  config.kl_topk)  # [N]
        step_kl = mean(kl.sum(), label.sum())
        total = total + config.ttt_decay**step * step_kl
        metrics[f"topk_kl_{step}"] = float(step_kl.detach())
    metrics["topk_kl"] = float(total.detach())
    return total, metrics


def acceptance(target_probs: Tensor, draft_logprobs: Tensor) -> Tensor:
    """[...] sum_v min(p(v), q(v)): the probability that a token sampled from q is accepted against p (speculative
    sampling's min(1, p/q) test), i.e. 1 - the total variation between them where q lives on the draft vocabulary
    and p is the target's full-vocabulary probability of those tokens."""
    return torch.minimum(target_probs, draft_logprobs.exp()).sum(-1)


def masked_acceptance(mask: Tensor, target_probs: Tensor, draft_logprobs: Tensor) -> Tensor:
    """[B, T] `acceptance` at the positions of `mask` ([N, V] rows in mask order), 0 elsewhere."""
    rates = torch.zeros(mask.shape, dtype=target_probs.dtype, device=target_probs.device)
    rates[mask] = acceptance(target_probs, draft_logprobs).to(rates.dtype)
    return rates


def step_distributions(drafter: Drafter, target: Target, batch: FeatureBatch, num_steps: int,
                       unroll: Unroll | None = None) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Per unrolled step i (the unroll of `ce`): (whether token t+2+i is a loss token [B, T], the target's
    full-vocabulary probabilities of the draft vocabulary at position t+1+i [N, Vd] (not renormalised), the
    drafter's log-probabilities at anchor t [N, Vd]), rows in the mask's order."""
    unroll = unroll or Unroll(drafter, batch)
    target_probs = unroll.target_labels(target, precise=True).full_probs()  # [B, T, Vd]
    for step in range(num_steps):
        mask = unroll.label_mask(step)
        yield mask, label_rows(target_probs, step, mask), unroll.draft_logprobs(step, num_steps)


def step_acceptance(drafter: Drafter, target: Target, batch: FeatureBatch, num_steps: int,
                    unroll: Unroll | None = None) -> list[tuple[Tensor, Tensor]]:
    """Per unrolled step i: (acceptance [B, T] of the drafter's distribution at anchor t for token t+2+i against
    the target's at position t+1+i, whether token t+2+i is a loss token [B, T]); the unroll of `ce`."""
    return [(masked_acceptance(mask, target_probs, draft_logprobs), mask)
            for mask, target_probs, draft_logprobs in step_distributions(drafter, target, batch, num_steps, unroll)]


def accept_loss(drafter: Drafter, target: Target, batch: FeatureBatch, config: ObjectiveConfig,
                mean: Mean = batch_mean, unroll: Unroll | None = None) -> tuple[Tensor, Metrics]:
    """- sum_i ttt_decay^i * mean acceptance at unrolled step i (the positions and unroll of `ce`, every loss
    position: a target top-1 outside the draft vocabulary is a token the drafter cannot propose, and counts)."""
    total = torch.zeros((), device=batch.target_hidden.device)
    metrics: Metrics = {}
    for step, (rates, mask) in enumerate(step_acceptance(drafter, target, batch, config.ttt_steps, unroll)):
        step_rate = mean(rates[mask].sum(), mask.sum())
        total = total - config.ttt_decay**step * step_rate
        metrics[f"accept_{step}"] = float(step_rate.detach())
    metrics["accept"] = float(-total.detach())
    return total, metrics

