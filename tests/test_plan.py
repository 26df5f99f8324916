"""`mmvsd train --dry-run` for the full-size LLaVA-1.5 targets (meta device, offline), `--init vispec` for
LLaVA-1.5-13B from ViSpec's LLaVA-1.6-Vicuna-13B release, the image root of LLaVA-Instruct data, and what
`data=auto` means for an image drafter (the LLaVA mixture, or one message saying what to download)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, TimmWrapperConfig

from mmvsd.cli import main
from mmvsd.drafters import eagle1_layout
from mmvsd.errors import UserError
from mmvsd.layouts.registry import layout
from mmvsd.training.plan import DDP_BYTES, GB, image_tokens_per_image, meta_target

HEADLINE = ["train", "--target", "llava-1.5-13b", "--init", "vispec", "--dry-run"]  # the design card's command

# LLaVA-1.5-13B as llava-hf publishes it (Vicuna-13B v1.5 + CLIP ViT-L/14 at 336 px), written out here
VICUNA_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=40, vocab_size=32064, max_position_embeddings=4096)
CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768)


def direct_llava_13b_parameters() -> int:
    config = LlavaConfig(text_config=LlamaConfig(**VICUNA_13B), vision_config=CLIPVisionConfig(**CLIP_L_336),
                         image_token_index=32000)
    with torch.device("meta"):
        return sum(p.numel() for p in LlavaForConditionalGeneration(config).parameters())


def vispec_13b_trainable(num_q: int = 2) -> int:
    """ViSpec's trainable weights for Vicuna-13B, from its released names and shapes (RESOURCES.md)."""
    h, i, heads, dim = 5120, 13824, 40, 128
    eagle1 = h * 2 * h + h + 4 * h * heads * dim + 3 * h * i + h  # fc (+bias), q/k/v/o, MLP, post-attention norm
    adaptor = num_q * heads * dim + 3 * h * heads * dim + h * 2 * h + h  # imadpt.q, k/v/o, img_fc (+bias)
    return eagle1 + adaptor


def write_llava_instruct(path, image: str) -> None:
    path.write_text(json.dumps([{"id": "1", "image": image, "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat on a mat."}]}]))


@pytest.fixture
def llava_mixture(tmp_path, monkeypatch):
    """LLaVA-Instruct (one record) and its COCO image where data=auto looks: the mmvsd cache's datasets/ folder."""
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "datasets"
    (folder / "coco" / "train2017").mkdir(parents=True)
    write_llava_instruct(folder / "llava_instruct_150k.json", "000000033471.jpg")
    (folder / "coco" / "train2017" / "000000033471.jpg").write_bytes(b"jpeg")
    return folder


def test_the_headline_command_plans_offline(tmp_path, capsys, llava_mixture):
    out = tmp_path / "OUT"
    argv = ["train", "--target", "llava-1.5-13b", "--init", "vispec", "--drafter", "vispec", "--config",
            "llava_vispec_paper", "--output", str(out), "--dry-run", "--gpus", "8"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert not out.exists()  # nothing written
    assert "ViSpec's authors released no LLaVA-1.5-13B drafter" in captured.err
    assert "JLKang/ViSpec-llava-v1.6-vicuna-13b-hf" in text and "vispec:PATH" in text  # not in the HF cache here
    total = direct_llava_13b_parameters()
    assert f"{total / GB:.2f} B parameters" in text and "hidden 5120, 40 layers, vocabulary 32064" in text
    trainable = int(float(re.search(r"vispec: ([\d.]+) M trainable", text)[1]) * 1e6)
    assert abs(trainable - vispec_13b_trainable()) < 0.05e6 * 2
    eight = re.search(r"8 GPU\(s\): DDP [\d.]+ GB, ZeRO-2 [\d.]+ GB \(target ([\d.]+) \+ drafter state ([\d.]+) \| "
                      r"([\d.]+)", text)
    assert float(eight[1]) == pytest.approx(2 * total / GB, abs=0.06)  # bf16 target
    assert float(eight[2]) == pytest.approx(DDP_BYTES * vispec_13b_trainable() / GB, abs=0.006)
    assert float(eight[3]) == pytest.approx((4 + 16 / 8) * vispec_13b_trainable() / GB, abs=0.006)
    run = text.splitlines()[-1]
    assert "accelerate launch --config_file" in run and "--num_processes 8 -m mmvsd train --target llava-1.5-13b" in run
    assert "--dry-run" not in run and "--gpus" not in run


def test_the_issue_s_exact_command_plans_a_vispec_drafter(tmp_path, capsys, llava_mixture):
    """`--init vispec` with no --drafter trains the architecture the layout holds."""
    out = tmp_path / "OUT"
    assert main(["train", "--target", "llava-1.5-13b", "--init", "vispec", "--dry-run", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "drafter  vispec: 500.7 M trainable parameters" in text and not out.exists()
    assert f"data=auto: sharegpt+llava-instruct:{llava_mixture / 'llava_instruct_150k.json'}" in text
    assert "1 conversations, 1 with an image, images under" in text and "warning" not in text
    assert main(["train", "--target", "llava-1.5-13b", "--init", "msd", "--drafter", "msd", "--dry-run", "--output",
                 str(out)]) == 0
    assert "lucylyn/MSD-LLaVA1.5-13B" in capsys.readouterr().out


@pytest.mark.parametrize("config", [[], ["--config", "llava_vispec_paper"]])
def test_the_headline_command_without_the_llava_mixture_is_one_message(tmp_path, capsys, monkeypatch, config):
    """An image drafter for an image target never plans text alone: without LLaVA-Instruct and the COCO images
    where data=auto looks, the dry-run stops with one message saying what to download, where, and what to set."""
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    datasets = tmp_path / "cache" / "datasets"
    out = tmp_path / "OUT"
    assert main([*HEADLINE, *config, "--output", str(out)]) == 2
    out_text, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and not out_text
    assert lines[0].startswith("mmvsd: error: a vispec drafter for the image target llava-1.5-13b")
    for needed in (f"llava_instruct_150k.json (not at {datasets / 'llava_instruct_150k.json'})",
                   f"no folder {datasets / 'coco' / 'train2017'}", "download liuhaotian/LLaVA-Instruct-150K",
                   "images.cocodataset.org/zips/train2017.zip",
                   "data=sharegpt+llava-instruct:DIR/llava_instruct_150k.json", "image_root=DIR/train2017"):
        assert needed in lines[0], needed
    assert not out.exists()
    datasets.mkdir(parents=True)
    write_llava_instruct(datasets / "llava_instruct_150k.json", "1.jpg")  # the JSON there, the images not
    assert main([*HEADLINE, *config, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the COCO train2017 images" in err and "LLaVA-Instruct-150K's" not in err


def test_an_image_drafter_on_text_alone_is_said(tmp_path, capsys):
    """Data without images, named explicitly, plans a warning line; a text drafter on the same target plans none,
    and data=auto for it is the bundled ShareGPT (no LLaVA data needed)."""
    text = tmp_path / "chat.json"
    text.write_text(json.dumps([{"id": "1", "conversations": [{"from": "human", "value": "Hi"},
                                                              {"from": "gpt", "value": "Hello there."}]}]))
    assert main([*HEADLINE, "--data", f"sharegpt:{text}", "--output", str(tmp_path / "o")]) == 0
    plan = capsys.readouterr().out
    assert "warning  a vispec drafter for the image target llava-1.5-13b trains on text alone here" in plan
    assert "1 conversations, 0 with an image" in plan


def test_the_7b_plan_and_bad_input(tmp_path, capsys, llava_mixture):
    assert main(["train", "--target", "llava-1.5-7b", "--drafter", "msd", "--output", str(tmp_path / "o"),
                 "--dry-run", "max_steps=10"]) == 0
    text = capsys.readouterr().out
    assert "7.06 B parameters" in text and "hidden 4096, 32 layers" in text and "10 optimizer steps" in text
    code = main(["train", "--target", "no-such-model", "--output", str(tmp_path / "x"), "--dry-run"])
    assert code == 2 and "unknown target 'no-such-model'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def plan_activations(tmp_path, capsys, objective: str) -> tuple[float, float]:
    """(activations, E-step paths) in GB of the 13B paper plan at 8 x 864 tokens, the shape measured on an H200."""
    assert main(["train", "--config", "llava_vispec_paper", "--target", "llava-1.5-13b", "--init", "none",
                 "--output", str(tmp_path / "o"), "--dry-run", "batch_size=8", "max_length=864",
                 f"objective={objective}"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "1 GPU(s)" in line)
    paths = re.search(r"E-step paths ~([\d.]+)", line)
    return float(re.search(r"activations ~([\d.]+)", line)[1]), float(paths[1]) if paths else 0.0


def test_the_plan_adds_the_vsd_e_step_s_paths(tmp_path, capsys, llava_mixture):
    """The E-step term from the paper recipe's shapes, written out: the drafter's pass kept for backward (its layer
    over 8 x 864 positions, then 7 depths of 4 anchors x (40 proposals + 40 corrections + z_bar) per row) and the
    13B target's scoring block (4 x 40 x 6 trie nodes per row: KV of 40 layers x 5120, fp32 log-probs over
    32064)."""
    layer = (12 * 5120 + 3 * 13824) * 2  # bf16
    drafter_pass = 8 * 864 * layer + 8 * 4 * (40 + 41) * 7 * (layer + 32064 * 8)
    scoring = 8 * 4 * 40 * 6 * (2 * 40 * 5120 * 2 + 32064 * 8)
    ce, ce_paths = plan_activations(tmp_path, capsys, "ce")
    vsd, vsd_paths = plan_activations(tmp_path, capsys, "ce+vsd")
    rloo, rloo_paths = plan_activations(tmp_path, capsys, "ce+vsd-rloo")
    accept, accept_paths = plan_activations(tmp_path, capsys, "ce+accept")
    assert ce_paths == accept_paths == 0.0
    # accept's labels: the target's head in fp32 instead of bf16 over 8 x 864 rows, and its probabilities kept
    assert accept - ce == pytest.approx(8 * 864 * (32064 * 2 + 32064 * 4) / GB, abs=0.11)
    assert vsd_paths == pytest.approx((drafter_pass + scoring) / GB, abs=0.051)
    assert vsd - ce == pytest.approx(vsd_paths, abs=0.11)
    rloo_direct = 8 * 864 * layer + 8 * 4 * 40 * 7 * (layer + 32064 * 8) + scoring  # no corrections, no z_bar
    assert rloo_paths == pytest.approx(rloo_direct / GB, abs=0.051) and rloo_paths < vsd_paths


def released_13b_state(hidden: int = 5120, inter: int = 13824, heads: int = 40) -> dict[str, torch.Tensor]:
    """ViSpec-llava-v1.6-vicuna-13b-hf's weight names and shapes, on the meta device (no embeddings)."""
    dim = hidden // heads
    shapes = {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,),
              **{f"layers.0.self_attn.{p}_proj.weight": (heads * dim, hidden) for p in "qkv"},
              "layers.0.self_attn.o_proj.weight": (hidden, heads * dim),
              "layers.0.mlp.gate_proj.weight": (inter, hidden), "layers.0.mlp.up_proj.weight": (inter, hidden),
              "layers.0.mlp.down_proj.weight": (hidden, inter), "layers.0.post_attention_layernorm.weight": (hidden,),
              "imadpt.q": (2, heads, dim), "imadpt.k_proj.weight": (heads * dim, hidden),
              "imadpt.v_proj.weight": (heads * dim, hidden), "imadpt.o_proj.weight": (hidden, heads * dim),
              "img_fc.weight": (hidden, 2 * hidden), "img_fc.bias": (hidden,)}
    return {k: torch.empty(s, dtype=torch.float16, device="meta") for k, s in shapes.items()}


def released_13b_config(hidden: int = 5120, inter: int = 13824, heads: int = 40) -> dict:
    return {"architectures": ["LlavaLlamaForCausalLM"], "model_type": "llava", "num_hidden_layers": 1,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": heads, "vocab_size": 32064, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "max_position_embeddings": 4096}


def test_vispec_16_13b_release_loads_for_the_full_size_llava_15_13b(monkeypatch, tmp_path):
    target, _ = meta_target("llava-1.5-13b")
    release = {"config": released_13b_config(), "state": released_13b_state()}
    monkeypatch.setattr(eagle1_layout, "read_config", lambda path: release["config"])
    monkeypatch.setattr(eagle1_layout, "read_tensors", lambda path: dict(release["state"]))
    with torch.device("meta"):  # the drafter too: 0.5 B parameters, never allocated
        drafter = layout("vispec").load(tmp_path, target)
    assert drafter.fc.weight.shape == (5120, 10240) and drafter.imadpt.q.shape == (2, 40, 128)
    assert {k: tuple(v.shape) for k, v in drafter.state_dict().items() if k in release["state"]} == {
        k: tuple(v.shape) for k, v in release["state"].items()}
    # the 7B release (hidden 4096) for the 13B target: one clear error naming the widths
    release.update(config=released_13b_config(4096, 11008, 32), state=released_13b_state(4096, 11008, 32))
    with pytest.raises(UserError, match="hidden size 4096 != target's 5120"), torch.device("meta"):
        layout("vispec").load(tmp_path, target)


def test_image_root_and_missing_images_are_clear_errors(tmp_path, capsys):
    data = tmp_path / "llava_instruct.json"
    write_llava_instruct(data, "000000033471.jpg")  # a bare COCO name, as LLaVA-Instruct records have
    coco = tmp_path / "coco"
    coco.mkdir()
    common = ["train", "--target", "llava-1.5-7b", "--drafter", "vispec", "--data", f"llava-instruct:{data}",
              "--output", str(tmp_path / "out"), "--dry-run"]
    assert main([*common, f"image_root={tmp_path / 'nope'}"]) == 2
    assert "image_root" in capsys.readouterr().err
    assert main([*common, f"image_root={coco}"]) == 2
    err = capsys.readouterr().err
    assert "1 record(s) name an image that is not there" in err and str(coco / "000000033471.jpg") in err
    (coco / "000000033471.jpg").write_bytes(b"jpeg")
    assert main([*common, f"image_root={coco}"]) == 0
    assert "1 conversations, 1 with an image, images under" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_convolutional_vision_tower_plans_with_the_config_s_image_tokens(tmp_path, capsys):
    """smol-llava's tower is a timm CNN: no image_size or patch_size, so an image's tokens come from the LLaVA
    config's image_seq_length (the dry-run used to stop with an AttributeError there)."""
    config = LlavaConfig(
        text_config=LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, vocab_size=1000),
        vision_config=TimmWrapperConfig(architecture="efficientnet_lite0", do_pooling=False, num_classes=0,
                                        hidden_size=1280),
        image_token_index=999, image_seq_length=49, vision_feature_layer=-1, vision_feature_select_strategy="full")
    config.architectures = ["LlavaForConditionalGeneration"]
    assert image_tokens_per_image(config) == 49
    assert image_tokens_per_image(meta_target("llava-1.5-7b")[0].model.config) == (336 // 14) ** 2
    assert image_tokens_per_image(LlamaConfig()) == 0
    folder = tmp_path / "cnn-llava"
    folder.mkdir()
    config.to_json_file(folder / "config.json")
    data = tmp_path / "llava_instruct.json"
    write_llava_instruct(data, "cat.jpg")
    (tmp_path / "cat.jpg").write_bytes(b"jpeg")
    assert main(["train", "--target", str(folder), "--drafter", "vispec", "--data", f"llava-instruct:{data}",
                 "--output", str(tmp_path / "out"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "1 conversations, 1 with an image" in text and "vispec:" in text
    assert not (tmp_path / "out").exists()


def test_a_plan_from_an_init_drafter_has_its_draft_vocabulary(tmp_path, capsys):
    """`--init` keeps the init drafter's draft vocabulary, so the plan counts its parameters, not the config's."""
    out = tmp_path / "OUT"
    argv = ["train", "--target", "smollm2-135m", "--dry-run", "--output", str(out), "draft_vocab_size=32000"]
    assert main(argv) == 0
    assert "draft vocabulary 32000; init: none" in capsys.readouterr().out
    assert main([*argv, "--init", "eagle3-ce"]) == 0
    text = capsys.readouterr().out
    assert "drafter  eagle3: 9.8 M trainable parameters" in text and "draft vocabulary 8192; init: eagle3-ce" in text


@pytest.mark.parametrize("gpus", [0, 2])
def test_the_plan_is_for_this_machine_unless_told(tmp_path, capsys, llava_mixture, monkeypatch, gpus):
    """Without --gpus the plan is for the GPUs here, or for one process on the CPU (the plain `mmvsd train`
    command) on a machine with none."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert main([*HEADLINE, "--output", str(tmp_path / "OUT")]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps, run = next(line for line in lines if line.startswith("steps")), lines[-1]
    if gpus:
        assert "(2 GPUs x " in steps and "--num_processes 2 -m mmvsd train" in run
    else:
        assert "(1 process on the CPU x " in steps and "accelerate" not in run
        assert run.startswith("run      mmvsd train --target llava-1.5-13b --init vispec --output")
        assert not any(line.startswith("note") for line in lines)
