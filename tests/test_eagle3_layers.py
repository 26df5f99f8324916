"""EAGLE-3 drafters with more than one decoder layer, and draft layers that start from the target's own (the
ceiling probes' arms, docs/training.md): each layer keeps its own cache, decoding stays lossless, the replay still
counts what decoding does, and formats that hold one layer refuse them in one message."""

from __future__ import annotations

import json

import pytest
import torch
from test_evaluate import assert_same_as_generate

from conftest import (
    PROMPT_POOL,
    TINY,
    fit_drafter_to_target,
    make_tiny_llama,
    run_cli,
    save_tiny_target,
    write_sharegpt,
)
from mmvsd.cli import main
from mmvsd.decoding.draft_session import DraftInputs, DraftSession
from mmvsd.decoding.tree import TreeShape
from mmvsd.drafters.eagle1 import Eagle1Drafter
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.errors import UserError
from mmvsd.target import Target


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("layers-target"))


@pytest.fixture(scope="module")
def two_layer_drafter(tiny_target) -> Eagle3Drafter:
    return fit_drafter_to_target(tiny_target, PROMPT_POOL, steps=120, num_layers=2)


def test_each_layer_keeps_its_own_cache(tiny_target):
    """Pairs fed in two commits give the drafter the outputs one commit of all of them gives: the second layer reads
    its own keys and values, not the first layer's (a shared cache slot would mix or mis-shape them)."""
    drafter = Eagle3Drafter.from_target(tiny_target, seed=1, num_layers=3).eval()
    assert len(drafter.extra_layers) == 2
    width = len(tiny_target.aux_layer_ids) * tiny_target.hidden_size
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 9, width, generator=generator)
    next_ids = torch.randint(0, tiny_target.vocab_size, (2, 9), generator=generator)

    def fed(cuts: list[int]) -> DraftSession:
        session = DraftSession(drafter, 2)
        for start, end in zip([0, *cuts], [*cuts, 9]):
            session.advance(DraftInputs(features[:, start:end], next_ids[:, start:end],
                                        torch.full((2,), end - start)))
        return session

    whole = fed([])
    assert len(whole.cache.kv.layers) == 3 and int(whole.cache.lens[0]) == 9  # a slot per layer, all pairs kept
    for cuts in ([4], [2, 7]):
        assert torch.allclose(fed(cuts).last_hidden, whole.last_hidden, atol=1e-5)


@pytest.mark.parametrize("shape", [TreeShape(60, 7, 10), TreeShape(4, 3, 1)], ids=["60-7-10", "4-3-1"])
def test_a_two_layer_drafter_decodes_losslessly_and_replays_as_it_decodes(tiny_target, two_layer_drafter, shape):
    report = assert_same_as_generate(tiny_target, two_layer_drafter, shape)  # every output equals vanilla's
    assert report.tau > 1.5  # it really drafts: the comparison is not vacuous


@pytest.fixture
def norms_target():
    """The tiny target with random norm weights (a fresh one's are all 1, as a fresh drafter's are)."""
    target = Target(make_tiny_llama(), None, "tiny-llama-norms")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, weight in target.model.named_parameters():
            if "norm" in name:
                weight.copy_(torch.rand(weight.shape, generator=generator) + 0.5)
    return target


def test_draft_layers_start_from_the_targets_last_layers(norms_target):
    tiny_target = norms_target
    drafter = Eagle3Drafter.from_target(tiny_target, seed=0, num_layers=2)
    head, embed_norm = drafter.lm_head.weight.clone(), drafter.midlayer.input_layernorm.weight.clone()
    drafter.init_layers_from_target(tiny_target)
    last_two = list(tiny_target.model.get_decoder().layers)[-2:]
    size = drafter.config.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        mine = getattr(drafter.midlayer.self_attn, name).weight
        assert torch.equal(mine[:, size:], getattr(last_two[0].self_attn, name).weight)
        assert not mine[:, :size].any()  # the embedding half: an input the target's layer does not have
    assert torch.equal(drafter.midlayer.hidden_norm.weight, last_two[0].input_layernorm.weight)
    assert torch.equal(drafter.midlayer.post_attention_layernorm.weight, last_two[0].post_attention_layernorm.weight)
    assert torch.equal(drafter.midlayer.self_attn.o_proj.weight, last_two[0].self_attn.o_proj.weight)
    assert torch.equal(drafter.midlayer.mlp.down_proj.weight, last_two[0].mlp.down_proj.weight)
    theirs = last_two[1].state_dict()
    assert all(torch.equal(weight, theirs[key]) for key, weight in drafter.extra_layers[0].state_dict().items())
    assert torch.equal(drafter.lm_head.weight, head)  # the head and the embedding norm stay as they were
    assert torch.equal(drafter.midlayer.input_layernorm.weight, embed_norm)


def test_layers_that_cannot_start_from_the_target_say_why(norms_target):
    with pytest.raises(UserError, match="the target has 4 decoder layers"):
        Eagle3Drafter.from_target(norms_target, num_layers=5).init_layers_from_target(norms_target)
    layer = norms_target.model.get_decoder().layers[-1]
    layer.self_attn.register_parameter("q_norm", torch.nn.Parameter(torch.ones(4)))  # as Qwen3's layers hold
    with pytest.raises(UserError, match=r"weights a Llama layer does not have \(self_attn.q_norm\)"):
        Eagle3Drafter.from_target(norms_target).init_layers_from_target(norms_target)


def test_one_layer_kinds_refuse_more(tiny_target):
    with pytest.raises(UserError, match="one decoder layer"):
        Eagle1Drafter.from_target(tiny_target, num_layers=2)
    with pytest.raises(UserError, match="cannot start its decoder layers"):
        Eagle1Drafter.from_target(tiny_target).init_layers_from_target(tiny_target)


def test_training_a_two_layer_drafter_from_the_targets_layers(tiny_dir, tmp_path, capsys):
    data = write_sharegpt(tmp_path / "data.json")
    out = tmp_path / "out"
    code = main(["train", "--target", str(tiny_dir), "--data", str(data), "--output", str(out), *TINY, "max_steps=2",
                 "draft_layers=2", "init_layers_from_target=true"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["num_layers"] == 2
    texts = []
    for drafter in (str(out), "none"):
        code, _, err = run_cli(capsys, "generate", "--target", str(tiny_dir), "--drafter", drafter, "--prompt",
                               "w1 w2 w3", "--max-new-tokens", "12", "--json", str(tmp_path / "out.json"))
        assert code == 0, err
        texts.append([r["output_ids"] for r in json.loads((tmp_path / "out.json").read_text())["results"]])
    assert texts[0] == texts[1] and len(texts[0][0]) == 12  # lossless through the command
    for layout, where in (("eagle3", "export-eagle3"), ("gguf", "export.gguf")):
        code, _, err = run_cli(capsys, "export", "--drafter", str(out), "--target", str(tiny_dir), "--format", layout,
                               str(tmp_path / where))
        assert code == 2 and "holds one EAGLE-3 decoder layer; this drafter has 2" in err, err
        assert not (tmp_path / where).exists()
