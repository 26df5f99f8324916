"""Low-rank adapters: the wrapped layer computes W x + (alpha / r) B A x, starts as the plain layer, and
merging gives the same outputs as the wrapped model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mmvsd.targets.lora import TARGET_MODULES, LoRALinear, add_lora, apply_lora_state, lora_state, merge_lora


def tiny_lm() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval()


def test_wrapped_layer_is_the_direct_formula():
    base = torch.nn.Linear(6, 4)
    layer = LoRALinear(base, rank=3, alpha=6.0, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 6)
    assert torch.allclose(layer(x), base(x))  # B starts at zero
    torch.nn.init.normal_(layer.lora_b)
    expected = x @ base.weight.T + base.bias + 2.0 * (x @ layer.lora_a.T @ layer.lora_b.T)
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_every_target_linear_is_wrapped_and_merging_keeps_outputs():
    model = tiny_lm()
    ids = torch.tensor([[1, 5, 7, 9, 3]])
    wrappers = add_lora(model.model, rank=2, alpha=4.0, seed=0)
    assert len(wrappers) == 2 * len(TARGET_MODULES)
    for wrapper in wrappers:
        torch.nn.init.normal_(wrapper.lora_b)
    wrapped_logits = model(ids).logits
    factors = lora_state(model.model)
    merge_lora(model.model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert torch.allclose(model(ids).logits, wrapped_logits, atol=1e-5)
    fresh = tiny_lm()
    assert apply_lora_state(fresh.model, factors) == len(wrappers)
    assert torch.allclose(fresh(ids).logits, wrapped_logits, atol=1e-5)


def test_adapter_for_another_model_is_refused():
    factors = {"lora.layers.0.self_attn.q_proj.a": torch.zeros(2, 16),
               "lora.layers.0.self_attn.q_proj.b": torch.zeros(5, 2)}
    with pytest.raises(ValueError, match="does not fit"):
        apply_lora_state(tiny_lm().model, factors)
    with pytest.raises(ValueError, match="does not fit"):
        apply_lora_state(tiny_lm().model, {"lora.layers.9.mlp.up_proj.a": torch.zeros(2, 16),
                                           "lora.layers.9.mlp.up_proj.b": torch.zeros(24, 2)})
