"""The VSD E-step against naive computation: packed scoring, target rollouts, drafter pass, the whole
`run_estep`, the distributions paths are drawn from (chi-square), the oracle's tie rule, M-step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from mmvsd.drafter_base import DraftInputs, target_to_draft_ids
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.training.estep import EStepPaths, choose_anchors, draft_pass, run_estep, score_paths_packed, target_rollouts
from mmvsd.training.features import TokenBatch, capture_features
from mmvsd.training.objectives import ObjectiveConfig, estep_oracles, vsd_m_step
from mmvsd.training.vsd import car_weights, path_log_kappa, prefix_matches

VOCAB = 128


def make_batch(target, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 20), generator=gen)
    lengths = torch.tensor([20, 14])
    loss_mask = (torch.arange(20)[None] >= 5) & (torch.arange(20)[None] < lengths[:, None])
    tokens = TokenBatch(ids, loss_mask, lengths)
    return capture_features(target, tokens, keep_cache=True), gen


def full_logprobs(target, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(target.model(seq[None]).logits[0].float(), -1)


def test_anchors_are_distinct_loss_positions(tiny_target):
    batch, gen = make_batch(tiny_target)
    anchors, valid = choose_anchors(batch.tokens, 4, gen)
    assert valid.all()
    for b in range(2):
        assert len(set(anchors[b].tolist())) == 4
        assert all(batch.tokens.loss_mask[b, t + 2] for t in anchors[b].tolist())
    short = TokenBatch(batch.tokens.input_ids, batch.tokens.loss_mask & (torch.arange(20) < 8), batch.tokens.lengths)
    anchors, valid = choose_anchors(short, 6, gen)  # positions 5..7 are loss tokens: anchors 3..5 only
    assert valid.sum(1).tolist() == [3, 3] and sorted(anchors[0][valid[0]].tolist()) == [3, 4, 5]


def test_packed_scoring_equals_naive_per_path(tiny_target):
    batch, gen = make_batch(tiny_target)
    anchors, _ = choose_anchors(batch.tokens, 3, gen)
    paths = torch.randint(0, 3, (2, 3, 6, 4), generator=gen)  # few symbols: many shared prefixes
    paths[0, 0, 1] = paths[0, 0, 0]  # an exact duplicate path
    packed = score_paths_packed(tiny_target, batch.target_cache, batch, anchors, paths)
    for b in range(2):
        for a in range(3):
            t = int(anchors[b, a])
            for s in range(6):
                seq = torch.cat([batch.tokens.input_ids[b, : t + 2], paths[b, a, s, :-1]])
                ref = full_logprobs(tiny_target, seq)[t + 1 :].gather(-1, paths[b, a, s, :, None])[:, 0]
                torch.testing.assert_close(packed[b, a, s], ref, atol=2e-5, rtol=1e-4)
    # the cache is unchanged: the same scoring again gives the same numbers
    torch.testing.assert_close(score_paths_packed(tiny_target, batch.target_cache, batch, anchors, paths), packed)


def test_kappa_reads_fp32_logits_of_a_bf16_target(tiny_target):
    """A bf16 target's E-step log-probabilities come from its LM head computed in fp32 (bf16 logits are rounded
    to ~3 digits): the packed scores equal log-softmax of the fp32 head over the bf16 hidden states."""
    import copy

    target = copy.deepcopy(tiny_target)
    target.model.to(torch.bfloat16)
    batch, gen = make_batch(target)
    anchors, _ = choose_anchors(batch.tokens, 2, gen)
    paths = torch.randint(28, VOCAB, (2, 2, 3, 3), generator=gen)
    packed = score_paths_packed(target, batch.target_cache, batch, anchors, paths)
    head = target.model.get_output_embeddings().weight.float()
    for b in range(2):  # token 1 of every path is scored from the batch's own (bf16) hidden state at t+1
        for a in range(2):
            hidden = batch.target_hidden[b, int(anchors[b, a]) + 1].float()
            exact = torch.log_softmax(hidden @ head.T, -1)[paths[b, a, :, 0]]
            torch.testing.assert_close(packed[b, a, :, 0], exact)
            rounded = torch.log_softmax(target.logits(batch.target_hidden[b, int(anchors[b, a]) + 1]).float(), -1)
            assert not torch.equal(rounded[paths[b, a, :, 0]], exact)
    first = torch.log_softmax(target.float_logits(batch.target_hidden[:, :1]), -1)
    torch.testing.assert_close(first, torch.log_softmax(batch.target_hidden[:, :1].float() @ head.T, -1))
    assert target.float_logits(batch.target_hidden).dtype == torch.float32
    assert not torch.equal(target.float_logits(batch.target_hidden), target.logits(batch.target_hidden).float())


def test_target_rollouts_sample_the_draft_vocab_and_score_like_naive(tiny_target):
    batch, gen = make_batch(tiny_target, seed=1)
    anchors, _ = choose_anchors(batch.tokens, 2, gen)
    in_vocab = torch.zeros(VOCAB, dtype=torch.bool)
    in_vocab[torch.arange(0, VOCAB, 2)] = True  # even ids only
    corrections, greedy = target_rollouts(tiny_target, batch.target_cache, batch, anchors, in_vocab, 5, 4, gen)
    assert corrections.token_ids.shape == (2, 2, 5, 4) and greedy.token_ids.shape == (2, 2, 1, 4)
    assert (corrections.token_ids % 2 == 0).all() and (greedy.token_ids % 2 == 0).all()
    for b in range(2):
        for a in range(2):
            t = int(anchors[b, a])
            prefix = batch.tokens.input_ids[b, : t + 2]
            seq = prefix.clone()  # greedy over the even ids, one token at a time
            for _ in range(4):
                logprobs = full_logprobs(tiny_target, seq)[-1]
                seq = torch.cat([seq, logprobs.masked_fill(~in_vocab, -torch.inf).argmax()[None]])
            assert greedy.token_ids[b, a, 0].tolist() == seq[t + 2 :].tolist()
            for s in range(5):
                path = corrections.token_ids[b, a, s]
                ref = (full_logprobs(tiny_target, torch.cat([prefix, path[:-1]]))[t + 1 :]
                       .gather(-1, path[:, None])[:, 0])
                torch.testing.assert_close(corrections.target_logprobs[b, a, s], ref, atol=2e-5, rtol=1e-4)


def test_draft_pass_matches_decoding_session_token_by_token(tiny_target):
    """Teacher-forced E-step log-probs equal what the decoder's DraftSession computes for that chain."""
    batch, gen = make_batch(tiny_target, seed=2)
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=VOCAB, seed=3)
    anchors, _ = choose_anchors(batch.tokens, 2, gen)
    given = torch.randint(0, VOCAB, (2, 2, 3, 4), generator=gen)
    identity = torch.arange(VOCAB)
    drafted = draft_pass(drafter, batch, anchors, given, identity, 4, 4, gen)
    assert drafted.proposals.shape == (2, 2, 4, 4) and drafted.teacher_logprobs.shape == (2, 2, 3, 4)
    next_ids = torch.cat([batch.tokens.input_ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
    for b in range(2):
        for a in range(2):
            t = int(anchors[b, a])
            for s, path in enumerate([*given[b, a], *drafted.proposals[b, a]]):
                session = drafter.new_session(1)
                session.advance(DraftInputs(batch.features[b : b + 1, : t + 1], next_ids[b : b + 1, : t + 1],
                                            torch.tensor([t + 1])))
                hidden, reference = session.last_hidden, []
                for depth in range(4):
                    logprobs = drafter.draft_logprobs(hidden)[0]
                    reference.append(logprobs[path[depth]])
                    if depth < 3:
                        session.frontier_hidden = hidden[:, None]
                        session.expand(path[depth].view(1, 1), torch.zeros(1, 1, dtype=torch.long),
                                       torch.ones(1, 1, depth + 1, dtype=torch.bool), 1)
                        hidden = session.frontier_hidden[:, 0]
                got = drafted.teacher_logprobs[b, a, s] if s < 3 else drafted.proposal_logprobs[b, a, s - 3]
                torch.testing.assert_close(got.detach(), torch.stack(reference).detach(), atol=2e-5, rtol=1e-4)


def test_m_step_matches_a_direct_loop_over_anchors_samples_and_lengths():
    """vsd_m_step's loss equals Alg. 1's M-step written as explicit loops (eq. advance)."""
    gen = torch.Generator().manual_seed(0)
    num_anchors, num_samples, length = 3, 5, 4
    shape = (num_anchors, num_samples, length)
    rand = lambda *s: -torch.rand(*s, generator=gen) * 2
    paths = EStepPaths(
        proposal_target_lps=rand(*shape), proposal_draft_lps=rand(*shape).requires_grad_(),
        correction_target_lps=rand(*shape), correction_draft_lps=rand(*shape).requires_grad_(),
        greedy_target_lps=rand(num_anchors, length) * 0.3, greedy_draft_lps=rand(num_anchors, length),
        mask=torch.ones(shape, dtype=torch.bool), step0_hidden=torch.zeros(1),
    )
    config = ObjectiveConfig(length_weight_base=1.05, car_temperature=0.2)
    loss, metrics = vsd_m_step(paths, config)
    kappa = lambda p, q: path_log_kappa(p, q.detach())
    prop_k, corr_k = kappa(paths.proposal_target_lps, paths.proposal_draft_lps), kappa(
        paths.correction_target_lps, paths.correction_draft_lps)
    greedy_k = path_log_kappa(paths.greedy_target_lps, paths.greedy_draft_lps)
    prop_lp, corr_lp = paths.proposal_draft_lps.cumsum(-1), paths.correction_draft_lps.cumsum(-1)
    zeta = car_weights(prop_lp, 0.2)
    per_anchor = []
    for a in range(num_anchors):
        o_tilde = [[1.05 ** (l + 1) * float(prop_k[a, s, l] >= greedy_k[a, l]) for l in range(length)]
                   for s in range(num_samples)]
        o_final = [[o_tilde[s][l] if o_tilde[s][l] > 0 else 1.05 ** (l + 1) * float(corr_k[a, s, l] >= greedy_k[a, l])
                    for l in range(length)] for s in range(num_samples)]
        total, weight = 0.0, 0.0
        for l in range(length):
            for s in range(num_samples):
                others = [j for j in range(num_samples) if j != s]
                den = sum(o_final[j][l] for j in others)
                beta = sum(o_final[j][l] * (o_tilde[j][l] > 0) for j in others) / den if den > 0 else 0.0
                final_lp = prop_lp[a, s, l] if o_tilde[s][l] > 0 else corr_lp[a, s, l]
                total = total + o_final[s][l] * (final_lp - beta * zeta[a, s, l] * prop_lp[a, s, l])
                weight += o_final[s][l]
        if weight > 0:
            per_anchor.append(total / weight)
    expected = -torch.stack(per_anchor).mean()
    torch.testing.assert_close(loss, expected)
    assert 0 < metrics["oracle_pass_rate"] < 1  # a mix of kept and corrected proposals


@pytest.mark.parametrize("use_arw, use_car", [(True, True), (False, True), (True, False)])
def test_m_step_switches_change_only_the_correction_term(use_arw, use_car):
    gen = torch.Generator().manual_seed(1)
    shape = (2, 4, 3)
    paths = EStepPaths(*(-torch.rand(*shape, generator=gen) for _ in range(4)),
                       greedy_target_lps=-torch.rand(2, 3, generator=gen),
                       greedy_draft_lps=-torch.rand(2, 3, generator=gen),
                       mask=torch.ones(shape, dtype=torch.bool), step0_hidden=torch.zeros(1))
    loss, _ = vsd_m_step(paths, ObjectiveConfig(use_arw=use_arw, use_car=use_car))
    basic, _ = vsd_m_step(paths, ObjectiveConfig(use_arw=False))
    assert torch.isfinite(loss)
    assert (loss == basic) == (not use_arw)


# ---------------------------------------------------------------- whole E-step against naive loops


def restricted_drafter(target, seed: int = 3, sharpen: float = 1.0) -> Eagle3Drafter:
    """A random drafter whose draft vocabulary is target ids 28..127 (0..27 cannot be drafted)."""
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=100, seed=seed)
    drafter.set_draft_vocab(torch.arange(28, VOCAB))
    with torch.no_grad():
        drafter.lm_head.weight.mul_(sharpen)
    return drafter


def naive_draft_distributions(drafter, batch, row: int, anchor: int, path: torch.Tensor) -> torch.Tensor:
    """[len(path) + 1, Vd] the drafter's log q before each token of `path` (target ids) and after the
    last, at anchor `anchor`, one decoding-session step at a time."""
    next_ids = torch.cat([batch.tokens.input_ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1)
    session = drafter.new_session(1)
    session.advance(DraftInputs(batch.features[row : row + 1, : anchor + 1], next_ids[row : row + 1, : anchor + 1],
                                torch.tensor([anchor + 1])))
    hidden, rows = session.last_hidden, []
    for depth, token in enumerate(path.tolist()):
        rows.append(drafter.draft_logprobs(hidden)[0])
        session.frontier_hidden = hidden[:, None]
        session.expand(torch.tensor([[token]]), torch.zeros(1, 1, dtype=torch.long),
                       torch.ones(1, 1, depth + 1, dtype=torch.bool), 1)
        hidden = session.frontier_hidden[:, 0]
    rows.append(drafter.draft_logprobs(hidden)[0])
    return torch.stack(rows).detach()


def naive_draft_logprobs(drafter, batch, row: int, anchor: int, path: torch.Tensor) -> torch.Tensor:
    """log q of each token of `path` (-inf for a token outside the draft vocabulary)."""
    to_draft = target_to_draft_ids(drafter, VOCAB)[path]
    logprobs = naive_draft_distributions(drafter, batch, row, anchor, path)[:-1]
    picked = logprobs.gather(-1, to_draft.clamp(min=0)[:, None])[:, 0]
    return picked.masked_fill(to_draft < 0, -torch.inf)


def naive_target_logprobs(target, prefix: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    logprobs = full_logprobs(target, torch.cat([prefix, path[:-1]]))[len(prefix) - 1 :]
    return logprobs.gather(-1, path[:, None])[:, 0]


def naive_greedy(target, prefix: torch.Tensor, length: int, allowed: torch.Tensor | None) -> torch.Tensor:
    seq = prefix.clone()
    for _ in range(length):
        logprobs = full_logprobs(target, seq)[-1]
        if allowed is not None:
            logprobs = logprobs.masked_fill(~allowed, -torch.inf)
        seq = torch.cat([seq, logprobs.argmax()[None]])
    return seq[len(prefix) :]


@pytest.mark.parametrize("zbar_vocab", ["draft", "full"])
def test_run_estep_equals_naive_loops(tiny_target, zbar_vocab):
    batch, _ = make_batch(tiny_target, seed=3)
    drafter = restricted_drafter(tiny_target)
    num_anchors, num_samples, length = 2, 3, 3
    paths = run_estep(drafter, tiny_target, batch, num_anchors, num_samples, length, torch.Generator().manual_seed(7),
                      greedy_full_vocab=zbar_vocab == "full")
    anchors, valid = choose_anchors(batch.tokens, num_anchors, torch.Generator().manual_seed(7))  # the same draw
    in_vocab = torch.arange(VOCAB) >= 28
    assert paths.proposal_ids.shape == (4, num_samples, length) and paths.greedy_ids.shape == (4, length)
    assert valid.all()
    for b in range(2):  # a path stops at the answer's end: its first position that is not a loss token
        for a in range(num_anchors):
            inside = True
            for depth in range(length):
                position = int(anchors[b, a]) + 2 + depth
                inside = inside and position < batch.tokens.loss_mask.shape[1] and bool(
                    batch.tokens.loss_mask[b, position])
                assert bool(paths.mask[b * num_anchors + a, :, depth].all()) == inside
                assert bool(paths.mask[b * num_anchors + a, :, depth].any()) == inside
    assert not paths.mask.all()  # this batch has an anchor whose answer ends inside its path
    num_greedy_outside = 0
    for b in range(2):
        for a in range(num_anchors):
            row, t = b * num_anchors + a, int(anchors[b, a])
            prefix = batch.tokens.input_ids[b, : t + 2]
            greedy = naive_greedy(tiny_target, prefix, length, None if zbar_vocab == "full" else in_vocab)
            assert paths.greedy_ids[row].tolist() == greedy.tolist()
            num_greedy_outside += int((~in_vocab[greedy]).sum())
            close = {"atol": 2e-5, "rtol": 1e-4}
            torch.testing.assert_close(paths.greedy_target_lps[row],
                                       naive_target_logprobs(tiny_target, prefix, greedy), **close)
            torch.testing.assert_close(paths.greedy_draft_lps[row],
                                       naive_draft_logprobs(drafter, batch, b, t, greedy), **close)
            for s in range(num_samples):
                for kind in ("proposal", "correction"):
                    ids = getattr(paths, f"{kind}_ids")[row, s]
                    assert in_vocab[ids].all(), kind  # both kinds lie in the draft vocabulary
                    torch.testing.assert_close(getattr(paths, f"{kind}_target_lps")[row, s],
                                               naive_target_logprobs(tiny_target, prefix, ids), **close)
                    torch.testing.assert_close(getattr(paths, f"{kind}_draft_lps")[row, s].detach(),
                                               naive_draft_logprobs(drafter, batch, b, t, ids), **close)
    assert paths.proposal_draft_lps.requires_grad and paths.correction_draft_lps.requires_grad
    if zbar_vocab == "full":  # the tiny target's greedy path leaves the draft vocabulary: alpha = 1 there
        assert num_greedy_outside > 0
        outside = ~in_vocab[paths.greedy_ids]
        assert torch.isinf(paths.greedy_draft_lps[outside]).all()
        log_alpha = path_log_kappa(paths.greedy_target_lps, paths.greedy_draft_lps).diff(
            dim=-1, prepend=torch.zeros(4, 1))
        assert (log_alpha[outside] == 0).all() and torch.isfinite(log_alpha).all()


# ---------------------------------------------------------------- sampling distributions (chi-square)


def chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of integer samples against probs [V]; bins with expected < 5 pooled.

    A sample where probs is 0 makes the p-value 0.
    """
    counts = torch.bincount(samples, minlength=probs.numel()).double().numpy()
    expected = probs.double().numpy() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def most_frequent(ids: torch.Tensor) -> int:
    return int(torch.mode(ids).values)


def test_proposals_are_drawn_from_the_drafter(tiny_target):
    batch, gen = make_batch(tiny_target, seed=4)
    drafter = restricted_drafter(tiny_target, sharpen=6.0)  # peaked: the test has power
    anchors = torch.tensor([[9], [6]])
    num_samples = 3000
    to_draft = target_to_draft_ids(drafter, VOCAB)
    given = torch.full((2, 1, 1, 2), 30)
    with torch.no_grad():
        drafted = draft_pass(drafter, batch, anchors, given, to_draft, num_samples, 2, gen)
    for b in range(2):
        t = int(anchors[b, 0])
        first = drafted.proposals[b, 0, :, 0]
        q_first = naive_draft_distributions(drafter, batch, b, t, torch.tensor([], dtype=torch.long))[0].exp()
        assert chi_square_p(to_draft[first], q_first) > 1e-3
        assert chi_square_p(to_draft[first], torch.full((100,), 0.01)) < 1e-6  # power: uniform is rejected
        token = most_frequent(first)  # depth 2, given the most frequent first token
        second = drafted.proposals[b, 0, first == token, 1]
        q_second = naive_draft_distributions(drafter, batch, b, t, torch.tensor([token]))[1].exp()
        assert len(second) > 200 and chi_square_p(to_draft[second], q_second) > 1e-3
        assert chi_square_p(to_draft[second], q_first) < 1e-6  # the second step really is conditional


def test_corrections_are_drawn_from_the_target_restricted_to_the_draft_vocab(tiny_target):
    batch, gen = make_batch(tiny_target, seed=5)
    anchors = torch.tensor([[8], [5]])
    num_samples = 3000
    allowed = torch.ones(VOCAB, dtype=torch.bool)
    for b in range(2):  # the target's two favourite first tokens are outside the draft vocabulary
        t = int(anchors[b, 0])
        allowed[full_logprobs(tiny_target, batch.tokens.input_ids[b, : t + 2])[-1].topk(2).indices] = False
    corrections, _ = target_rollouts(tiny_target, batch.target_cache, batch, anchors, allowed, num_samples, 2, gen)
    for b in range(2):
        prefix = batch.tokens.input_ids[b, : int(anchors[b, 0]) + 2]
        first = corrections.token_ids[b, 0, :, 0]
        p_full = full_logprobs(tiny_target, prefix)[-1].exp()
        p_first = torch.where(allowed, p_full, 0.0) / p_full[allowed].sum()
        assert chi_square_p(first, p_first) > 1e-3
        assert chi_square_p(first, p_full) < 1e-6  # unrestricted p is rejected (power)
        token = most_frequent(first)
        second = corrections.token_ids[b, 0, first == token, 1]
        p_next = full_logprobs(tiny_target, torch.cat([prefix, torch.tensor([token])]))[-1].exp()
        p_second = torch.where(allowed, p_next, 0.0) / p_next[allowed].sum()
        assert len(second) > 200 and chi_square_p(second, p_second) > 1e-3


# ---------------------------------------------------------------- the oracle's tie rule


def tie_paths(with_ids: bool) -> EStepPaths:
    """One anchor, z_bar = (5, 6, 7); sample 0 is z_bar token for token, sample 1 shares its first two
    tokens, sample 2 differs from the first; every proposal scores 1e-6 nats *below* z_bar's kappa
    (as a different forward gives), except where the log-probs say it is better."""
    greedy_ids = torch.tensor([[5, 6, 7]])
    proposal_ids = torch.tensor([[[5, 6, 7], [5, 6, 9], [8, 6, 7]]])
    greedy_target = torch.log(torch.tensor([[0.5, 0.4, 0.3]]))
    greedy_draft = torch.log(torch.tensor([[0.6, 0.5, 0.4]]))  # every alpha < 1: kappa(z_bar) < 1
    proposal_target = greedy_target[:, None].repeat(1, 3, 1)
    proposal_draft = greedy_draft[:, None].repeat(1, 3, 1) + 1e-6
    return EStepPaths(proposal_target, proposal_draft.requires_grad_(), proposal_target.clone(), proposal_draft.clone(),
                      greedy_target, greedy_draft, torch.ones(1, 3, 3, dtype=torch.bool), torch.zeros(1),
                      proposal_ids=proposal_ids if with_ids else None,
                      correction_ids=proposal_ids.flip(1) if with_ids else None,
                      greedy_ids=greedy_ids if with_ids else None)


def test_token_identical_prefixes_of_z_bar_pass_the_oracle():
    oracles = estep_oracles(tie_paths(with_ids=True), ObjectiveConfig())
    assert oracles.passed[0].tolist() == [[True, True, True], [True, True, False], [False, False, False]]
    corrections_passed = (oracles.correction_oracle > 0)[0].tolist()  # the same rule for corrections
    assert corrections_passed == [[False, False, False], [True, True, False], [True, True, True]]
    # without the rule the 1e-6 difference decides: the identical path fails
    assert not estep_oracles(tie_paths(with_ids=False), ObjectiveConfig()).passed.any()
    assert prefix_matches(torch.tensor([[[1, 2, 3], [1, 3, 3]]]), torch.tensor([[1, 2, 3]])).tolist() == [
        [[True, True, True], [True, False, False]]]


def test_run_estep_proposals_equal_to_z_bar_always_pass(tiny_target, fitted_drafter):
    """End to end: a drafter fitted to the target proposes z_bar often; every such prefix passes."""
    from conftest import PROMPT_POOL
    from mmvsd.decoding.decode import DecodeConfig, vanilla_generate

    results = vanilla_generate(tiny_target, PROMPT_POOL[:2], DecodeConfig(max_new_tokens=24))
    seqs = [r.prompt_ids + r.output_ids for r in results]
    width = min(len(s) for s in seqs)
    ids = torch.tensor([s[:width] for s in seqs])
    tokens = TokenBatch(ids, torch.arange(width)[None].expand(2, -1) >= 4, torch.tensor([width, width]))
    batch = capture_features(tiny_target, tokens, keep_cache=True)
    paths = run_estep(fitted_drafter, tiny_target, batch, 4, 16, 4, torch.Generator().manual_seed(0))
    same = prefix_matches(paths.proposal_ids, paths.greedy_ids)
    oracles = estep_oracles(paths, ObjectiveConfig(path_length=4))
    assert same.sum() > 20
    assert oracles.passed[same & paths.mask].all() and not oracles.passed[~paths.mask].any()


def test_the_target_scores_paths_in_its_own_precision_inside_a_bf16_training_step(tiny_target):
    """A training step runs its objective under bf16 autocast (the drafter's); the target's forwards and its fp32
    head (kappa, acceptance) must not follow it: the same scores with autocast on as off, in fp32."""
    batch, gen = make_batch(tiny_target, seed=2)
    anchors, _ = choose_anchors(batch.tokens, 2, gen)
    paths = torch.randint(28, VOCAB, (2, 2, 3, 3), generator=gen)
    plain = score_paths_packed(tiny_target, batch.target_cache, batch, anchors, paths)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = score_paths_packed(tiny_target, batch.target_cache, batch, anchors, paths)
        logits = tiny_target.float_logits(batch.target_hidden)
    assert inside.dtype == logits.dtype == torch.float32
    torch.testing.assert_close(inside, plain, rtol=0, atol=0)
    torch.testing.assert_close(logits, tiny_target.float_logits(batch.target_hidden), rtol=0, atol=0)
