"""Teacher-forced top-1 agreement of drafters on held-out prompts' greedy continuations, pooled and per domain.

At every position of each continuation after its first token, the drafter's first unrolled step (as training
unrolls it, from the target's features) against the target's top-1: the trainer's per-step `acc_0_all`
(`objectives.ce_loss`, a label outside the draft vocabulary counted wrong), over held-out text instead of training
batches. `mmvsd eval-drafter --tree 4/3/1` counts the first token once per decoding step instead, and a step starts
only where the last chain ended, so the two differ by which positions they visit (docs/training.md, "The
continuation, read once"). One target forward per prompt over prompt + continuation; the continuations are the ones
eval-drafter cached for the same target, dtype, prompts and --max-new-tokens (generated here when absent).

    python -m mmvsd_studies.heldout_agreement --target smollm2-135m --prompt-file h60.jsonl --max-new-tokens 128 \
        --drafter eagle3-accept --drafter runs/cont --out agreement.json

`--split` also splits the same positions two ways: by the target's own top-1 probability there (full vocabulary,
bins `CONFIDENCE_EDGES`), so how much of the text the target writes near a tie and how often the drafter agrees in
each bin; and by what a bigram lookup (prompt lookup) proposes there, so how often the drafter copies what the
context already holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

from mmvsd.decoding.engines import DEFAULT_ENGINE, get_engine
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.eval.acceptance import cached_greedy_continuations, prompt_continuation_batch
from mmvsd.prompts import load_eval_prompts, prompt_domains
from mmvsd.training.config import ObjectiveConfig
from mmvsd.training.features import capture_features
from mmvsd.training.objectives import Unroll, ce_loss, label_rows
from mmvsd.training.unroll import shifted
from mmvsd_studies.study_stats import compare_arms, domain_indices, prompt_resamples


def _sum(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return total  # ce_loss's `mean` left as a sum: its metrics become counts


@torch.no_grad()
def agreement(target, drafter, prompts: list, continuations: list[list[int]]) -> list[dict[str, int]]:
    """Per prompt: the continuation positions scored and how many of them the drafter's top-1 matches."""
    rows = []
    for prompt, continuation in zip(prompts, continuations):
        batch = capture_features(target, prompt_continuation_batch(target, [prompt], [continuation]))
        unroll = Unroll(drafter, batch)
        _, counts = ce_loss(drafter, target, batch, ObjectiveConfig(ttt_steps=1), mean=_sum, unroll=unroll)
        rows.append({"positions": int(unroll.label_mask(0).sum()), "correct": round(counts["acc_0_all"])})
    return rows


CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)
LOOKUP_CLASSES = ("no match", "lookup right", "lookup wrong")


def lookup_classes(tokens: list[int], anchors: list[int], top1: list[int]) -> list[int]:
    """Per anchor t: what a bigram lookup (prompt lookup's n = 2) proposes for token t+2, the token that followed the
    latest earlier occurrence of tokens t, t+1, against the target's top-1 there: 0 no earlier occurrence, 1 the
    lookup proposes the target's top-1, 2 another token (`LOOKUP_CLASSES`)."""
    latest: dict[tuple[int, int], int] = {}  # bigram -> the token after its latest occurrence so far
    classes, done = [], 0
    for anchor, choice in zip(anchors, top1):
        for s in range(done, anchor):  # bigrams that end before the anchor's own
            latest[tokens[s], tokens[s + 1]] = tokens[s + 2]
        done = max(done, anchor)
        proposal = latest.get((tokens[anchor], tokens[anchor + 1]))
        classes.append(0 if proposal is None else 1 if proposal == choice else 2)
    return classes


@torch.no_grad()
def agreement_split(target, drafter, prompts: list, continuations: list[list[int]],
                    edges: tuple[float, ...] = CONFIDENCE_EDGES) -> dict[str, list[dict[str, list[int]]]]:
    """The positions `agreement` scores and how many the drafter matches, per prompt, split two ways (each split's
    row sums are `agreement`'s counts): "confidence", per bin of the target's top-1 probability at the label's
    position (bin k: edges[k] <= p < edges[k + 1], the last closed); "lookup", per `lookup_classes`."""
    rows: dict[str, list[dict[str, list[int]]]] = {"confidence": [], "lookup": []}
    inner = torch.tensor(edges[1:-1])
    for prompt, continuation in zip(prompts, continuations):
        batch = capture_features(target, prompt_continuation_batch(target, [prompt], [continuation]))
        unroll = Unroll(drafter, batch)
        labels, mask = unroll.target_labels(target), unroll.label_mask(0)
        counted = shifted(labels.top1_in_vocab, 1, False)[mask]  # as ce_loss: a top-1 outside the vocabulary is wrong
        correct = (unroll.draft_logprobs(0, 1).argmax(-1) == label_rows(labels.draft_logits.argmax(-1), 0, mask))
        full = torch.softmax(target.float_logits(batch.target_hidden), -1)  # [1, T, V]
        probability, choice = (label_rows(values, 0, mask) for values in full.max(-1))
        anchors = mask[0].nonzero()[:, 0].tolist()
        splits = {"confidence": (torch.bucketize(probability, inner, right=True), len(edges) - 1),
                  "lookup": (torch.tensor(lookup_classes(batch.tokens.input_ids[0].tolist(), anchors, choice.tolist()),
                                          dtype=torch.long), len(LOOKUP_CLASSES))}
        for name, (bins, count) in splits.items():
            rows[name].append({"positions": torch.bincount(bins, minlength=count).tolist(),
                               "correct": torch.bincount(bins[correct & counted], minlength=count).tolist()})
    return rows


def split_summary(rows: list[dict[str, list[int]]], domains: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per scope (as `summarise`): each bin's share of the positions and the drafter's agreement within it."""
    positions = np.array([row["positions"] for row in rows], dtype=float)  # [P, bins]
    correct = np.array([row["correct"] for row in rows], dtype=float)
    out = {}
    for scope, keep in _scopes(len(rows), domains).items():
        scored, matched = positions[keep].sum(0), correct[keep].sum(0)
        out[scope] = {"share": (scored / max(scored.sum(), 1)).tolist(),
                      "agreement": (matched / np.maximum(scored, 1)).tolist()}
    return out


def _scopes(num_prompts: int, domains: list[str]) -> dict[str, list[int]]:
    return {"all": list(range(num_prompts)), **domain_indices(domains)}


def _counts(rows: list[dict[str, int]]) -> tuple[np.ndarray, np.ndarray]:
    """([1, P] correct, [1, P] positions): study_stats' (numerator, denominator) layout."""
    return (np.array([[row["correct"] for row in rows]], dtype=float),
            np.array([[row["positions"] for row in rows]], dtype=float))


def summarise(rows: list[dict[str, int]], domains: list[str]) -> dict[str, float]:
    """Agreement pooled over positions ("all") and per domain (`domains[i]` names prompt i's; [] for none)."""
    correct, positions = _counts(rows)
    return {scope: float(correct[0, keep].sum() / max(positions[0, keep].sum(), 1))
            for scope, keep in _scopes(len(rows), domains).items()}


def versus(rows: list[dict[str, int]], baseline: list[dict[str, int]], domains: list[str],
           resamples_count: int = 2000, seed: int = 0) -> dict[str, list[float]]:
    """Per scope (as `summarise`): the difference in pooled agreement from `baseline`'s rows on the same prompts and
    its paired bootstrap 95% interval over prompts, [diff, low, high]."""
    arm, base = _counts(rows), _counts(baseline)
    out = {}
    for scope, keep in _scopes(len(rows), domains).items():
        compared = compare_arms(tuple(a[:, keep] for a in arm), tuple(b[:, keep] for b in base),
                                prompt_resamples(len(keep), resamples_count, seed))
        out[scope] = [compared["diff"], *compared["diff_ci95"]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompt-file", required=True, help="JSONL prompt file (with `domain` for figures per domain)")
    parser.add_argument("--drafter", action="append", required=True, help="a drafter folder or shipped name; repeat")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--split", action="store_true", help="also per bin of the target's top-1 probability "
                        "(CONFIDENCE_EDGES) and by what a bigram lookup proposes (LOOKUP_CLASSES)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    try:
        target = get_engine(DEFAULT_ENGINE).load_target(args.target, args.dtype, "cpu")
        prompts = load_eval_prompts(target, args.prompt_file)
        continuations = cached_greedy_continuations(target, prompts, args.max_new_tokens)
        domains = prompt_domains(args.prompt_file)
        result = {"prompt_file": args.prompt_file, "max_new_tokens": args.max_new_tokens, "domains": domains,
                  "drafters": {}}
        for spec in args.drafter:
            drafter = drafter_from_spec(spec, target, ngram=False)
            rows = agreement(target, drafter, prompts, continuations)
            entry = result["drafters"][spec] = {"agreement": summarise(rows, domains), "per_prompt": rows}
            line = "  ".join(f"{scope} {value:.3f}" for scope, value in entry["agreement"].items())
            if len(result["drafters"]) > 1:  # each later drafter against the first, paired over prompts
                first = next(iter(result["drafters"].values()))["per_prompt"]
                entry["vs_first"] = versus(rows, first, domains)
                line += "; minus the first: " + "  ".join(f"{scope} {d:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                                                         for scope, (d, lo, hi) in entry["vs_first"].items())
            print(spec, line, flush=True)
            if args.split:
                for name, split_rows in agreement_split(target, drafter, prompts, continuations).items():
                    names = ([f"[{lo:.1f},{hi:.1f})" for lo, hi in pairwise(CONFIDENCE_EDGES)]
                             if name == "confidence" else list(LOOKUP_CLASSES))
                    summary = entry[f"by_{name}"] = {"bins": names, "per_prompt": split_rows,
                                                     **split_summary(split_rows, domains)}
                    for scope in ["all", *sorted(set(domains))]:
                        print(f"  {scope}, by {name}: " + "  ".join(
                            f"{bin_name} {share:.2f} of positions, agreed {agreed:.2f}" for bin_name, share, agreed
                            in zip(names, summary[scope]["share"], summary[scope]["agreement"])), flush=True)
    except UserError as err:
        sys.exit(f"heldout_agreement: {err}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
