"""N-gram (prompt-lookup) drafting and hybrid (neural + n-gram) draft trees: lookup, scores, lossless."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from test_sampling import NUM_SAMPLES, chi_square_pvalue

from conftest import make_tiny_llama, random_prompts, save_tiny_target
from mmvsd.cli import main
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape, build_dynamic_tree
from mmvsd.decoding.verify import verify_sampling
from mmvsd.drafter_base import DraftInputs
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.drafters.hybrid import HybridDrafter, merge_proposals, with_ngram
from mmvsd.drafters.ngram import (
    NgramConfig,
    NgramDrafter,
    NgramIndex,
    ProposalAcceptance,
    build_trie,
    parse_ngram_spec,
)
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.target import Target

SMALL_TREE = TreeShape(budget=12, depth=4, topk=3)


@pytest.fixture(scope="module")
def copying_target() -> Target:
    """The tiny Llama with its attention outputs zeroed: the next token is a function of the current
    one, so greedy text falls into a cycle that prompt lookup continues exactly."""
    model = make_tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return Target(model, None, "tiny-copying")


def repeated_prompts(num: int, seed: int) -> list[list[int]]:
    """Random prompts that contain their own first half twice (something for lookup to find)."""
    return [p + p[: len(p) // 2 + 1] + p for p in random_prompts(num, seed=seed, min_len=4, max_len=8)]


def alone(target, prompts, max_new):
    return [vanilla_generate(target, [p], DecodeConfig(max_new_tokens=max_new))[0].output_ids for p in prompts]


# ---- lookup and trie --------------------------------------------------------------------------


def brute_continuations(history: list[int], config: NgramConfig) -> list[tuple[int, ...]]:
    """Reference: scan every earlier position for every suffix length, extrapolating periodically."""
    length, found = len(history), []
    for n in range(config.max_n, config.min_n - 1, -1):
        if n > length:
            continue
        for end in range(length - 2, n - 2, -1):
            if history[end - n + 1 : end + 1] != history[length - n :]:
                continue
            seq, period = list(history), length - 1 - end
            while len(seq) < end + 1 + config.max_len:
                seq.append(seq[len(seq) - period])
            continuation = tuple(seq[end + 1 : end + 1 + config.max_len])
            if continuation not in found:
                found.append(continuation)
            if len(found) == config.num_continuations:
                return found
    return found


@pytest.mark.parametrize("config", [NgramConfig(), NgramConfig(max_n=2, min_n=2, num_continuations=2, max_len=3),
                                    NgramConfig(max_n=5, min_n=1, num_continuations=6, max_len=11)])
def test_incremental_lookup_equals_brute_force(config):
    rng = random.Random(0)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5, 12])
        index = NgramIndex(config)
        history: list[int] = []
        while len(history) < 45:
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            index.extend(chunk)
            history += chunk
            assert index.continuations() == brute_continuations(history, config), (trial, history)


def test_lookup_prefers_longer_matches_and_recent_ones():
    config = NgramConfig(max_n=3, min_n=1, num_continuations=3, max_len=2)
    index = NgramIndex(config)
    index.extend([1, 2, 3, 9, 9, 7, 3, 5, 5, 2, 3, 4, 4, 1, 2, 3])
    # suffix (1,2,3) ends at 2 -> (9,9); (2,3) also ends at 10 -> (4,4); (3) ends at 6 -> (5,5)
    assert index.continuations() == [(9, 9), (4, 4), (5, 5)]
    assert NgramIndex(config).continuations() == []
    index = NgramIndex(NgramConfig(max_n=2, max_len=5))
    index.extend([6, 1, 2, 1, 2])  # periodic: the match's continuation runs past the end and repeats
    assert index.continuations()[0] == (1, 2, 1, 2, 1)


def test_trie_merges_shared_prefixes_in_priority_order():
    root = build_trie([(1, 2, 3), (1, 2, 4), (5, 6), (1, 7)])
    assert [c.token for c in root.children.values()] == [1, 5]
    one = root.children[1]
    assert [(c.token, c.rank, c.depth) for c in one.children.values()] == [(2, 0, 2), (7, 1, 2)]
    assert [(c.token, c.rank) for c in one.children[2].children.values()] == [(3, 0), (4, 1)]

    def paths(node, prefix=()):
        if not node.children:
            return {prefix}
        return set().union(*(paths(c, prefix + (c.token,)) for c in node.children.values()))

    assert paths(root) == {(1, 2, 3), (1, 2, 4), (5, 6), (1, 7)}


# ---- online acceptance estimate ---------------------------------------------------------------


def test_acceptance_estimate_is_the_beta_posterior_per_depth_and_rank():
    config = NgramConfig(num_continuations=2, max_len=3, prior_accept=0.25, prior_weight=4.0)
    stats = ProposalAcceptance(config)
    assert stats.accept_prob(1, 0) == pytest.approx(0.25) and stats.accept_prob(3, 1) == pytest.approx(0.25)
    trie = build_trie([(1, 2, 3), (4, 5)])
    stats.record(trie, [1, 2, 9])  # depth 1: ranks 0 (hit) and 1 tried; depth 2: hit; depth 3: miss
    stats.record(trie, [4, 6])  # depth 1: rank 1 hit; depth 2 under 4: rank 0 miss
    stats.record(trie, [8, 1])  # depth 1: both miss; nothing deeper is scored
    a, b = 1.0, 3.0  # prior_accept * weight, (1 - prior_accept) * weight
    expected = {(1, 0): (1, 3), (1, 1): (1, 3), (2, 0): (1, 2), (3, 0): (0, 1), (2, 1): (0, 0)}
    for (depth, rank), (hits, trials) in expected.items():
        assert stats.accept_prob(depth, rank) == pytest.approx((hits + a) / (trials + a + b))
        assert stats.logprobs[depth - 1][rank] == pytest.approx(math.log((hits + a) / (trials + a + b)))


def feed(session, tokens: list[list[int]]) -> None:
    """Advance a session with right-padded committed tokens per row."""
    width = max(len(t) for t in tokens)
    ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
    num_new = torch.tensor([len(t) for t in tokens])
    session.advance(DraftInputs(torch.zeros(len(tokens), width, 0), ids, num_new))


def test_session_scores_its_proposals_against_what_was_committed():
    config = NgramConfig(max_n=2, num_continuations=2, max_len=3)
    session = NgramDrafter(config).new_session(2)
    feed(session, [[5, 6, 7, 8, 5, 6], [1, 2, 3]])  # row 0 proposes 7, 8, 5; row 1 nothing
    ids, logprobs = session.root_candidates(topk=4)
    assert ids.shape == (2, 1) and ids[0, 0] == 7 and logprobs[1, 0] == float("-inf")
    assert logprobs[0, 0] == pytest.approx(math.log(0.5))  # the prior mean
    session.end_round()
    feed(session, [[7, 8, 4], [9]])  # row 0: depths 1, 2 hit, depth 3 missed; row 1 had no trie
    assert session.stats.hits[0][0] == 1 and session.stats.trials[0][0] == 1
    assert session.stats.hits[1][0] == 1 and session.stats.hits[2][0] == 0 and session.stats.trials[2][0] == 1
    assert session.stats.accept_prob(1, 0) == pytest.approx(2 / 3)


def test_expand_follows_the_trie_by_token_for_any_proposer():
    config = NgramConfig(max_n=1, num_continuations=3, max_len=3)
    session = NgramDrafter(config).new_session(1)
    feed(session, [[3, 1, 2, 9, 3, 4, 5, 3]])  # continuations of "3": (4, 5, 3), (1, 2, 9)
    ids, _ = session.root_candidates(topk=3)
    assert sorted(ids[0].tolist()) == [1, 4]
    # the builder's frontier: the two trie children plus a token some other proposer suggested
    frontier = torch.tensor([[4, 7, 1]])
    child_ids, child_logprobs = session.expand(frontier, torch.zeros_like(frontier), None, topk=3)
    assert child_ids.shape == (1, 3, 1)
    assert child_ids[0, :, 0].tolist()[::2] == [5, 2] and child_logprobs[0, 1, 0] == float("-inf")
    # next depth: parent slots point into the previous frontier (slot 2 = the node "1")
    child_ids, child_logprobs = session.expand(torch.tensor([[2, 5]]), torch.tensor([[2, 0]]), None, topk=3)
    assert child_ids[0, :, 0].tolist() == [9, 3] and torch.isfinite(child_logprobs).all()
    session.end_round()


# ---- hybrid merge -----------------------------------------------------------------------------


def test_merge_keeps_one_column_per_token_with_the_best_score():
    neural_ids, neural_lp = torch.tensor([[4, 2, 9]]), torch.tensor([[-0.5, -1.0, -3.0]])
    ngram_ids, ngram_lp = torch.tensor([[9, 6, 2, 0]]), torch.tensor([[-0.7, -0.7, -2.0, float("-inf")]])
    ids, lp = merge_proposals(neural_ids, neural_lp, ngram_ids, ngram_lp)
    assert ids.tolist() == [[4, 2, 9, 9, 6, 2, 0]]
    inf = float("-inf")
    assert lp[0].tolist() == pytest.approx([-0.5, -1.0, -0.7, inf, -0.7, inf, inf])
    same_ids, same_lp = merge_proposals(neural_ids, neural_lp, ngram_ids[:, :0], ngram_lp[:, :0])
    assert same_ids is neural_ids and same_lp is neural_lp


def random_features(drafter, target, length: int, seed: int = 0) -> torch.Tensor:
    """[1, length, F] stand-in target features of the width `drafter` reads."""
    width = drafter.target_features(torch.zeros(1, 1, len(target.aux_layer_ids) * target.hidden_size),
                                    torch.zeros(1, 1, target.hidden_size)).shape[-1]
    return torch.randn(1, length, width, generator=torch.Generator().manual_seed(seed))


def feed_hybrid(session, prompt: list[int], features: torch.Tensor) -> None:
    """Pairs up to the prompt's last token, which is then the tree root (as after a prefill)."""
    next_ids = torch.tensor([prompt[1:]])
    session.advance(DraftInputs(features[:, :-1], next_ids, torch.tensor([len(prompt) - 1])))


@torch.no_grad()
def test_hybrid_tree_holds_both_proposers_and_grows_neural_nodes_under_ngram_ones(tiny_target, random_drafter):
    session = with_ngram(random_drafter).new_session(1)
    prompt = repeated_prompts(1, seed=3)[0]
    feed_hybrid(session, prompt, random_features(random_drafter, tiny_target, len(prompt)))
    neural_roots = random_drafter.draft_to_target(
        random_drafter.draft_logprobs(session.neural.last_hidden).topk(3).indices)[0].tolist()
    tree = build_dynamic_tree(torch.tensor([prompt[-1]]), session, TreeShape(budget=40, depth=3, topk=3))
    trie = session.ngram.tries[0]
    ids, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
    on_trie = {0: trie}  # tree node -> its trie node, for nodes on the n-gram trie
    for node in range(1, len(ids)):
        parent_trie = on_trie.get(parents[node])
        if parent_trie is not None and ids[node] in parent_trie.children:
            on_trie[node] = parent_trie.children[ids[node]]
    assert max(tree.depths[0, list(on_trie)].tolist()) == 3  # an n-gram path to full depth
    assert set(neural_roots) <= {ids[n] for n in range(1, len(ids)) if parents[n] == 0}
    assert any(parents[n] in on_trie and parents[n] > 0 and n not in on_trie for n in range(len(ids)))
    assert len(set(zip(ids, parents))) == len(ids)  # no duplicate sibling
    assert torch.isfinite(tree.draft_logprobs).all()


# ---- lossless decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_greedy_equals_vanilla_and_copies_cycles(copying_target, batch):
    prompts = random_prompts(batch, seed=11)
    reference = alone(copying_target, prompts, 60)
    spec = speculative_generate(copying_target, NgramDrafter(), prompts, DecodeConfig(60, tree=SMALL_TREE))
    assert [r.output_ids for r in spec] == reference
    assert all(r.tau > 1.8 for r in spec)  # the cycle is looked up and accepted whole (depth 4 per step)
    assert max(max(r.accept_lengths) for r in spec) == SMALL_TREE.depth + 1


@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_and_hybrid_greedy_equal_vanilla_on_a_real_attention_target(tiny_target, random_drafter, batch):
    prompts = repeated_prompts(batch, seed=5)
    reference = alone(tiny_target, prompts, 30)
    for drafter in (NgramDrafter(), with_ngram(random_drafter)):
        spec = speculative_generate(tiny_target, drafter, prompts, DecodeConfig(30, tree=SMALL_TREE))
        assert [r.output_ids for r in spec] == reference


@pytest.mark.parametrize("batch", [1, 4])
def test_hybrid_with_random_drafter_is_lossless_and_accepts_ngram_branches(copying_target, batch):
    drafter = with_ngram(Eagle3Drafter.from_target(copying_target, seed=3).eval())
    prompts = random_prompts(batch, seed=12)
    spec = speculative_generate(copying_target, drafter, prompts, DecodeConfig(60, tree=SMALL_TREE))
    assert [r.output_ids for r in spec] == alone(copying_target, prompts, 60)
    assert all(r.tau > 1.8 for r in spec)  # a random drafter alone gets ~1.0


# ---- T = 1: the hybrid tree keeps the target's distribution -----------------------------------


@torch.no_grad()
def test_hybrid_tree_sampling_matches_the_target_distribution(tiny_target, random_drafter):
    """A real hybrid tree (neural + n-gram nodes, merged duplicates, -inf columns) verified at T=1:
    the first token follows the target, and so does the second given an accepted first."""
    prompt = [24, 121, 27, 3, 56, 72, 121]  # lookup proposes 27, 3, ...; the target gives 27 p ~ 0.25
    session = with_ngram(random_drafter).new_session(1)
    feed_hybrid(session, prompt, random_features(random_drafter, tiny_target, len(prompt)))
    tree = build_dynamic_tree(torch.tensor([prompt[-1]]), session, TreeShape(budget=10, depth=3, topk=3))
    ids, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
    paths = []  # the target's logits after each node: the prompt plus the node's root-to-node path
    for node in range(len(ids)):
        path, cur = [], node
        while cur > 0:
            path.append(ids[cur])
            cur = parents[cur]
        paths.append(prompt + path[::-1])
    logits = torch.stack([tiny_target.model(torch.tensor([p])).logits[0, -1] for p in paths])  # [N, V]
    batch_tree = type(tree)(*(t.expand(NUM_SAMPLES, -1).clone() for t in
                              (tree.token_ids, tree.parents, tree.depths, tree.draft_logprobs)))
    gen = torch.Generator().manual_seed(1)
    verdict = verify_sampling(batch_tree, logits.expand(NUM_SAMPLES, -1, -1), 1.0, gen)
    accepted = verdict.accepted_ids(batch_tree)
    probs = torch.softmax(logits.float(), -1)
    vocab = logits.shape[-1]
    first = torch.tensor([row[0] for row in accepted])
    assert chi_square_pvalue(torch.bincount(first, minlength=vocab).float(), probs[0]) > 1e-3
    assert probs[0, 27] > 0.2
    ngram_child = next(n for n in range(1, len(ids)) if parents[n] == 0 and ids[n] == 27)
    assert any(parents[n] == ngram_child and ids[n] == 3 for n in range(len(ids)))
    second = torch.tensor([row[1] for row in accepted if row[0] == 27])
    assert second.numel() > 500
    assert chi_square_pvalue(torch.bincount(second, minlength=vocab).float(), probs[ngram_child]) > 1e-3
    assert (verdict.num_accepted >= 1).float().mean() > 0.05  # drafts are accepted, not only resampled


# ---- specs and bad input ----------------------------------------------------------------------


def test_ngram_spec_options_and_errors():
    assert parse_ngram_spec("ngram") == NgramConfig()
    assert parse_ngram_spec("ngram:max_n=3,max_len=6,prior_accept=0.3") == NgramConfig(
        max_n=3, max_len=6, prior_accept=0.3)
    for spec, message in [("ngram:foo=1", "unknown n-gram option 'foo=1'"), ("ngram:max_n", "unknown n-gram option"),
                          ("ngram:max_n=x", "max_n must be an integer"), ("ngram:min_n=0", "min_n must be >= 1"),
                          ("ngram:max_n=2,min_n=3", "max_n must be >= min_n"),
                          ("ngram:prior_accept=1.5", "prior_accept must be in (0, 1)"),
                          ("ngram:max_len=0,num_continuations=0", "num_continuations must be >= 1, got 0; max_len")]:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_ngram_spec(spec)


def test_drafter_from_spec_ngram_and_hybrid(tiny_target):
    assert isinstance(drafter_from_spec("ngram:max_n=2", tiny_target), NgramDrafter)
    hybrid = drafter_from_spec("random", tiny_target)
    assert isinstance(hybrid, HybridDrafter) and hybrid.reads_aux
    assert isinstance(drafter_from_spec("random", tiny_target, ngram=False), Eagle3Drafter)
    assert drafter_from_spec("none", tiny_target, ngram=False) is None
    for spec in ("none", "ngram"):
        with pytest.raises(UserError, match="--ngram on adds n-gram branches"):
            drafter_from_spec(spec, tiny_target, ngram=True)


def test_generate_cli_with_ngram_and_its_errors(tmp_path, capsys):
    folder = save_tiny_target(tmp_path / "tiny")
    common = ["generate", "--target", str(folder), "--prompt", "w1 w2 w3 w1 w2 w3 w1 w2", "--max-new-tokens", "12",
              "--tree", "12/4/3"]  # a fixed shape: `auto` would profile this machine first
    outputs = []
    for extra in (["--drafter", "none"], ["--drafter", "ngram"], ["--drafter", "random", "--ngram", "off"],
                  ["--drafter", "random"]):
        assert main(common + extra + ["--json", str(tmp_path / "out.json")]) == 0
        outputs.append(json.loads((tmp_path / "out.json").read_text())["results"][0]["output_ids"])
    assert all(out == outputs[0] for out in outputs)
    capsys.readouterr()
    for extra in (["--drafter", "ngram", "--ngram", "on"], ["--drafter", "none", "--ngram", "on"],
                  ["--drafter", "ngram:max_n=0"]):
        assert main(common + extra) == 2
        err = capsys.readouterr().err
        assert len([line for line in err.splitlines() if line.startswith("mmvsd: error:")]) == 1, err
        assert "Traceback" not in err


@pytest.mark.smollm2
def test_ngram_greedy_equals_vanilla_on_smollm2(smollm2_target):
    text = "Repeat this list twice, exactly: apple, banana, cherry, date, elderberry, fig, grape."
    prompt = smollm2_target.encode_prompt(text)
    config = DecodeConfig(max_new_tokens=48, tree=TreeShape(budget=16, depth=6, topk=4))
    reference = vanilla_generate(smollm2_target, [prompt], config)[0]
    spec = speculative_generate(smollm2_target, NgramDrafter(), [prompt], config)[0]
    assert spec.output_ids == reference.output_ids
    assert spec.tau > 1.1 and max(spec.accept_lengths) >= 3  # the list is copied several tokens at a time
