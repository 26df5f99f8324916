"""`data=auto` (the default): ShareGPT for a text drafter or target, the LLaVA mixture for an image drafter on an
image target, one message when that is not on disk; an image drafter on text alone is said, never silent."""

from __future__ import annotations

import json
import logging

import pytest

from mmvsd.errors import UserError
from mmvsd.training.config import TrainConfig
from mmvsd.training.trainer import train
from mmvsd.training.training_data import resolve_training_data


def image_drafter_config(llava_dir, tmp_path, **values) -> TrainConfig:
    settings = dict(target=str(llava_dir), drafter="vispec", output=str(tmp_path / "out"), max_steps=1,
                    batch_size=2, validation_fraction=0.0, progress=False, max_length=64)
    config = TrainConfig(**{**settings, **values})
    config.loss.ttt_steps = 2
    return config


def put_llava_mixture(cache, image_name: str = "000000033471.jpg"):
    """LLaVA-Instruct (one record) and its image where data=auto looks for them."""
    images = cache / "datasets" / "coco" / "train2017"
    images.mkdir(parents=True)
    (images / image_name).write_bytes(b"jpeg")
    (cache / "datasets" / "llava_instruct_150k.json").write_text(json.dumps([{"id": "1", "image": image_name,
        "conversations": [{"from": "human", "value": "<image>\nw5 w6"}, {"from": "gpt", "value": "w7 w8"}]}]))


def test_auto_is_sharegpt_unless_an_image_drafter_meets_an_image_target(llava_target, llava_dir, tmp_path, tiny_target,
                                                                         monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    assert TrainConfig().data == "auto"
    eagle3 = image_drafter_config(llava_dir, tmp_path, drafter="eagle3")
    assert resolve_training_data(eagle3, llava_target).data == "sharegpt"  # a text drafter
    assert resolve_training_data(image_drafter_config(llava_dir, tmp_path), tiny_target).data == "sharegpt"
    explicit = image_drafter_config(llava_dir, tmp_path, data="sharegpt")
    assert resolve_training_data(explicit, llava_target) is explicit  # given data is kept as it is
    with pytest.raises(UserError, match="trains on the LLaVA mixture"):
        resolve_training_data(image_drafter_config(llava_dir, tmp_path), llava_target)
    put_llava_mixture(tmp_path / "cache")
    resolved = resolve_training_data(image_drafter_config(llava_dir, tmp_path), llava_target)
    datasets = tmp_path / "cache" / "datasets"
    assert resolved.data == f"sharegpt+llava-instruct:{datasets / 'llava_instruct_150k.json'}"
    assert resolved.image_root == str(datasets / "coco" / "train2017")
    own_root = tmp_path / "coco"
    own_root.mkdir()
    assert resolve_training_data(image_drafter_config(llava_dir, tmp_path, image_root=str(own_root)),
                                 llava_target).image_root == str(own_root)


def test_training_stops_before_writing_when_the_mixture_is_missing(llava_target, llava_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    config = image_drafter_config(llava_dir, tmp_path)
    with pytest.raises(UserError, match="llava_instruct_150k.json .* not on disk"):
        train(config, target=llava_target)
    assert not (tmp_path / "out").exists()


def test_an_image_drafter_trained_on_text_alone_is_warned(llava_target, llava_dir, tmp_path, caplog):
    data = tmp_path / "chat.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": "w5 w6 w7"},
                                                                 {"from": "gpt", "value": "w8 w9 w10 w11"}]}
                                for i in range(4)]))
    config = image_drafter_config(llava_dir, tmp_path, data=f"sharegpt:{data}")
    with caplog.at_level(logging.WARNING, logger="mmvsd.training.trainer"):
        train(config, target=llava_target)
    assert "a vispec drafter for the image target" in caplog.text and "trains on text alone" in caplog.text
