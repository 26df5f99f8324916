"""Lossless: greedy speculative output equals the target's own greedy output, token for token."""

from __future__ import annotations

import pytest

from conftest import PROMPT_POOL, random_prompts
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape

SHAPES = {
    "chain": TreeShape(budget=6, depth=5, topk=1),
    "tree": TreeShape(budget=24, depth=5, topk=4),
    "default": TreeShape(),
}


def alone(target, prompts, max_new):
    """Each prompt decoded by itself with the vanilla loop (the reference)."""
    return [vanilla_generate(target, [p], DecodeConfig(max_new_tokens=max_new))[0].output_ids for p in prompts]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_vanilla(tiny_target, fitted_drafter, shape, batch):
    prompts = PROMPT_POOL[:1] if batch == 1 else PROMPT_POOL[2 : 2 + batch]
    config = DecodeConfig(max_new_tokens=48, tree=SHAPES[shape])
    spec = speculative_generate(tiny_target, fitted_drafter, prompts, config)
    reference = alone(tiny_target, prompts, 48)
    for result, ref in zip(spec, reference):
        assert result.output_ids == ref
    # the fitted drafter must really get multi-token acceptances, or this test proves little
    assert max(max(r.accept_lengths) for r in spec) >= 3
    assert sum(r.tau for r in spec) / batch > 1.3


def test_random_drafter_is_lossless_with_tau_near_one(tiny_target, random_drafter):
    prompts = random_prompts(3, seed=7)
    spec = speculative_generate(tiny_target, random_drafter, prompts, DecodeConfig(max_new_tokens=32))
    for result, ref in zip(spec, alone(tiny_target, prompts, 32)):
        assert result.output_ids == ref
        assert 1.0 <= result.tau < 1.6


def test_batched_vanilla_equals_alone(tiny_target):
    prompts = random_prompts(5, seed=3, min_len=1, max_len=20)
    batched = vanilla_generate(tiny_target, prompts, DecodeConfig(max_new_tokens=30))
    assert [r.output_ids for r in batched] == alone(tiny_target, prompts, 30)
    assert all(r.tau == 1.0 and r.num_target_forwards == 30 for r in batched)


def test_eos_stops_each_row_at_its_own_time(tiny_target, fitted_drafter):
    prompts = PROMPT_POOL[4:8]
    reference = alone(tiny_target, prompts, 40)
    eos = reference[0][5]  # a token row 0 emits early: make it the end-of-sequence token
    old = tiny_target.eos_token_ids
    tiny_target.eos_token_ids = frozenset({eos})
    try:
        spec = speculative_generate(tiny_target, fitted_drafter, prompts, DecodeConfig(max_new_tokens=40))
        vanilla = vanilla_generate(tiny_target, prompts, DecodeConfig(max_new_tokens=40))
    finally:
        tiny_target.eos_token_ids = old
    for s, v, ref in zip(spec, vanilla, reference):
        cut = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert s.output_ids == cut and v.output_ids == cut
    assert len(spec[0].output_ids) <= 6


@pytest.mark.smollm2
def test_smollm2_greedy_speculative_equals_vanilla(smollm2_target):
    from mmvsd.drafters.eagle3 import Eagle3Drafter

    drafter = Eagle3Drafter.from_target(smollm2_target, draft_vocab_size=8192, seed=0).eval()
    prompts = [
        smollm2_target.encode_prompt("Write a haiku about the sea."),
        smollm2_target.encode_prompt("What is the capital of France? Answer briefly."),
    ]
    config = DecodeConfig(max_new_tokens=24, tree=TreeShape(budget=16, depth=4, topk=4))
    spec = speculative_generate(smollm2_target, drafter, prompts, config)
    for result, ref in zip(spec, alone(smollm2_target, prompts, 24)):
        assert result.output_ids == ref
        assert len(result.output_ids) > 3


def test_tiny_llava_target_text_decoding_is_lossless():
    """The same Target wrapper drives an HF LlavaForConditionalGeneration (text-only prompt here)."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from mmvsd.drafters.eagle3 import Eagle3Drafter
    from mmvsd.target import Target

    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.25)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_id=150))
    target = Target(model.eval(), None, "tiny-llava")
    drafter = Eagle3Drafter.from_target(target, seed=0).eval()
    prompts = random_prompts(2, seed=31, vocab=150)
    spec = speculative_generate(target, drafter, prompts, DecodeConfig(max_new_tokens=16))
    assert [r.output_ids for r in spec] == alone(target, prompts, 16)


@pytest.mark.smollm2
@pytest.mark.parametrize("name", ["default", "eagle3-accept", "eagle3-vsd", "eagle3-ce"])
def test_shipped_smollm2_drafters_decode_losslessly_and_accept_tokens(smollm2_target, name):
    """The shipped SmolLM2 drafters (`eagle3-onpolicy`, the default, `eagle3-accept`, `eagle3-vsd` and `eagle3-ce`)
    decode MT-Bench first turns token for token as vanilla decoding does, and accept more than one token per target
    forward (an untrained drafter accepts about one: see the random-drafter test)."""
    from mmvsd.drafters.spec import drafter_from_spec
    from mmvsd.prompts import load_eval_prompts

    drafter = drafter_from_spec(name, smollm2_target, ngram=False)
    assert drafter.drafter_type == "eagle3"
    prompts = load_eval_prompts(smollm2_target, "mt_bench", limit=3)
    decoded = speculative_generate(smollm2_target, drafter, prompts, DecodeConfig(48, tree=TreeShape(60, 7, 10)))
    assert [r.output_ids for r in decoded] == alone(smollm2_target, prompts, 48)
    tau = sum(len(r.output_ids) for r in decoded) / sum(r.num_target_forwards for r in decoded)
    assert tau > 1.6
