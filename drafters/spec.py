"""What `--drafter SPEC` names: none, random, ngram[:options], model:DRAFT_MODEL, default or a shipped drafter's
name, or a drafter folder; a neural drafter or a draft model gets n-gram branches in its trees unless asked not
to."""

from __future__ import annotations

from pathlib import Path

from mmvsd.decoding.engine import pack_for_cpu
from mmvsd.drafter_base import Drafter, drafter_class, load_drafter
from mmvsd.drafters.draft_model import PREFIX as DRAFT_MODEL
from mmvsd.drafters.draft_model import load_draft_model, runnable_default
from mmvsd.drafters.hybrid import with_ngram
from mmvsd.drafters.ngram import NgramDrafter, parse_ngram_spec
from mmvsd.errors import UserError
from mmvsd.shipped import resolve_drafter
from mmvsd.target_loader import builtin_targets


def drafter_from_spec(spec: str, target, seed: int = 0, ngram: bool | None = None):
    """What `--drafter` names: the n-gram (prompt-lookup) proposer for `ngram` or `ngram:key=value,...`, a draft
    model for `model:NAME|DIR|FILE.gguf`, else `neural_drafter_from_spec`, with n-gram branches in its trees
    unless `ngram` is False (None: on). Returns None (plain decoding), a `Drafter`, a `DraftModel`, an
    `NgramDrafter` or a `HybridDrafter`."""
    check_ngram_options(spec, ngram)
    builtin = builtin_targets().get(target.name)
    if spec == "default" and builtin is not None and builtin.default_drafter:
        spec = builtin.default_drafter  # e.g. qwen2.5-coder-1.5b drafts with qwen2.5-coder-0.5b on int8 weights
        if spec.startswith(DRAFT_MODEL):
            spec = runnable_default(spec, target)
    if spec == "none" or spec.partition(":")[0] == "ngram":
        return None if spec == "none" else NgramDrafter(parse_ngram_spec(spec))
    if spec.startswith(DRAFT_MODEL):
        drafter = load_draft_model(spec, target)
    else:
        drafter = neural_drafter_from_spec(spec, target, seed)
    if ngram is False:
        return drafter
    return with_ngram(drafter)


def check_ngram_options(spec: str, ngram: bool | None) -> None:
    """UserError for n-gram settings that cannot apply to `--drafter spec` (cheap: call before loading)."""
    if ngram and (spec == "none" or spec.partition(":")[0] == "ngram"):
        raise UserError(f"--ngram on adds n-gram branches to a neural drafter's trees, and --drafter {spec} "
                        f"is not one (--drafter ngram drafts with n-grams alone; drop --ngram on)")
    if spec.partition(":")[0] == "ngram":
        parse_ngram_spec(spec)


def neural_drafter_from_spec(spec: str, target, seed: int = 0) -> Drafter | None:
    """What `--drafter` names: None for `none` (plain decoding), an untrained EAGLE-3 drafter for
    `random`, the target's shipped drafter for `default` or a shipped name (e.g. `eagle3-ce`: a spec
    with no slash that is no folder here), else the drafter folder `spec`."""
    if spec == "none":
        return None
    if spec == "random":
        drafter = drafter_class("eagle3").from_target(target, seed=seed).eval()
    elif spec == "default" or ("/" not in spec and not Path(spec).exists()):
        drafter = load_drafter(resolve_drafter(spec, target.name), target)
    else:
        drafter = load_drafter(spec, target)
    if target.engine != "stock":  # a CPU target on the exact engine: its bf16 drafter on the packed kernels too
        pack_for_cpu(drafter)
    return drafter
