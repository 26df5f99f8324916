"""The VSD E-step: draft paths at anchor positions, target rollouts, and packed target scoring.

An anchor t of a training sequence is a committed pair (feature of position t, token t+1): the
prefix x is tokens[0..t+1], and a path z_1..z_L proposes tokens for positions t+2..t+1+L, exactly
as a depth-L chain of the draft tree would after the target committed token t+1.

Per anchor the E-step produces three kinds of paths, each with the target's and the drafter's
log-probability of every token:
    proposals    S paths sampled from the drafter q_psi (Alg. 1 line "z~ ~ q_psi")
    corrections  S paths sampled from the target p_theta (the replacement of a rejected proposal;
                 prefix l of correction s replaces prefix l of proposal s)
    greedy       the target's greedy path z_bar (the oracle's reference, Alg. 2)
Corrections are drawn from p_theta restricted to the draft vocabulary (renormalised): the drafter
cannot emit other tokens, so it could not learn from them; kappa still uses the full p_theta.
Every target log-probability is taken from fp32 logits (`Target.float_logits`), also for a bf16 target, and a
path stops at the answer's end (`path_mask`).
z_bar is the argmax over the draft vocabulary by default, or over the full vocabulary
(`greedy_full_vocab`); a z_bar token outside the draft vocabulary has q = 0, so its alpha is 1.

Cost: the target's rollouts take L-1 forwards of A*(S+1) tokens per row; the proposals are scored
by ONE packed forward over their distinct prefixes (a trie per anchor, tree-style mask over the
cached sequence); the drafter runs step 0 over the sequence plus L-1 forwards of A*(2S+1) nodes.

Shape letters: B batch, T sequence, A anchors per row, S samples, L path length, V target vocab,
Vd draft vocab, K slots per anchor, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmvsd.decoding.kv import RaggedCache, sequence_block
from mmvsd.drafter_base import Drafter, target_to_draft_ids
from mmvsd.target import Target
from mmvsd.training.features import FeatureBatch, TokenBatch, draft_step0_inputs, prefix_cache


@dataclass
class PathScores:
    """Paths at every anchor with per-token log-probabilities under both models."""

    token_ids: Tensor  # [B, A, S, L] target-vocabulary ids
    target_logprobs: Tensor  # [B, A, S, L] log p_theta(z_i | x, z_<i) (full vocabulary)
    draft_logprobs: Tensor | None = None  # [B, A, S, L] log q_psi(z_i | x, z_<i), with grad


def choose_anchors(tokens: TokenBatch, num_anchors: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random anchors t per row whose first drafted token (position t+2) is a loss token.

    Returns anchors [B, A] long (0 where unused) and anchor_valid [B, A] bool (rows with fewer
    eligible positions than A leave the rest invalid).
    """
    batch, width = tokens.input_ids.shape
    eligible = torch.zeros(batch, width, dtype=torch.bool)
    eligible[:, : max(width - 2, 0)] = tokens.loss_mask[:, 2:].cpu()
    scores = torch.rand(batch, width, generator=generator).masked_fill(~eligible, -1.0)
    num = min(num_anchors, width)
    top = scores.topk(num, dim=1)
    anchors, valid = top.indices, top.values >= 0
    if num < num_anchors:
        pad = num_anchors - num
        anchors = torch.cat([anchors, anchors.new_zeros(batch, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(batch, pad)], 1)
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    device = tokens.input_ids.device
    return anchors.to(device), valid.to(device)


def path_mask(tokens: TokenBatch, anchors: Tensor, anchor_valid: Tensor, path_length: int) -> Tensor:
    """[B, A, L] bool: whether path token l (position t+2+l of anchor t) is still inside the answer. A path stops
    at the answer's end: at the first position that is not a loss token (the end of the row, a next user turn),
    and every later token with it, so no path is scored where decoding would have stopped."""
    width = tokens.loss_mask.shape[1]
    positions = anchors[:, :, None] + 2 + torch.arange(path_length, device=anchors.device)  # [B, A, L]
    inside = positions < width
    answer = tokens.loss_mask.to(anchors.device).gather(1, positions.clamp(max=width - 1).flatten(1))
    answer = answer.view_as(positions) & inside
    return answer.long().cumprod(-1).bool() & anchor_valid[:, :, None]


def _gather_positions(values: Tensor, positions: Tensor) -> Tensor:
    """values [B, T, ...] at positions [B, A] -> [B, A, ...]."""
    index = positions.reshape(*positions.shape, *([1] * (values.dim() - 2)))
    return values.gather(1, index.expand(*positions.shape, *values.shape[2:]))


def _restricted_logits(logits: Tensor, in_draft_vocab: Tensor) -> Tensor:
    """Logits [..., V] with tokens outside the draft vocabulary set to -inf."""
    return logits.masked_fill(~in_draft_vocab, float("-inf"))


def _sample(logits: Tensor, num_samples: int, generator: torch.Generator) -> Tensor:
    """[..., V] logits -> [..., num_samples] token ids drawn with replacement (on the CPU RNG)."""
    probs = torch.softmax(logits.float(), dim=-1)
    flat = probs.reshape(-1, probs.shape[-1]).cpu()
    ids = torch.multinomial(flat, num_samples, replacement=True, generator=generator)
    return ids.reshape(*probs.shape[:-1], num_samples).to(logits.device)


def _slot_mask(num_slots: int, num_blocks: int, device: torch.device) -> Tensor:
    """[K, num_blocks*K] bool: slot k sees slot k in each of the depth blocks so far (a chain each)."""
    return torch.eye(num_slots, dtype=torch.bool, device=device).repeat(1, num_blocks)


@torch.no_grad()
def target_rollouts(
    target: Target, cache: RaggedCache, batch: FeatureBatch, anchors: Tensor, in_draft_vocab: Tensor,
    num_samples: int, path_length: int, generator: torch.Generator, greedy_full_vocab: bool = False,
) -> tuple[PathScores, PathScores]:
    """Sample S corrections and the greedy path z_bar from the target at every anchor.

    `cache` holds the target's KV of the whole batch (rows committed to their lengths); every new
    token sees the committed prefix up to its anchor's position t+1 and its own path.
    Corrections are drawn from p_theta restricted to `in_draft_vocab`; z_bar is the argmax over
    the same tokens, or over the whole vocabulary when `greedy_full_vocab`.
    Returns (corrections [B, A, S, L], greedy [B, A, 1, L]).
    """
    batch_size, num_anchors = anchors.shape
    slots = num_samples + 1  # S samples, then the greedy path
    logits = target.float_logits(_gather_positions(batch.target_hidden, anchors + 1))  # [B, A, V]
    logits = logits[:, :, None].expand(-1, -1, slots, -1)
    past_lens = (anchors + 2)[:, :, None].expand(-1, -1, slots).reshape(batch_size, -1)  # [B, A*K]
    token_ids, token_logprobs = [], []
    for depth in range(path_length):
        if depth == 0:  # every slot still shares the anchor's distribution: draw all S at once
            restricted = _restricted_logits(logits[:, :, 0], in_draft_vocab)  # [B, A, V]
            sampled = _sample(restricted, num_samples, generator)  # [B, A, S]
            greedy = (logits[:, :, 0] if greedy_full_vocab else restricted).argmax(-1)[:, :, None]  # [B, A, 1]
        else:
            restricted = _restricted_logits(logits, in_draft_vocab)  # [B, A, K, V]
            sampled = _sample(restricted[:, :, :num_samples], 1, generator)[..., 0]  # [B, A, S]
            greedy_logits = logits if greedy_full_vocab else restricted
            greedy = greedy_logits[:, :, num_samples].argmax(-1)[:, :, None]  # [B, A, 1]
        step_ids = torch.cat([sampled, greedy], dim=2)  # [B, A, K]
        token_ids.append(step_ids)
        token_logprobs.append(torch.log_softmax(logits.float(), -1).gather(-1, step_ids[..., None])[..., 0])
        if depth == path_length - 1:
            break
        flat_ids = step_ids.reshape(batch_size, -1)  # [B, A*K]
        block = _slot_mask(flat_ids.shape[1], depth + 1, flat_ids.device).expand(batch_size, -1, -1)
        out = target.forward(cache, flat_ids, torch.full_like(flat_ids, depth), block, need_aux=False,
                             past_lens=past_lens, logit_positions=flat_ids.new_zeros(batch_size, 0))
        logits = target.float_logits(out.last_hidden).reshape(batch_size, num_anchors, slots, -1)
    cache.drop_block()
    ids, logprobs = torch.stack(token_ids, -1), torch.stack(token_logprobs, -1)  # [B, A, K, L]
    corrections = PathScores(ids[:, :, :num_samples], logprobs[:, :, :num_samples])
    greedy_path = PathScores(ids[:, :, num_samples:], logprobs[:, :, num_samples:])
    return corrections, greedy_path


@dataclass
class DraftPass:
    """What the drafter computed in the E-step."""

    proposals: Tensor  # [B, A, S, L] sampled proposal token ids (target vocabulary)
    proposal_logprobs: Tensor  # [B, A, S, L] log q of each proposal token, with grad
    teacher_logprobs: Tensor  # [B, A, S', L] log q of each given (teacher-forced) path token, with grad
    step0_hidden: Tensor  # [B, T, H] drafter outputs of step 0 at every position


def draft_pass(
    drafter: Drafter, batch: FeatureBatch, anchors: Tensor, given_paths: Tensor, target_to_draft: Tensor,
    num_samples: int, path_length: int, generator: torch.Generator,
) -> DraftPass:
    """Sample S proposals per anchor from the drafter and score given paths, in one unrolled pass.

    given_paths [B, A, S', L] target ids (corrections and greedy paths); a token outside the draft
    vocabulary gets log q = -inf (the drafter cannot emit it) and is still fed to the next step;
    target_to_draft [V] long maps target ids to draft ids (-1 outside the draft vocabulary).
    Every depth runs one drafter forward over A*(S+S') nodes per row; each node sees the committed
    sequence up to its anchor t and its own path, at position t+depth.
    """
    tokens = batch.tokens
    batch_size, width = tokens.input_ids.shape
    num_anchors, num_given = anchors.shape[1], given_paths.shape[2]
    slots = num_samples + num_given
    dtype = next(drafter.parameters()).dtype
    device = tokens.input_ids.device
    cache = drafter.new_cache(batch_size, device)
    depths, causal = sequence_block(batch_size, width, device)
    features, next_ids, media = draft_step0_inputs(drafter, batch)
    step0 = drafter.read_target(features, next_ids, depths, cache.attention_mask(causal, dtype), cache,
                                media=media)  # [B, T, H]
    cache.keep(depths, tokens.lengths)
    hidden = _gather_positions(step0, anchors)[:, :, None].expand(-1, -1, slots, -1)  # [B, A, K, H]
    past_lens = (anchors + 1)[:, :, None].expand(-1, -1, slots).reshape(batch_size, -1)  # [B, A*K]
    given_draft = target_to_draft[given_paths]  # [B, A, S', L]
    proposals, proposal_lps, given_lps = [], [], []
    for depth in range(path_length):
        logprobs = drafter.draft_logprobs(hidden)  # [B, A, K, Vd]
        drawn = _sample(logprobs[:, :, :num_samples].detach(), 1, generator)[..., 0]  # [B, A, S]
        step_draft_ids = torch.cat([drawn, given_draft[..., depth].clamp(min=0)], dim=2)  # [B, A, K]
        step_lps = logprobs.gather(-1, step_draft_ids[..., None])[..., 0]
        outside = given_draft[..., depth] < 0  # [B, A, S'] given tokens the drafter cannot emit
        proposals.append(drafter.draft_to_target(drawn))
        proposal_lps.append(step_lps[:, :, :num_samples])
        given_lps.append(step_lps[:, :, num_samples:].masked_fill(outside, float("-inf")))
        if depth == path_length - 1:
            break
        step_target_ids = torch.cat([proposals[-1], given_paths[..., depth]], dim=2)  # [B, A, K]
        flat_ids = step_target_ids.reshape(batch_size, -1)  # [B, A*K]
        block = _slot_mask(flat_ids.shape[1], depth + 1, device).expand(batch_size, -1, -1)
        mask = cache.attention_mask(block, dtype, past_lens)
        positions = cache.positions(torch.full_like(flat_ids, depth), past_lens)
        hidden = drafter.read_draft(hidden.reshape(batch_size, -1, hidden.shape[-1]), flat_ids, positions, mask,
                                    cache).reshape(batch_size, num_anchors, slots, -1)
    return DraftPass(torch.stack(proposals, -1), torch.stack(proposal_lps, -1), torch.stack(given_lps, -1), step0)


@torch.no_grad()
def score_paths_packed(
    target: Target, cache: RaggedCache, batch: FeatureBatch, anchors: Tensor, paths: Tensor
) -> Tensor:
    """log p_theta of every token of every path [B, A, S, L], from ONE target forward.

    The distinct prefixes z_1..z_d (d < L) of each anchor's S paths form a trie; all tries of a row
    go into one forward with a tree-style mask over the cached sequence, each node seeing the
    sequence up to its anchor's position t+1 and its trie ancestors. Token 1 is scored from the
    sequence's own logits at t+1.
    """
    batch_size, num_anchors, num_samples, path_length = paths.shape
    first = target.float_logits(_gather_positions(batch.target_hidden, anchors + 1))  # [B, A, V]
    logprobs = [torch.log_softmax(first.float(), -1)[:, :, None].expand(-1, -1, num_samples, -1)
                .gather(-1, paths[..., :1])[..., 0]]
    if path_length == 1:
        return torch.stack(logprobs, -1)
    trie = _build_tries(paths, anchors)
    out = target.forward(cache, trie.token_ids, trie.depths, trie.ancestors, need_aux=False,
                         past_lens=trie.past_lens, logit_positions=trie.token_ids.new_zeros(batch_size, 0))
    cache.drop_block()
    node_logprobs = torch.log_softmax(target.float_logits(out.last_hidden), -1)  # [B, N, V]
    for depth in range(1, path_length):
        nodes = trie.node_of[..., depth - 1].reshape(batch_size, -1)  # [B, A*S] node of prefix z_<=depth
        rows = node_logprobs.gather(1, nodes[:, :, None].expand(-1, -1, node_logprobs.shape[-1]))
        next_ids = paths[..., depth].reshape(batch_size, -1, 1)
        logprobs.append(rows.gather(-1, next_ids)[..., 0].reshape(batch_size, num_anchors, num_samples))
    return torch.stack(logprobs, -1)


@dataclass
class _Tries:
    token_ids: Tensor  # [B, N] last token of each distinct prefix (padding nodes: 0)
    depths: Tensor  # [B, N] prefix length - 1
    ancestors: Tensor  # [B, N, N] bool ancestor-or-self mask (padding nodes see only themselves)
    past_lens: Tensor  # [B, N] committed tokens each node sees: anchor + 2
    node_of: Tensor  # [B, A, S, L-1] node index of prefix z_<=d+1 for each path


def _build_tries(paths: Tensor, anchors: Tensor) -> _Tries:
    """Deduplicate the prefixes of every anchor's paths into one flat node list per row."""
    batch_size, num_anchors, num_samples, path_length = paths.shape
    node_of = torch.zeros(batch_size, num_anchors, num_samples, path_length - 1, dtype=torch.long)
    rows = []
    for b in range(batch_size):
        token_ids, parents, depths, past_lens = [], [], [], []
        for a in range(num_anchors):
            parent_of_sample = torch.full((num_samples,), -1, dtype=torch.long)
            for d in range(path_length - 1):
                unique, inverse = torch.unique(paths[b, a, :, : d + 1].cpu(), dim=0, return_inverse=True)
                first_sample = torch.full((unique.shape[0],), num_samples, dtype=torch.long)
                first_sample.scatter_reduce_(0, inverse, torch.arange(num_samples), reduce="amin")
                base = len(token_ids)
                token_ids += unique[:, -1].tolist()
                parents += parent_of_sample[first_sample].tolist()
                depths += [d] * unique.shape[0]
                past_lens += [int(anchors[b, a]) + 2] * unique.shape[0]
                parent_of_sample = base + inverse
                node_of[b, a, :, d] = parent_of_sample
        rows.append((token_ids, parents, depths, past_lens))
    return _pad_tries(rows, node_of, paths.device)


def _pad_tries(rows: list[tuple[list[int], ...]], node_of: Tensor, device: torch.device) -> _Tries:
    """Stack per-row node lists into padded tensors with ancestor masks."""
    width = max(len(r[0]) for r in rows)
    batch_size = len(rows)
    token_ids = torch.zeros(batch_size, width, dtype=torch.long)
    depths = torch.zeros(batch_size, width, dtype=torch.long)
    past_lens = torch.zeros(batch_size, width, dtype=torch.long)
    ancestors = torch.eye(width, dtype=torch.bool).repeat(batch_size, 1, 1)
    for b, (ids, parents, node_depths, lens) in enumerate(rows):
        n = len(ids)
        token_ids[b, :n], depths[b, :n], past_lens[b, :n] = (torch.tensor(ids), torch.tensor(node_depths),
                                                             torch.tensor(lens))
        for node, parent in enumerate(parents):  # parents come before children
            if parent >= 0:
                ancestors[b, node] |= ancestors[b, parent]
    return _Tries(token_ids.to(device), depths.to(device), ancestors.to(device), past_lens.to(device),
                  node_of.to(device))


def _per_anchor(values: Tensor) -> Tensor:
    """[B, A, ...] -> [B*A, ...]: the M-step treats every anchor as one prefix x."""
    return values.flatten(0, 1)


@dataclass
class EStepPaths:
    """Everything the M-step needs, one row per anchor: [B*A, S, L] unless noted."""

    proposal_target_lps: Tensor  # log p_theta of proposal tokens
    proposal_draft_lps: Tensor  # log q_psi of proposal tokens, with grad
    correction_target_lps: Tensor  # log p_theta of correction tokens
    correction_draft_lps: Tensor  # log q_psi of correction tokens, with grad
    greedy_target_lps: Tensor  # [B*A, L] log p_theta of z_bar's tokens
    greedy_draft_lps: Tensor  # [B*A, L] log q_psi of z_bar's tokens (detached; -inf outside the draft vocab)
    mask: Tensor  # bool, False for the unused anchors of short rows and past the answer's end (`path_mask`)
    step0_hidden: Tensor  # [B, T, H] drafter step 0 at every position
    proposal_ids: Tensor | None = None  # target ids of the proposals (for the oracle's tie rule)
    correction_ids: Tensor | None = None  # target ids of the corrections
    greedy_ids: Tensor | None = None  # [B*A, L] target ids of z_bar


def _anchored(target: Target, batch: FeatureBatch, num_anchors: int,
              generator: torch.Generator) -> tuple[RaggedCache, Tensor, Tensor]:
    """The target's KV cache of the batch (captured with the features, else computed) and the random anchors
    [B, A] with their validity, where every E-step begins."""
    cache = batch.target_cache if batch.target_cache is not None else prefix_cache(target, batch.tokens)
    return (cache, *choose_anchors(batch.tokens, num_anchors, generator))


def _sample_mask(batch: FeatureBatch, anchors: Tensor, anchor_valid: Tensor, paths: Tensor) -> Tensor:
    """`path_mask` for every sample of `paths` [B, A, S, L], per anchor [B*A, S, L]."""
    return _per_anchor(path_mask(batch.tokens, anchors, anchor_valid, paths.shape[-1])[:, :, None].expand_as(paths))


def run_estep(drafter: Drafter, target: Target, batch: FeatureBatch, num_anchors: int, num_samples: int,
              path_length: int, generator: torch.Generator, greedy_full_vocab: bool = False) -> EStepPaths:
    """Anchors, target rollouts, drafter pass and packed scoring (module docstring)."""
    cache, anchors, anchor_valid = _anchored(target, batch, num_anchors, generator)
    target_to_draft = target_to_draft_ids(drafter, target.vocab_size)
    corrections, greedy = target_rollouts(target, cache, batch, anchors, target_to_draft >= 0, num_samples,
                                          path_length, generator, greedy_full_vocab)
    given = torch.cat([corrections.token_ids, greedy.token_ids], dim=2)
    drafted = draft_pass(drafter, batch, anchors, given, target_to_draft, num_samples, path_length, generator)
    proposal_target_lps = score_paths_packed(target, cache, batch, anchors, drafted.proposals)
    return EStepPaths(
        proposal_target_lps=_per_anchor(proposal_target_lps),
        proposal_draft_lps=_per_anchor(drafted.proposal_logprobs),
        correction_target_lps=_per_anchor(corrections.target_logprobs),
        correction_draft_lps=_per_anchor(drafted.teacher_logprobs[:, :, :num_samples]),
        greedy_target_lps=_per_anchor(greedy.target_logprobs)[:, 0],
        greedy_draft_lps=_per_anchor(drafted.teacher_logprobs[:, :, num_samples:]).detach()[:, 0],
        mask=_sample_mask(batch, anchors, anchor_valid, drafted.proposals),
        step0_hidden=drafted.step0_hidden,
        proposal_ids=_per_anchor(drafted.proposals),
        correction_ids=_per_anchor(corrections.token_ids),
        greedy_ids=_per_anchor(greedy.token_ids)[:, 0],
    )


@dataclass
class ProposalPaths:
    """The drafter's S proposals per anchor scored by both models, for estimators without an oracle: [B*A, S, L]."""

    target_lps: Tensor  # log p_theta of proposal tokens (fp32 logits, full vocabulary)
    draft_lps: Tensor  # log q_psi of proposal tokens, with grad
    mask: Tensor  # bool, as EStepPaths.mask


def sample_proposals(drafter: Drafter, target: Target, batch: FeatureBatch, num_anchors: int, num_samples: int,
                     path_length: int, generator: torch.Generator) -> ProposalPaths:
    """The proposals half of `run_estep` (no target rollouts, no z_bar): S drafted paths per anchor and their
    target log-probabilities from one packed forward."""
    cache, anchors, anchor_valid = _anchored(target, batch, num_anchors, generator)
    none_given = anchors.new_zeros(*anchors.shape, 0, path_length)
    drafted = draft_pass(drafter, batch, anchors, none_given, target_to_draft_ids(drafter, target.vocab_size),
                         num_samples, path_length, generator)
    target_lps = score_paths_packed(target, cache, batch, anchors, drafted.proposals)
    return ProposalPaths(_per_anchor(target_lps), _per_anchor(drafted.proposal_logprobs),
                         _sample_mask(batch, anchors, anchor_valid, drafted.proposals))
