"""benchmarks/gpu_fullsize_llava.py's target: LLaVA-1.5's structure and image geometry, loadable as `--target`."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from conftest import load_benchmark_script
from mmvsd.target_loader import load_target


def test_the_built_folder_is_a_llava_target_with_576_image_tokens(tmp_path):
    script = load_benchmark_script("gpu_fullsize_llava")
    report = script.build(tmp_path / "target", "tiny", "cpu")
    assert report["ok"] and report["parameters"] > 0
    target = load_target(str(tmp_path / "target"))
    config = target.model.config
    assert (config.image_token_id, config.text_config.vocab_size, config.vision_config.image_size) == (32000, 32064,
                                                                                                      336)
    image = Image.fromarray(np.zeros((200, 300, 3), dtype=np.uint8))
    ids = target.processor(text="USER: <image>\nab ASSISTANT:", images=image, return_tensors="pt")["input_ids"][0]
    assert int((ids == 32000).sum()) == 576  # (336 / 14)^2 patches, as LLaVA-1.5
    tokenizer = target.processor.tokenizer
    for text in ("héllo", "a\tb\nc"):
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # one token per character
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_first_mismatch_and_the_profile_tables(tmp_path):
    from mmvsd.decoding.costs import CostTable

    script = load_benchmark_script("gpu_fullsize_llava")
    assert script.first_mismatch([5, 6, 7], [5, 6, 7]) is None
    assert script.first_mismatch([5, 9, 7], [5, 6, 7]) == 2  # counting new tokens from 1
    assert script.first_mismatch([5, 6], [5, 6, 7]) == 3  # one stopped early
    table = CostTable(key={"target": "t"}, target_tokens=(1, 64), target_seconds={1: (0.02769, 0.02976)},
                      draft_widths=(1,), draft_seconds={1: (0.00204,)}, draft_fixed_seconds={1: 0.00258},
                      context=256)
    cached = tmp_path / "profile.json"
    cached.write_text(json.dumps(table.to_json()))
    log = f"costs of t ...\nverify step (Target.forward over N tree tokens + keep):\nprofile cached in {cached}\n"
    assert script.cost_tables(log) == {"verify_ms": {1: 27.69, 64: 29.76}, "expand_ms": {1: 2.04}}


def test_the_memory_poller_asks_nvidia_smi_for_the_gpu_torch_means(monkeypatch):
    script = load_benchmark_script("gpu_fullsize_llava")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert script.nvidia_smi_index("cuda") == "0"
    assert script.nvidia_smi_index("cuda:3") == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")  # torch's cuda:1 is nvidia-smi's GPU 6
    assert script.nvidia_smi_index("cuda:1") == "6"
    assert script.nvidia_smi_index("cuda:0") == "4"
