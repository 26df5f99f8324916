"""The draft-model drafter (`--drafter model:SPEC`): a smaller LM with the target's tokenizer drafts trees through
the same verifier; lossless token for token at T = 0 (batch > 1, with and without n-gram branches, fixed and
auto shapes), the target's distribution at T = 1, a clear error for another tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from test_sampling import second_token_pvalue

from conftest import random_prompts, save_tiny_target
from mmvsd.cli import main
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape
from mmvsd.drafters.draft_model import DraftModel
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.target_loader import load_target


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-model")
    return {"target": save_tiny_target(root / "target", seed=0), "other": save_tiny_target(root / "other", seed=7),
            "wider": save_tiny_target(root / "wider", vocab=136, seed=1)}


@pytest.fixture(scope="module")
def target(folders):
    return load_target(str(folders["target"]))


@pytest.mark.parametrize("ngram", [False, True], ids=["draft model", "with n-gram branches"])
@pytest.mark.parametrize("tree", [TreeShape(budget=12, depth=4, topk=3), "auto"], ids=["12/4/3", "auto"])
def test_lossless_at_t0_with_batches(folders, target, ngram, tree):
    prompts = random_prompts(3, seed=11)
    config = DecodeConfig(max_new_tokens=24, tree=tree)
    expected = [r.output_ids for r in vanilla_generate(target, prompts, config)]
    drafter = drafter_from_spec(f"model:{folders['other']}", target, ngram=ngram)
    assert isinstance(drafter if not ngram else drafter.neural, DraftModel)
    got = [r.output_ids for r in speculative_generate(target, drafter, prompts, config)]
    assert got == expected


def test_the_target_as_its_own_draft_model_is_accepted_whole(folders, target):
    prompts = random_prompts(2, seed=12)
    config = DecodeConfig(max_new_tokens=20, tree=TreeShape(budget=5, depth=4, topk=1))  # a 4-token chain
    drafter = drafter_from_spec(f"model:{folders['target']}", target, ngram=False)
    results = speculative_generate(target, drafter, prompts, config)
    assert [r.output_ids for r in results] == [r.output_ids for r in vanilla_generate(target, prompts, config)]
    # the draft is the target: every drafted step accepts the whole chain, 4 tokens + the bonus (the first
    # entry is the prefill's token; the last step may stop early at the token budget or EOS)
    assert all(set(r.accept_lengths[1:-1]) <= {5} for r in results)
    assert sum(r.accept_lengths[1:].count(5) for r in results) >= 4


def test_t1_second_token_follows_the_target(folders, target):
    prompt = random_prompts(1, seed=4)[0]
    drafter = drafter_from_spec(f"model:{folders['other']}", target, ngram=False)
    assert second_token_pvalue(target, drafter, prompt, 2000, TreeShape(budget=8, depth=3, topk=2)) > 1e-3


def test_the_draft_model_reads_the_prompt_from_its_first_token(folders, target):
    """With the target as draft, the root candidates after the prefill are the target's own next-token top-k:
    the draft's context is the whole prompt, first token included."""
    prompt = random_prompts(1, seed=13)[0]
    drafter = drafter_from_spec(f"model:{folders['target']}", target, ngram=False)
    session = drafter.new_session(1)
    from mmvsd.decoding.draft_session import DraftInputs

    ids = torch.tensor([prompt])
    session.advance(DraftInputs(torch.zeros(1, len(prompt) - 1, 0), ids[:, 1:], torch.tensor([len(prompt) - 1]),
                                first_ids=ids[:, 0]))
    top_ids, _ = session.root_candidates(3)
    with torch.no_grad():
        expected = target.model(ids).logits[0, -1].topk(3).indices
    assert top_ids[0].tolist() == expected.tolist()


def test_another_tokenizer_is_one_clear_error(folders, target, capsys):
    with pytest.raises(UserError, match="its tokenizer differs from target"):
        drafter_from_spec(f"model:{folders['wider']}", target)
    with pytest.raises(UserError, match="unknown target 'nope'"):
        drafter_from_spec("model:nope", target)
    code = main(["generate", "--target", str(folders["target"]), "--drafter", f"model:{folders['wider']}",
                 "--prompt", "w1 w2", "--max-new-tokens", "4"])
    assert code == 2 and "tokenizer differs" in capsys.readouterr().err


def test_generate_with_a_draft_model_from_the_command_line(folders, tmp_path):
    out = tmp_path / "out.json"
    code = main(["generate", "--target", str(folders["target"]), "--drafter", f"model:{folders['other']}",
                 "--tree", "8/3/2", "--prompt", "w1 w2 w3", "--max-new-tokens", "8", "--json", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["results"][0]["new_tokens"] == 8
