"""Modality adapters: the registry, the llava adapter against transformers' own LLaVA path, and lossless
tree decoding with image prompts on a tiny random LLaVA (batch 1 and > 1, images of different sizes)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmvsd.adapter_base import Prompt
from mmvsd.adapters import adapter_for, get_adapter, registered_adapters
from mmvsd.cli import main
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.errors import UserError


def test_builtin_adapters_are_registered_with_their_source():
    adapters = registered_adapters()
    assert adapters["text"] == "mmvsd.adapters.text" and adapters["llava"] == "mmvsd.adapters.llava"
    with pytest.raises(UserError, match="registered: .*llava.*text"):
        get_adapter("audio-spectrogram")


def test_llava_adapter_matches_transformers_image_features(llava_target, llava_dir):
    adapter = adapter_for(llava_target, "image")
    assert adapter.name == "llava"
    prompt = adapter.encode(llava_target, "w5 w6 w7", [llava_dir / "a.png", llava_dir / "c.jpg"])
    processor = llava_target.processor
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "w5 w6 w7"}]}], add_generation_prompt=True)
    images = [Image.open(llava_dir / n).convert("RGB") for n in ("a.png", "c.jpg")]
    inputs = processor(images=images, text=text, return_tensors="pt")
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    config = llava_target.model.config
    with torch.no_grad():
        expected = llava_target.model.model.get_image_features(
            pixel_values=inputs["pixel_values"], vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy).pooler_output
    # adjacent images: one run of 32, cut in two
    assert [s.start for s in prompt.spans] == [1, 17] and all(s.length == 16 for s in prompt.spans)
    for span, features in zip(prompt.spans, expected):
        assert torch.allclose(span.projected, features, atol=1e-6)
        assert torch.allclose(prompt.inputs_embeds[span.start:span.start + 16], features, atol=1e-6)
        assert span.patch_embeddings.shape == (16, 32)


def image_prompts(target, folder) -> list[Prompt]:
    adapter = adapter_for(target, "image")
    return [adapter.encode(target, "w5 w6 w7", [folder / "a.png"]),
            adapter.encode(target, "w9 w10", [folder / "c.jpg", folder / "b.png"]),
            Prompt(target.encode_prompt("w11 w12 w13 w14"))]


def test_vanilla_with_images_equals_transformers_generate(llava_target, llava_dir):
    prompt = image_prompts(llava_target, llava_dir)[0]
    ours = vanilla_generate(llava_target, [prompt], DecodeConfig(16))[0].output_ids
    processor = llava_target.processor
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "w5 w6 w7"}]}], add_generation_prompt=True)
    inputs = processor(images=Image.open(llava_dir / "a.png").convert("RGB"), text=text, return_tensors="pt")
    hf = llava_target.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert ours == hf[0, inputs["input_ids"].shape[1]:].tolist()
    without_image = vanilla_generate(llava_target, [prompt.token_ids], DecodeConfig(16))[0].output_ids
    assert without_image != ours  # the image really drives the output


@pytest.mark.parametrize("batch_size", [1, 3])
def test_tree_decoding_with_images_is_lossless(llava_target, llava_dir, batch_size):
    prompts = image_prompts(llava_target, llava_dir)
    drafter = Eagle3Drafter.from_target(llava_target, draft_vocab_size=None, seed=1).eval()
    config = DecodeConfig(24, tree=TreeShape(16, 4, 4))
    expected = [r.output_ids for r in vanilla_generate(llava_target, prompts, config)]
    got = []
    for start in range(0, len(prompts), batch_size):
        got += [r.output_ids for r in speculative_generate(llava_target, drafter, prompts[start:start + batch_size],
                                                           config)]
    assert got == expected


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def test_generate_cli_with_image(llava_dir, capsys):
    code = main(["generate", "--target", str(llava_dir), "--drafter", "random", "--prompt", "w5 w6",
                 "--image", str(llava_dir / "a.png"), "--max-new-tokens", "8"])
    assert code == 0 and "tau" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--image", "{dir}/missing.png"], "image file not found"),
    (["--image", "{dir}/broken.png"], "cannot read image"),
    (["--image", "{dir}/a.png", "--adapter", "audio"], "no modality adapter 'audio'"),
    (["--image", "{dir}/a.png", "--adapter", "text"], "takes no images"),
])
def test_generate_cli_bad_media(llava_dir, capsys, extra, message):
    args = ["generate", "--target", str(llava_dir), "--drafter", "none", "--prompt", "w5"]
    code, err = run_cli(args + [a.format(dir=llava_dir) for a in extra], capsys)
    errors = [line for line in err.splitlines() if line.startswith("mmvsd: error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err


def test_image_for_text_only_target_is_refused(tmp_path, capsys, llava_dir):
    from conftest import save_tiny_target

    folder = save_tiny_target(tmp_path / "text")
    code, err = run_cli(["generate", "--target", str(folder), "--drafter", "none", "--prompt", "w5",
                         "--image", str(llava_dir / "a.png")], capsys)
    assert code == 2 and "takes no image input" in err


def test_adapters_list_cli(capsys):
    assert main(["adapters", "list"]) == 0
    out = capsys.readouterr().out
    assert "llava" in out and "mmvsd.adapters.text" in out
