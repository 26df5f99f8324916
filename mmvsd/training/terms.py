"""The registry of training-objective terms: one `Term` entry per term, from which everything else derives.

An objective is `TERM` or `TERM+TERM+...` over the registered terms (`--objective`, `TrainConfig.objective`):
alone, a term weighs 1; in a mixture each term weighs its `loss.*` field (`Term.weight_key`), or its fixed
`Term.weight` when it names none. So `ce+accept` is ce_weight * ce + accept_weight * accept, and registering a
term makes both `NAME` and `ce+NAME` valid objectives. The config's validation, `mmvsd train --objective`'s help,
the `--dry-run` plan (E-step paths, fp32 labels), the progress bar and docs/training.md's table of terms all read
this registry; the loss math lives in `objectives.py` (and `vsd.py`, `estep.py`).

This module stays light (no torch at import): the command line builds its help from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmvsd.errors import UserError
from mmvsd.plugins import load_plugins

if TYPE_CHECKING:
    from mmvsd.training.objectives import ObjectiveConfig

# (drafter, target, batch, config: ObjectiveConfig, generator, mean, unroll: objectives.Unroll) -> (loss, metrics)
TermLoss = Callable[..., tuple[Any, dict[str, float]]]
Objective = Callable[..., tuple[Any, dict[str, float]]]  # (drafter, target, batch, generator, mean) -> (loss, metrics)

# the scale pilot's choice (docs/training.md): ce+accept and ce+vsd tied with ce on T = 0 argmax acceptance at equal
# wall-clock time, and a tie goes to the cheaper objective (ce+accept had won the earlier studies' T = 1 metric)
DEFAULT_OBJECTIVE = "ce"
ESTEP_PROPOSALS, ESTEP_CORRECTIONS = "proposals", "proposals+corrections"  # the E-step paths a term samples


@dataclass(frozen=True)
class Term:
    """One loss term: how to compute it, what weighs it in a mixture, what it logs and what it costs."""

    name: str  # as objectives spell it: `--objective NAME` alone, `ce+NAME` mixed ("+" not allowed)
    loss: TermLoss
    summary: str  # one line: what it computes
    weight_key: str = ""  # the ObjectiveConfig field weighing it in a mixture ("": the fixed `weight`)
    weight: float = 1.0  # its weight in a mixture when `weight_key` is ""
    metrics: tuple[str, ...] = ()  # the metric keys it logs (train/KEY); KEY_i: one per unrolled step i
    progress: tuple[tuple[str, str], ...] = ()  # (metric key, label) shown on the progress bar
    estep: str = ""  # "" | ESTEP_PROPOSALS | ESTEP_CORRECTIONS: the E-step paths it samples (the plan sizes them)
    precise_labels: bool = False  # reads the target's LM head in fp32 (`objectives.Unroll.target_labels`)
    cost: str = ""  # one line: what a step of it costs, as measured (docs/training.md)


TERMS: dict[str, Term] = {}


def register_term(term: Term) -> Term:
    """Add `term` to the registry (a name already taken, or one with a "+", is a programming error)."""
    if "+" in term.name or not term.name:
        raise ValueError(f"a term's name cannot be empty or hold '+': {term.name!r}")
    if term.name in TERMS:
        raise ValueError(f"term {term.name!r} is registered already")
    TERMS[term.name] = term
    return term


def registered_terms() -> dict[str, Term]:
    """The registry, once the plugins (`mmvsd.plugins`) have added their terms: what every lookup reads."""
    load_plugins()
    return TERMS


def unregister_term(name: str) -> None:
    """Remove a registered term (tests that register a toy one)."""
    del TERMS[name]


def objective_terms(objective: str) -> list[Term]:
    """The terms of `objective` in the order they are computed (UserError on an unknown or repeated term)."""
    names, terms = objective.split("+"), registered_terms()
    unknown = [name for name in names if name not in terms]
    if unknown or len(set(names)) != len(names):
        raise UserError(f"unknown objective {objective!r}: write TERM or TERM+TERM+... (each once) over the terms "
                        f"{', '.join(terms)}; default {DEFAULT_OBJECTIVE} (docs/training.md)")
    return [terms[name] for name in names]


def term_weights(objective: str, config: ObjectiveConfig) -> dict[str, float]:
    """{term: weight} of `objective`: 1 for a term alone, else each term's weight (module docstring)."""
    terms = objective_terms(objective)
    if len(terms) == 1:
        return {terms[0].name: 1.0}
    return {t.name: float(getattr(config, t.weight_key)) if t.weight_key else t.weight for t in terms}


def check_objective(objective: str, config: ObjectiveConfig) -> None:
    """UserError for an unknown objective or weights with which it trains nothing."""
    weights = term_weights(objective, config)
    if not any(weights.values()):
        settings = ", ".join(f"loss.{TERMS[t].weight_key}=0" for t in weights if TERMS[t].weight_key)
        raise UserError(f"objective={objective} trains nothing with {settings}: give a term a weight > 0")


def make_objective(objective: str, config: ObjectiveConfig) -> Objective:
    """The objective `objective`: the sum of weight * term over its terms. A term of weight 0 is not computed, and
    the terms that read the drafter's unroll share one (`objectives.Unroll`). UserError on a bad name or config."""
    from mmvsd.training.distributed import batch_mean  # torch: loaded when a run builds its objective
    from mmvsd.training.objectives import Unroll  # torch: likewise

    config.validate()
    check_objective(objective, config)
    weights = term_weights(objective, config)
    terms = [TERMS[name] for name, weight in weights.items() if weight != 0]
    precise = any(term.precise_labels for term in terms)  # their fp32 head serves the other terms too

    def run(drafter, target, batch, generator, mean=batch_mean):
        total, metrics = None, {}
        unroll = Unroll(drafter, batch, precise_labels=precise)  # computed once, read by every unrolled term
        for term in terms:
            value, term_metrics = term.loss(drafter, target, batch, config, generator, mean, unroll)
            weighted = weights[term.name] * value
            total = weighted if total is None else total + weighted
            metrics.update(term_metrics)
        return total, metrics

    return run


def progress_labels() -> dict[str, str]:
    """{metric key: progress-bar label}: the loss, then what each registered term shows."""
    return {"loss": "loss", **{key: label for term in registered_terms().values() for key, label in term.progress}}


def objective_help() -> str:
    """`mmvsd train --objective`'s help."""
    return (f"{DEFAULT_OBJECTIVE} (default), or TERM or TERM+TERM over the terms {', '.join(registered_terms())} "
            f"(docs/training.md, Objectives)")


def objectives_markdown() -> str:
    """The table of terms docs/training.md shows (a test keeps the page equal to it)."""
    rows = ["| term | computes | weight in a mixture | logs | cost |", "|---|---|---|---|---|"]
    for term in registered_terms().values():
        weight = f"`loss.{term.weight_key}`" if term.weight_key else f"{term.weight:g}"
        logs = ", ".join(f"`{key}`" for key in term.metrics)
        rows.append(f"| `{term.name}` | {term.summary} | {weight} | {logs} | {term.cost} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- the built-in terms (math: objectives.py)


def _ce(drafter, target, batch, config, generator, mean, unroll):
    from mmvsd.training.objectives import ce_loss  # torch: loaded when a step runs

    return ce_loss(drafter, target, batch, config, mean, unroll)


def _vsd(drafter, target, batch, config, generator, mean, unroll):
    from mmvsd.training.objectives import vsd_loss  # torch: loaded when a step runs

    return vsd_loss(drafter, target, batch, config, generator, mean)  # its own paths, not the unroll


def _vsd_kl(drafter, target, batch, config, generator, mean, unroll):
    from mmvsd.training.objectives import topk_kl_loss  # torch: loaded when a step runs

    loss, metrics = _vsd(drafter, target, batch, config, generator, mean, unroll)
    if config.kl_alpha:
        kl, kl_metrics = topk_kl_loss(drafter, target, batch, config, mean, unroll)
        loss, metrics = loss + config.kl_alpha * kl, {**metrics, **kl_metrics}
    return loss, metrics


def _accept(drafter, target, batch, config, generator, mean, unroll):
    from mmvsd.training.objectives import accept_loss  # torch: loaded when a step runs

    return accept_loss(drafter, target, batch, config, mean, unroll)


def _vsd_rloo(drafter, target, batch, config, generator, mean, unroll):
    from mmvsd.training.objectives import vsd_rloo_loss  # torch: loaded when a step runs

    return vsd_rloo_loss(drafter, target, batch, config, generator, mean)


VSD_METRICS = ("vsd", "oracle_pass_rate", "correction_pass_rate", "final_pass_rate", "greedy_kappa_one_rate",
               "mean_log_kappa", "mean_beta", "zeta_peak", "zeta_entropy", "mean_correction", "num_anchors_used")
VSD_PROGRESS = (("oracle_pass_rate", "pass"), ("mean_beta", "beta"))
VSD_COST = ("an E-step per batch (S proposals and S corrections of L tokens per anchor, scored in one target "
            "forward): 1.6-2x a `ce` step on a CPU, 12-16x on an H200 at 13B")

for _term in (
    Term("ce", _ce, "EAGLE-3's training-time test: soft cross-entropy over `ttt_steps` unrolled draft steps",
         weight_key="ce_weight", metrics=("ce", "acc_i"), progress=(("acc_0", "acc"),),
         cost="one unroll of the drafter, the target's LM head in its own dtype"),
    Term("vsd", _vsd, "the paper's EM term alone: an ablation (the ELBO without its KL half)",
         weight_key="vsd_weight", metrics=VSD_METRICS, progress=VSD_PROGRESS, estep=ESTEP_CORRECTIONS, cost=VSD_COST),
    Term("vsd-kl", _vsd_kl, "vsd + `loss.kl_alpha` x top-K KL over the unroll: the paper's VSD (KL)",
         weight_key="vsd_weight", metrics=(*VSD_METRICS, "topk_kl", "topk_kl_i"), progress=VSD_PROGRESS,
         estep=ESTEP_CORRECTIONS, cost="vsd's, plus the unroll"),
    Term("accept", _accept, "exact acceptance sum_v min(p, q) along the unroll, maximised", weight_key="accept_weight",
         metrics=("accept", "accept_i"), progress=(("accept", "accept"),), precise_labels=True,
         cost="the target's LM head in fp32: a `ce+accept` step took 1.3-2.8x a `ce` step"),
    Term("vsd-rloo", _vsd_rloo, "VSD's proposals scored by kappa against a leave-one-out baseline, no oracle",
         weight_key="rloo_weight", metrics=("vsd_rloo", "rloo_score", "rloo_advantage_rms", "num_anchors_used"),
         progress=(("rloo_score", "rloo"),), estep=ESTEP_PROPOSALS,
         cost="an E-step of S proposals per anchor, no corrections: 1.3x a `ce` step on smol-llava"),
):
    register_term(_term)
