"""Exact T = 0 acceptance of a drafter without a decode loop: replay the target's greedy continuation.

At T = 0 speculative decoding outputs the target's greedy continuation, whatever the drafter does, so
one causal target forward over prompt + continuation gives every target feature the decoder would
see. The walk then does what decoding does at each step: the drafter builds its tree from the
committed root (the same tree builder and session type as decoding), the accepted path is read off
the continuation by the same greedy rule as verification (`verify_greedy_choices`), the accepted
pairs advance the drafter's session, and the walk jumps to the next root. No target forward per step.

Glossary (as in `mmvsd.decoding.decode`): the *root* is the last committed token, which the target has not
seen; *accepted* draft tokens match the target's choices along a tree path; the *bonus* is the
target's own token after the accepted path. tau = new tokens / target forwards (the prefill is one
forward; tokens after EOS or beyond max_new_tokens are not counted), exactly `SequenceResult.tau`.

Shapes: B rows, P prompt length, L continuation length, W = max(P + L), N tree nodes, F feature width.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from mmvsd.adapter_base import padded_embeds, span_ids
from mmvsd.decoding.decode import (
    DecodeConfig,
    PromptLike,
    as_prompts,
    generate_each,
    make_shape,
    vanilla_generate,
)
from mmvsd.decoding.draft_session import DraftSession
from mmvsd.decoding.proposer import Proposer
from mmvsd.decoding.tree import DraftTree, ShapePlan, TreeShape, build_dynamic_tree
from mmvsd.decoding.verify import verify_greedy_choices
from mmvsd.drafter_base import Drafter, DraftInputs, PairMedia, target_to_draft_ids
from mmvsd.errors import UserError
from mmvsd.files import atomic_file, cache_root
from mmvsd.prompts import load_eval_prompts
from mmvsd.shipped import target_checksum
from mmvsd.target import Target
from mmvsd.training.config import TrainConfig
from mmvsd.training.features import TokenBatch, capture_features
from mmvsd.training.objectives import masked_acceptance, step_distributions
from mmvsd.training.unroll import shifted
from mmvsd.tree_options import tree_for_prompts

TIE_EPSILON = 1e-4  # a target choice whose top-2 logits are closer than this may flip between kernels


@dataclass
class PromptAcceptance:
    """One prompt's replayed decoding: the counters `SequenceResult` would report."""

    new_tokens: int
    target_forwards: int
    accept_lengths: list[int] = field(default_factory=list)  # tokens per target forward (prefill: 1)
    full_steps: list[int] = field(default_factory=list)  # draft tokens accepted per step the continuation's end
    # did not cut short (the steps `AcceptanceReport.accepted_counts` counts)

    @property
    def tau(self) -> float:
        return self.new_tokens / max(self.target_forwards, 1)


@dataclass(frozen=True)
class Tie:
    """A continuation token the target chose by a margin under the tie epsilon."""

    prompt: int  # prompt index
    position: int  # index in the continuation
    margin: float  # top-1 minus top-2 logit


@dataclass
class AcceptanceReport:
    """Acceptance of a drafter on prompts at one tree shape or shape plan (T = 0)."""

    shape: ShapePlan
    prompts: list[PromptAcceptance]
    accepted_counts: list[int]  # [depth + 1] tree steps that accepted exactly k draft tokens, k = 0..depth
    ties: list[Tie] = field(default_factory=list)
    num_mismatches: int = 0  # continuation tokens that are not the argmax of the one-forward logits
    num_out_of_vocab: int | None = 0  # continuation tokens (after the first) outside the draft vocabulary
    # (None: a proposer that may propose any token, e.g. n-gram lookup or its branches in a hybrid)
    nodes_verified: int = 0  # tree nodes (root included) over all rows' steps: the shape a plan chose
    seconds: float = 0.0
    tie_epsilon: float = TIE_EPSILON

    @property
    def tau(self) -> float:
        """Total new tokens / total target forwards (as `mmvsd bench` pools a benchmark)."""
        return sum(p.new_tokens for p in self.prompts) / max(sum(p.target_forwards for p in self.prompts), 1)

    @property
    def mean_tau(self) -> float:
        """Mean of the per-prompt tau values (as `mmvsd generate` prints them)."""
        return sum(p.tau for p in self.prompts) / max(len(self.prompts), 1)

    @property
    def draft_vocab_coverage(self) -> float | None:
        """Share of the continuation tokens a draft could propose (the first comes from the prefill)."""
        if self.num_out_of_vocab is None:
            return None
        draftable = sum(p.new_tokens - 1 for p in self.prompts)
        return 1.0 - self.num_out_of_vocab / max(draftable, 1)

    @property
    def mean_nodes_per_step(self) -> float:
        """Tree nodes verified per target forward, root included: the shape a plan chose."""
        return self.nodes_verified / max(sum(p.target_forwards for p in self.prompts), 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """[depth] share of tree steps that accepted at least d draft tokens, d = 1..depth."""
        total = max(sum(self.accepted_counts), 1)
        return [sum(self.accepted_counts[d:]) / total for d in range(1, len(self.accepted_counts))]

    def by_group(self, groups: list[str]) -> dict[str, dict]:
        """Figures per group of prompts (`groups[i]`: prompt i's, e.g. its domain chat, math or code), as public
        heads report them: tau, the share of full steps that accepted at least one draft token (`first_token`), and
        draft tokens accepted per full step (`accepted_per_step`: the depth-3 chain's figure under `--tree 4/3/1`)."""
        figures = {}
        for name in dict.fromkeys(groups):
            rows = [p for p, group in zip(self.prompts, groups) if group == name]
            steps = [accepted for p in rows for accepted in p.full_steps]
            figures[name] = {"num_prompts": len(rows), "num_steps": len(steps),
                             "tau": sum(p.new_tokens for p in rows) / max(sum(p.target_forwards for p in rows), 1),
                             "first_token": sum(a > 0 for a in steps) / max(len(steps), 1),
                             "accepted_per_step": sum(steps) / max(len(steps), 1)}
        return figures

    def to_dict(self) -> dict:
        return {
            "tau": self.tau, "mean_tau": self.mean_tau, "tree": shape_text(self.shape),
            "num_prompts": len(self.prompts), "new_tokens": sum(p.new_tokens for p in self.prompts),
            "target_forwards": sum(p.target_forwards for p in self.prompts),
            "acceptance_by_depth": self.acceptance_by_depth, "accepted_counts": self.accepted_counts,
            "tie_epsilon": self.tie_epsilon, "num_ties": len(self.ties), "ties": [asdict(t) for t in self.ties],
            "num_mismatches": self.num_mismatches, "draft_vocab_coverage": self.draft_vocab_coverage,
            "seconds": self.seconds,
            "mean_nodes_per_step": self.mean_nodes_per_step,
            "prompts": [{**asdict(p), "tau": p.tau} for p in self.prompts],
        }


# ----------------------------------------------------------------------------- continuations


def greedy_continuations(
    target: Target, prompts: list[PromptLike], max_new_tokens: int, batch_size: int = 8, temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """The target's own output per prompt (vanilla decoding: same EOS and length handling): greedy, or sampled at
    `temperature` > 0, prompt i alone with seed `seed + i` (a batch's rows would share one random stream, as
    decoding's per-request seeds do, and their samples would be correlated across prompts)."""
    config = DecodeConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    if temperature > 0:
        return [r.output_ids for r in generate_each(target, None, prompts, config)]
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        out += [r.output_ids for r in vanilla_generate(target, prompts[start : start + batch_size], config)]
    return out


def continuation_key(target: Target, prompts: list[PromptLike], max_new_tokens: int, sampling: tuple = ()) -> str:
    """sha256 of (target weights, EOS ids, prompts with their media embeddings, max_new_tokens[, sampling])."""
    digest = hashlib.sha256()
    header = {"target": target_checksum(target), "eos": sorted(target.eos_token_ids), "max_new": max_new_tokens}
    if sampling:
        header["sampling"] = list(sampling)
    digest.update(json.dumps(header, sort_keys=True).encode())
    for prompt in as_prompts(prompts):
        digest.update(json.dumps(prompt.token_ids).encode() + b"\n")
        if prompt.inputs_embeds is not None:
            digest.update(prompt.inputs_embeds.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def cached_greedy_continuations(
    target: Target, prompts: list[PromptLike], max_new_tokens: int, batch_size: int = 8,
    cache_dir: str | Path | None = None, temperature: float = 0.0, seed: int = 0,
) -> list[list[int]]:
    """`greedy_continuations` (or sampled ones, keyed by temperature and seed), read from (or written to) a cache
    under the mmvsd cache."""
    sampling = (float(temperature), seed, "per-prompt seeds") if temperature > 0 else ()
    key = continuation_key(target, prompts, max_new_tokens, sampling)
    path = Path(cache_dir) if cache_dir is not None else cache_root() / "continuations"
    path = path / f"{key[:40]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key and len(saved["continuations"]) == len(prompts):
            return saved["continuations"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: generate again
    continuations = greedy_continuations(target, prompts, max_new_tokens, batch_size, temperature, seed)
    with atomic_file(path) as handle:
        json.dump({"key": key, "target": target.name, "max_new_tokens": max_new_tokens,
                   "temperature": temperature, "continuations": continuations}, handle)
    return continuations


def prompt_continuation_batch(target: Target, prompts: list, continuations: list[list[int]]) -> TokenBatch:
    """Prompt + continuation per row, right-padded on the target's device (with the media a prompt carries);
    the loss mask is the continuation's tokens after its first (the first is the target's choice at prefill)."""
    prompt_lens = torch.tensor([len(p.token_ids) for p in prompts], dtype=torch.long)
    lengths = prompt_lens + torch.tensor([len(c) for c in continuations], dtype=torch.long)
    seq_ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for row, (prompt, cont) in enumerate(zip(prompts, continuations)):
        seq_ids[row, : int(lengths[row])] = torch.tensor(prompt.token_ids + list(cont))
    positions = torch.arange(seq_ids.shape[1])
    loss_mask = (positions > prompt_lens[:, None]) & (positions < lengths[:, None])
    seq_ids = seq_ids.to(target.device)
    embeds = padded_embeds(target, prompts, seq_ids)
    spans = span_ids(prompts, seq_ids.shape[1], target.device) if embeds is not None else None
    return TokenBatch(seq_ids, loss_mask.to(target.device), lengths.to(target.device), embeds, spans)


@dataclass
class ChainSteps:
    """Per anchor t and chain step i, teacher-forced along one continuation y ([B, T, depth] each)."""

    rates: Tensor  # a_i(t) = sum_v min(p, q_i): the probability that token i of a chain sampled at t passes
    ratios: Tensor  # r_i(t) = min(p, q_i)(y) / p(y) at the continuation's token y = y_{t+2+i} (0 outside the vocab)
    masks: Tensor  # bool: t is an anchor and token t+2+i lies in the continuation
    anchors: Tensor  # [B, T] bool


@torch.no_grad()
def chain_steps(target: Target, drafter: Drafter, prompts: list, continuations: list[list[int]],
                depth: int) -> ChainSteps:
    """`ChainSteps` from one target forward over prompt + continuation, the drafter unrolled as training unrolls it
    (`objectives.step_distributions`: its context is the continuation, not its own draws). An anchor is a position
    whose next-but-one token is a continuation token after the first."""
    batch = capture_features(target, prompt_continuation_batch(target, prompts, continuations))
    draft_ids = target_to_draft_ids(drafter, target.vocab_size).to(batch.tokens.input_ids.device)
    rates, ratios, masks = [], [], []
    for step, (mask, p, log_q) in enumerate(step_distributions(drafter, target, batch, depth)):
        ids = draft_ids[shifted(batch.tokens.input_ids, step + 2)[mask]]  # [N] the label's draft id, -1: none
        index = ids.clamp(min=0)[:, None]
        p_y = p.gather(-1, index)[:, 0].where(ids >= 0, 0.0)  # 0 outside the draft vocabulary: r = 0 there
        q_y = log_q.gather(-1, index)[:, 0].exp()
        ratio = torch.zeros(mask.shape, dtype=p.dtype, device=p.device)
        ratio[mask] = torch.where(p_y > 0, torch.minimum(p_y, q_y) / p_y, 0.0)
        rates.append(masked_acceptance(mask, p, log_q)), ratios.append(ratio), masks.append(mask)
    masks = torch.stack(masks, -1)
    return ChainSteps(torch.stack(rates, -1), torch.stack(ratios, -1), masks & masks[..., :1], masks[..., 0])


@dataclass(frozen=True)
class ChainAcceptance:
    """One prompt's expected acceptance along its continuation (`expected_acceptance`)."""

    total: float  # sum over the anchors of E(t), the sampled chain's expected accepted length (unbiased)
    forced_total: float  # sum over the anchors of prod-of-rates F(t), the teacher-forced approximation
    anchors: int
    step_rates: list[float]  # mean a_i of each step i over the anchors whose token t+2+i lies in the continuation


def expected_acceptance(
    target: Target, drafter: Drafter, prompts: list[PromptLike], continuations: list[list[int]], depth: int,
    batch_size: int = 8,
) -> list[ChainAcceptance]:
    """Per prompt, summed over its anchors t: the expected number of accepted tokens of a depth-`depth` chain that
    the drafter samples at t and speculative sampling (T = 1) verifies, estimated without bias from continuations
    the target sampled at T = 1, and the teacher-forced product of rates beside it.

    With a_i, r_i from `chain_steps` (0 past the continuation's end), P(the first k tokens pass) = sum over
    x_1..x_k of prod_i min(p, q_i)(x_i), and along y ~ p its unbiased estimate is r_1 ... r_{k-1} a_k (each
    r_i = min(p, q_i)(y_i) / p(y_i) reweights the target's token to an accepted draft's; a_k sums the last
    step out exactly). E(t) = sum_k r_1 ... r_{k-1} a_k. The product F(t) = sum_k a_1 ... a_k instead takes
    each later step's context from p, not from the accepted drafts' distribution min(p, q)/a: equal at depth 1,
    biased deeper, and in either direction, depending on the drafter (docs/training.md). Deterministic: the
    same drafter, prompts and continuations give the same numbers."""
    prompts = as_prompts(prompts)
    if len(prompts) != len(continuations):
        raise UserError(f"need one continuation per prompt, got {len(continuations)} for {len(prompts)} prompts")
    results: list[ChainAcceptance] = []
    for first in range(0, len(prompts), batch_size):
        rows = slice(first, first + batch_size)
        steps = chain_steps(target, drafter, prompts[rows], continuations[rows], depth)
        rates = torch.where(steps.masks, steps.rates, torch.zeros_like(steps.rates))
        reweight = torch.ones_like(rates[..., 0])  # r_1 ... r_{k-1}
        forced = torch.ones_like(reweight)  # a_1 ... a_k
        expected, forced_sum = torch.zeros_like(reweight), torch.zeros_like(reweight)
        for step in range(depth):
            expected = expected + reweight * rates[..., step]
            reweight = reweight * steps.ratios[..., step]
            forced = forced * rates[..., step]
            forced_sum = forced_sum + forced
        step_rates = rates.sum(1) / steps.masks.sum(1).clamp(min=1)  # [B, depth]
        for row in range(rates.shape[0]):
            anchors = steps.anchors[row]
            results.append(ChainAcceptance(float(expected[row][anchors].sum()), float(forced_sum[row][anchors].sum()),
                                           int(anchors.sum()), step_rates[row].tolist()))
    return results


# ----------------------------------------------------------------------------- evaluation


def check_eval_prompts(target: Target, prompts: list[PromptLike], max_new_tokens: int, shape: ShapePlan) -> None:
    """The checks `mmvsd generate` makes: prompts exist and fit the context with the draft tree."""
    if not prompts:
        raise UserError("no prompts to evaluate")
    for prompt in as_prompts(prompts):
        target.check_length(len(prompt.token_ids), max_new_tokens, shape.depth + 1)


@torch.no_grad()
def evaluate_acceptance(
    target: Target, drafter: Proposer, prompts: list[PromptLike], continuations: list[list[int]],
    shape: ShapePlan, batch_size: int = 8, tie_epsilon: float = TIE_EPSILON, progress: bool = False,
) -> AcceptanceReport:
    """Replay T = 0 tree decoding of `prompts` along their greedy `continuations`; tau and acceptance.

    Rows of a batch are independent for a `Drafter` and a fixed shape, so any `batch_size` gives
    generate's tau; proposers or shape plans that learn statistics across a batch's rows (n-gram
    branches, `--tree auto`) equal generate at batch size 1 with `batch_size=1`.
    """
    prompts = as_prompts(prompts)
    if not prompts or len(prompts) != len(continuations):
        raise UserError(f"need one continuation per prompt, got {len(continuations)} for {len(prompts)} prompts")
    if any(not c for c in continuations):
        raise UserError("an empty continuation: generate at least one token per prompt")
    for prompt in prompts:
        drafter.check_media(len(prompt.spans))
    start = time.perf_counter()
    report = AcceptanceReport(shape, [], [0] * (shape.depth + 1), tie_epsilon=tie_epsilon,
                              num_out_of_vocab=None if drafter.proposes_from_context else 0)
    chunks = range(0, len(prompts), batch_size)
    if progress:
        chunks = tqdm(chunks, desc="eval-drafter", unit="batch", dynamic_ncols=True)
    for first in chunks:
        rows = slice(first, first + batch_size)
        _evaluate_chunk(target, drafter, prompts[rows], continuations[rows], shape, tie_epsilon, first, report)
    report.seconds = time.perf_counter() - start
    return report


@dataclass
class _Replay:
    """One chunk's sequences and the target's view of them."""

    seq_ids: Tensor  # [B, W] prompt + continuation, right-padded with 0
    prompt_lens: Tensor  # [B]
    cont_lens: Tensor  # [B]
    features: Tensor  # [B, W, F] what the drafter reads at each position (`Drafter.target_features`)
    prompt_media: PairMedia | None  # media of the prefill pairs, as decoding builds them


def _evaluate_chunk(target, drafter, prompts, continuations, shape, tie_epsilon, first, report) -> None:
    """Capture one chunk's features, check the continuations, walk it, add to `report`."""
    replay, target_ids, margins = _capture(target, drafter, prompts, continuations)
    if report.num_out_of_vocab is not None:  # a drafter with a draft vocabulary (the first token: the prefill's)
        in_vocab = target_to_draft_ids(drafter, target.vocab_size) >= 0
        draftable = torch.tensor([tok for cont in continuations for tok in cont[1:]], dtype=torch.long)
        report.num_out_of_vocab += int((~in_vocab[draftable.to(in_vocab.device)]).sum())
    for row, cont in enumerate(continuations):
        base = int(replay.prompt_lens[row]) - 1  # the target chooses continuation[i] at position base + i
        chosen, margin = target_ids[row, base : base + len(cont)].tolist(), margins[row, base : base + len(cont)]
        report.num_mismatches += sum(a != b for a, b in zip(chosen, cont))
        for pos in (margin < tie_epsilon).nonzero().flatten().tolist():
            report.ties.append(Tie(first + row, pos, float(margin[pos])))
    report.prompts += _walk(drafter, replay, shape, report)


def _capture(target: Target, drafter: Proposer, prompts, continuations) -> tuple[_Replay, Tensor, Tensor]:
    """One batched causal target forward over prompt + continuation: features, argmax and top-2 margins."""
    tokens = prompt_continuation_batch(target, prompts, continuations)
    cont_lens = torch.tensor([len(c) for c in continuations], dtype=torch.long, device=target.device)
    batch = capture_features(target, tokens)
    features = drafter.target_features(batch.features, batch.target_hidden)
    target_ids, margins = _target_choices(target, batch.target_hidden)
    prompt_lens = tokens.lengths - cont_lens
    replay = _Replay(tokens.input_ids, prompt_lens, cont_lens, features,
                     _prefill_media(target, prompts, tokens.input_ids, prompt_lens))
    return replay, target_ids, margins


def _target_choices(target: Target, target_hidden: Tensor, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """Argmax [B, W] and top-1 minus top-2 logit [B, W], a few positions at a time (logits are [.., V])."""
    ids, margins = [], []
    for start in range(0, target_hidden.shape[1], chunk):
        top = target.logits(target_hidden[:, start : start + chunk]).float().topk(2, dim=-1)
        ids.append(top.indices[..., 0])
        margins.append(top.values[..., 0] - top.values[..., 1])
    return torch.cat(ids, 1).cpu(), torch.cat(margins, 1).cpu()


def _prefill_media(target: Target, prompts, seq_ids: Tensor, prompt_lens: Tensor) -> PairMedia | None:
    """The prefill pairs' media exactly as decoding builds them (prompts right-padded with id 0)."""
    width = int(prompt_lens.max())
    prompt_ids = seq_ids[:, :width].clone()
    prompt_ids[torch.arange(width, device=seq_ids.device)[None, :] >= prompt_lens[:, None]] = 0
    embeds = padded_embeds(target, prompts, prompt_ids)
    if embeds is None:
        return None
    return PairMedia.from_tokens(embeds, span_ids(prompts, width, embeds.device))


def draft_tree(roots: Tensor, session: DraftSession, shape: ShapePlan) -> DraftTree:
    """The one place the evaluator builds a draft tree (what decoding builds at this step)."""
    return build_dynamic_tree(roots, session, shape)


def _walk(drafter: Proposer, replay: _Replay, shape: ShapePlan, report: AcceptanceReport) -> list[PromptAcceptance]:
    """Replay tree decoding along the continuations; rows finish independently (ragged caches)."""
    seq_ids, prompt_lens, cont_lens = replay.seq_ids, replay.prompt_lens, replay.cont_lens
    batch, width = seq_ids.shape
    results = [PromptAcceptance(1, 1, [1]) for _ in range(batch)]  # the prefill emits continuation[0]
    session = drafter.new_session(batch)
    prompt_width = int(prompt_lens.max())
    session.advance(DraftInputs(replay.features[:, :prompt_width], seq_ids[:, 1 : prompt_width + 1], prompt_lens,
                                replay.prompt_media, first_ids=seq_ids[:, 0]))
    root_index = torch.zeros(batch, dtype=torch.long, device=seq_ids.device)  # continuation index of the root
    live = torch.arange(batch, device=seq_ids.device)  # original row of each session row
    while True:
        done = torch.tensor([results[r].new_tokens >= int(cont_lens[r]) for r in live.tolist()], dtype=torch.bool)
        if bool(done.all()):
            return results
        if bool(done.any()):
            keep = (~done).nonzero().flatten().to(seq_ids.device)
            session.select_rows(keep)
            live, root_index = live[keep], root_index[keep]
        root_pos = prompt_lens[live] + root_index  # [B'] sequence position of each root
        tree = draft_tree(seq_ids[live, root_pos], session, shape)
        verdict = verify_greedy_choices(tree, _continuation_choices(seq_ids[live], root_pos, tree, prompt_lens[live]
                                                                    + cont_lens[live]))
        shape.observe(tree, verdict)  # shape plans that learn acceptance learn it as in decoding
        report.nodes_verified += tree.num_nodes * len(live)
        num_accepted = verdict.num_accepted  # [B']
        session.advance(_accepted_pairs(seq_ids[live], replay.features[live], root_pos, num_accepted, width))
        _record_step(results, live, root_index, num_accepted, cont_lens, report.accepted_counts)
        root_index = root_index + num_accepted + 1


def _continuation_choices(seq_ids: Tensor, root_pos: Tensor, tree: DraftTree, seq_lens: Tensor) -> Tensor:
    """[B, N] the target's choice after each tree node if the path to it matches: the continuation
    token one deeper; -1 past the end of the continuation (nothing there can be accepted)."""
    pos = root_pos[:, None] + tree.depths + 1  # [B, N]
    ids = seq_ids.gather(1, pos.clamp(max=seq_ids.shape[1] - 1))
    return torch.where(pos < seq_lens[:, None], ids, torch.full_like(ids, -1))


def _accepted_pairs(seq_ids: Tensor, features: Tensor, root_pos: Tensor, num_accepted: Tensor,
                    width: int) -> DraftInputs:
    """Pairs decoding feeds after a step: features at root..last accepted, each with the next token."""
    num_new = num_accepted + 1  # [B]
    pos = root_pos[:, None] + torch.arange(int(num_new.max()), device=seq_ids.device)[None, :]  # [B, A]
    pos = pos.clamp(max=width - 1)
    picked = features.gather(1, pos[:, :, None].expand(-1, -1, features.shape[-1]))  # [B, A, F]
    return DraftInputs(picked, seq_ids.gather(1, (pos + 1).clamp(max=width - 1)), num_new)


def _record_step(results, live: Tensor, root_index: Tensor, num_accepted: Tensor, cont_lens: Tensor,
                 accepted_counts: list[int]) -> None:
    """Count one target forward per live row; tokens past the continuation's end are not emitted."""
    for row, start, accepted in zip(live.tolist(), root_index.tolist(), num_accepted.tolist()):
        result = results[row]
        emitted = min(accepted + 1, int(cont_lens[row]) - result.new_tokens)
        result.new_tokens += emitted
        result.target_forwards += 1
        result.accept_lengths.append(accepted + 1)
        if start + accepted + 1 < int(cont_lens[row]):  # a full step: the tree could have accepted deeper
            accepted_counts[accepted] += 1
            result.full_steps.append(accepted)


# ----------------------------------------------------------------------------- command line helpers


def shape_text(shape: ShapePlan) -> str:
    return f"{shape.budget}/{shape.depth}/{shape.topk}" if isinstance(shape, TreeShape) else "auto"


def format_report(report: AcceptanceReport, groups: list[str] | None = None) -> str:
    """A few human-readable lines: tau, acceptance by depth (and per group of prompts, `AcceptanceReport.by_group`),
    ties and the time taken."""
    by_depth = " ".join(f"{rate:.2f}" for rate in report.acceptance_by_depth)
    by_group = report.by_group(groups) if groups and len(set(groups)) > 1 else {}
    taus = [p.tau for p in report.prompts]
    lines = [
        (f"tau {report.tau:.3f} (mean per prompt {report.mean_tau:.3f}, min {min(taus):.2f}, max {max(taus):.2f}) | "
         f"tree {shape_text(report.shape)} | {len(report.prompts)} prompts, "
         f"{sum(p.new_tokens for p in report.prompts)} tokens, {sum(p.target_forwards for p in report.prompts)} "
         f"target forwards, {report.mean_nodes_per_step:.1f} nodes per step"),
        f"accepted >= d draft tokens, d = 1..{len(report.acceptance_by_depth)}: {by_depth}",
        *[f"  {name}: {g['num_prompts']} prompts, first token accepted {g['first_token']:.3f}, draft tokens accepted "
          f"per step {g['accepted_per_step']:.3f}, tau {g['tau']:.3f}" for name, g in by_group.items()],
        *([(f"the draft vocabulary holds {report.draft_vocab_coverage:.1%} of the continuation's tokens (after "
            "the first): no tree can accept the others")] if report.draft_vocab_coverage is not None else []),
        f"numerical ties (top-2 logit margin < {report.tie_epsilon:g}) on the greedy path: {len(report.ties)}"
        + (f"; continuation tokens that differ from the one-forward argmax: {report.num_mismatches}"
           if report.num_mismatches else ""),
        f"evaluated in {report.seconds:.1f} s",
    ]
    return "\n".join(lines)


class TauMonitor:
    """Validation tau while training: held-out prompts, their cached greedy continuations, one `--tree` spec (a
    fixed shape, checked now; or "auto", planned afresh for each evaluation from this machine's costs, one prompt
    at a time as `eval-drafter` replays it)."""

    def __init__(self, target: Target, prompt_spec: str, limit: int, max_new_tokens: int, tree: str,
                 batch_size: int = 8) -> None:
        self.target = target
        self.prompts = load_eval_prompts(target, prompt_spec, limit)
        self.tree = tree_for_prompts(tree, self.prompts)  # a TreeShape, or "auto"
        if isinstance(self.tree, TreeShape):
            check_eval_prompts(target, self.prompts, max_new_tokens, self.tree)
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size if isinstance(self.tree, TreeShape) else 1
        self.continuations: list[list[int]] | None = None  # generated (or read from the cache) on first use
        self.last_report: AcceptanceReport | None = None

    def __call__(self, drafter: Drafter) -> AcceptanceReport:
        """Acceptance of `drafter` now (evaluated in eval mode; its training mode is restored)."""
        if self.continuations is None:
            self.continuations = cached_greedy_continuations(self.target, self.prompts, self.max_new_tokens,
                                                             self.batch_size)
        shape = make_shape(self.tree, self.target, drafter)
        check_eval_prompts(self.target, self.prompts, self.max_new_tokens, shape)
        was_training = drafter.training
        drafter.eval()
        try:
            self.last_report = evaluate_acceptance(self.target, drafter, self.prompts, self.continuations, shape,
                                                   self.batch_size)
            return self.last_report
        finally:
            drafter.train(was_training)


def tau_monitor(config: TrainConfig, target: Target) -> TauMonitor:
    """The validation-tau evaluator of a training run (`train(..., validation=tau_monitor)`): the config's
    `eval_prompts`, `eval_limit`, `eval_max_new_tokens` and `eval_tree` on its placed target."""
    return TauMonitor(target, config.eval_prompts, config.eval_limit, config.eval_max_new_tokens, config.eval_tree)
