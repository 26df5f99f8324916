"""What `--drafter SPEC` names: none, random, ngram[:options], model:DRAFT_MODEL, default or a shipped drafter's
name, or a drafter folder; a neural drafter or a draft model gets n-gram branches in its trees unless asked not
to. The non-neural kinds (none, ngram, model:) register here by prefix (`register_proposer_spec`), as neural
architectures register in `mmvsd.drafter_base`; any other spec names a neural drafter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmvsd.decoding.cpu_kernels import pack_for_cpu
from mmvsd.drafter_base import Drafter, drafter_class, load_drafter
from mmvsd.drafters.draft_model import PREFIX as DRAFT_MODEL
from mmvsd.drafters.draft_model import check_draft_spec, load_draft_model, runnable_default
from mmvsd.drafters.hybrid import with_ngram
from mmvsd.drafters.ngram import NgramDrafter, parse_ngram_spec
from mmvsd.errors import UserError
from mmvsd.plugins import load_plugins
from mmvsd.shipped import resolve_drafter, shipped_drafter
from mmvsd.target_loader import builtin_targets


@dataclass(frozen=True)
class ProposerSpec:
    """A non-neural `--drafter` kind, named `PREFIX` or `PREFIX:OPTIONS`."""

    prefix: str
    build: Callable[[str, Any], Any]  # (the whole spec, the target) -> a proposer, or None (plain decoding)
    ngram_branches: bool = False  # whether n-gram branches join its trees (`--ngram`, on by default)
    check: Callable[[str], None] | None = None  # cheap validation before the target loads (UserError)
    as_default: Callable[[str, Any], str] | None = None  # a target's `default` spec of this kind, as it runs there


PROPOSER_SPECS: dict[str, ProposerSpec] = {}


def register_proposer_spec(kind: ProposerSpec) -> ProposerSpec:
    """Make `--drafter PREFIX[:OPTIONS]` build `kind`'s proposer."""
    PROPOSER_SPECS[kind.prefix] = kind
    return kind


def proposer_spec(spec: str) -> ProposerSpec | None:
    """The registered non-neural kind `spec` names (by the text before its first ':'), the plugins' included; None
    for a neural drafter."""
    load_plugins()
    return PROPOSER_SPECS.get(spec.partition(":")[0])


def drafter_from_spec(spec: str, target, seed: int = 0, ngram: bool | None = None):
    """What `--drafter` names: a registered non-neural kind's proposer (None for `none`: plain decoding), else
    `neural_drafter_from_spec`; n-gram branches join a neural drafter's or a draft model's trees unless `ngram`
    is False (None: on). Returns None, a `Drafter`, a `DraftModel`, an `NgramDrafter` or a `HybridDrafter`."""
    check_ngram_options(spec, ngram)
    builtin_default = target_default(spec, target.name)
    if builtin_default != spec:  # e.g. qwen2.5-coder-1.5b drafts with qwen2.5-coder-0.5b on int8 weights
        spec, default_kind = builtin_default, proposer_spec(builtin_default)
        if default_kind is not None and default_kind.as_default is not None:
            spec = default_kind.as_default(spec, target)
    kind = proposer_spec(spec)
    drafter = kind.build(spec, target) if kind is not None else neural_drafter_from_spec(spec, target, seed)
    if drafter is None or ngram is False or (kind is not None and not kind.ngram_branches):
        return drafter
    return with_ngram(drafter)


def target_default(spec: str, target_name: str) -> str:
    """`spec`, or for `default` the built-in target's default drafter spec when it names one (a draft model)."""
    builtin = builtin_targets().get(target_name)
    return builtin.default_drafter if spec == "default" and builtin is not None and builtin.default_drafter else spec


def check_drafter_spec(spec: str, target_name: str, ngram: bool | None = None) -> None:
    """UserError for a `--drafter` spec that names nothing, found without loading anything: a kind's options or
    `--ngram`, a drafter folder that is not there, a shipped drafter the target (as named) does not have."""
    spec = target_default(spec, target_name)
    check_ngram_options(spec, ngram)
    if proposer_spec(spec) is not None or spec == "random":
        return
    path = Path(spec).expanduser()
    if "/" in spec or path.exists():
        if not path.is_dir():
            raise UserError(f"--drafter {spec}: no such drafter folder")
        return
    shipped_drafter(spec, target_name)


def check_ngram_options(spec: str, ngram: bool | None) -> None:
    """UserError for settings that cannot apply to `--drafter spec` (cheap: call before loading)."""
    kind = proposer_spec(spec)
    if ngram and kind is not None and not kind.ngram_branches:
        raise UserError(f"--ngram on adds n-gram branches to a neural drafter's trees, and --drafter {spec} "
                        f"is not one (--drafter ngram drafts with n-grams alone; drop --ngram on)")
    if kind is not None and kind.check is not None:
        kind.check(spec)


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
    if target.engine != "stock":  # a CPU target on the exact kernels: its drafter on the packed kernels too
        pack_for_cpu(drafter, fp32=True)
    return drafter


def _no_options(spec: str) -> None:
    """`--drafter none` takes no options."""
    if spec != "none":
        raise UserError(f"--drafter {spec}: 'none' (plain decoding) takes no options")


register_proposer_spec(ProposerSpec("none", lambda spec, target: None, check=_no_options))
register_proposer_spec(ProposerSpec("ngram", lambda spec, target: NgramDrafter(parse_ngram_spec(spec)),
                                    check=parse_ngram_spec))
register_proposer_spec(ProposerSpec(DRAFT_MODEL.rstrip(":"), load_draft_model, ngram_branches=True,
                                    as_default=runnable_default, check=check_draft_spec))
