"""smol-llava, the product's named target (mmvsd.targets): its projector files and checksums, the shipped projector,
a local build taking precedence, and the shipped image drafters decoding image prompts losslessly on it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlavaForConditionalGeneration

from mmvsd.errors import UserError
from mmvsd.targets import smol_llava
from mmvsd.targets.efficientnet import NUM_FEATURES, smol_llava_config
from mmvsd.targets.lora import add_lora, lora_state, merge_lora
from mmvsd.targets.smol_llava import (
    IMAGE_TOKEN,
    PROJECTOR_MANIFEST,
    PROJECTOR_WEIGHTS,
    SHIPPED_PROJECTOR_DIR,
    install_projector,
    load_projector,
    save_projector,
)


def tiny_llava() -> LlavaForConditionalGeneration:
    text_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(smol_llava_config(text_config, image_token_id=5)).eval()


def test_projector_round_trip_and_checksum(tmp_path):
    model = tiny_llava()
    save_projector(model, tmp_path / "projector", {"steps": 0})
    manifest = json.loads((tmp_path / "projector" / PROJECTOR_MANIFEST).read_text())
    assert manifest["image_token"] == IMAGE_TOKEN and manifest["training"] == {"steps": 0}
    state = load_projector(tmp_path / "projector", hidden_size=32)
    for key, value in model.model.multi_modal_projector.state_dict().items():
        assert torch.equal(state[key], value)


def test_projector_with_adapters_round_trips_into_the_merged_model(tmp_path):
    """A projector trained with low-rank adapters: saving the factors, loading and installing them into a
    fresh model gives the weights (and outputs) of the model the adapters were merged into after training."""
    trained, fresh = tiny_llava(), tiny_llava()
    wrappers = add_lora(trained.model.language_model, rank=2, alpha=4.0, seed=0)
    for wrapper in wrappers:
        torch.nn.init.normal_(wrapper.lora_b)
    factors = lora_state(trained.model.language_model)
    merge_lora(trained.model.language_model)
    save_projector(trained, tmp_path / "projector", {}, factors)
    install_projector(fresh, load_projector(tmp_path / "projector", hidden_size=32))
    assert fresh.state_dict().keys() == trained.state_dict().keys()
    for key, value in trained.state_dict().items():
        assert torch.allclose(fresh.state_dict()[key], value, atol=1e-6), key
    other = tiny_llava()
    other.model.language_model.layers[0].self_attn.q_proj = torch.nn.Linear(32, 16, bias=False)
    with pytest.raises(UserError, match="does not fit"):
        install_projector(other, load_projector(tmp_path / "projector", hidden_size=32))


def test_corrupt_or_mismatched_projector_is_refused(tmp_path):
    folder = tmp_path / "projector"
    save_projector(tiny_llava(), folder, {})
    with pytest.raises(UserError, match="does not fit"):
        load_projector(folder, hidden_size=576)  # a projector for another language model
    weights = folder / PROJECTOR_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="corrupt or was replaced"):
        load_projector(folder, hidden_size=32)
    (folder / PROJECTOR_MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match="manifest"):
        load_projector(folder, hidden_size=32)
    weights.unlink()
    with pytest.raises(UserError):
        load_projector(folder, hidden_size=32)


def test_shipped_projector_passes_its_checksum():
    state = load_projector(SHIPPED_PROJECTOR_DIR, hidden_size=576)
    assert state["linear_1.weight"].shape == (576, NUM_FEATURES)
    manifest = json.loads((SHIPPED_PROJECTOR_DIR / PROJECTOR_MANIFEST).read_text())
    assert manifest["training"]["minutes"] <= 30


def test_local_build_takes_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path))
    assert smol_llava.projector_dir() == SHIPPED_PROJECTOR_DIR
    save_projector(tiny_llava(), smol_llava.built_projector_dir(), {})
    assert smol_llava.projector_dir() == tmp_path / "smol-llava" / "projector"


@pytest.mark.smollm2
@pytest.mark.parametrize("name", ["default", "msd-ce"])
def test_shipped_smol_llava_drafters_decode_image_prompts_losslessly(monkeypatch, tmp_path, name):
    """The shipped drafters of smol-llava (ViSpec, its default, and MSD; with the shipped projector, not a rebuilt
    one) decode image prompts of the chart task token for token as vanilla decoding does, and accept several
    tokens per target forward (an untrained drafter accepts about one)."""
    from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
    from mmvsd.decoding.tree import TreeShape
    from mmvsd.drafters.spec import drafter_from_spec
    from mmvsd.prompts import load_eval_prompts
    from mmvsd.target_loader import load_target

    monkeypatch.setattr(smol_llava, "built_projector_dir", lambda: tmp_path / "none")  # the shipped projector
    target = load_target("smol-llava")
    prompts = load_eval_prompts(target, "chartqa_mini_long", limit=3)
    drafter = drafter_from_spec(name, target, ngram=False)
    assert drafter.drafter_type == {"default": "vispec", "msd-ce": "msd"}[name]
    decoded = speculative_generate(target, drafter, prompts, DecodeConfig(64, tree=TreeShape(60, 5, 8)))
    assert [r.output_ids for r in decoded] == [
        r.output_ids for r in vanilla_generate(target, prompts, DecodeConfig(64))]
    tau = sum(len(r.output_ids) for r in decoded) / sum(r.num_target_forwards for r in decoded)
    assert tau > 2.5
