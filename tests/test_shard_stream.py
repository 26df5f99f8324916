"""Training on a regeneration folder while it grows (`data_order=shards`, mmvsd.training.shard_stream): the finished
shards as one stream, a run that stops where they end and resumes past them to the weights of a run in one go."""

from __future__ import annotations

import json
import logging
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, save_tiny_target, write_sharegpt
from mmvsd.cli import main
from mmvsd.data.conversations import load_conversations
from mmvsd.errors import UserError
from mmvsd.target_loader import load_target
from mmvsd.training import shard_stream, trainer
from mmvsd.training.config import TrainConfig
from mmvsd.training.regenerate import source_digest
from mmvsd.training.regenerate_shards import MANIFEST, shard_path
from mmvsd.training.shard_stream import check_stream_resume, load_shard_stream, stream_indices


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target, its regeneration of 12 conversations in 3 shards of 4, and a copy caught while shard 2 is
    being written (one line of it on disk, not in the manifest)."""
    root = tmp_path_factory.mktemp("stream")
    target = save_tiny_target(root / "target")
    data = write_sharegpt(root / "data.json", num=12)
    full = root / "full"
    assert main(["regenerate", "--target", str(target), "--data", str(data), "--output", str(full), "--shard-size",
                 "4", "--batch-size", "4", "--max-new-tokens", "6", "--max-length", "0"]) == 0
    growing = root / "growing"
    shutil.copytree(full, growing)
    manifest = json.loads((growing / MANIFEST).read_text())
    del manifest["shards"]["2"]
    (growing / MANIFEST).write_text(json.dumps(manifest))
    shard_path(growing, 2).write_text(shard_path(full, 2).read_text().splitlines()[0] + "\n")
    return target, full, growing


def test_the_stream_takes_each_shard_in_its_own_order_and_a_new_shard_only_appends():
    blocks = [5, 3, 4]
    stream = [i for step in range(6) for i in stream_indices(blocks, 2, seed=1, micro_step=step)]
    assert sorted(stream[:5]) == list(range(5)) and sorted(stream[5:8]) == [5, 6, 7]
    assert sorted(stream[8:]) == [8, 9, 10, 11] and stream != list(range(12))  # shuffled inside each shard
    shorter = [stream_indices(blocks[:2], 2, seed=1, micro_step=step) for step in range(5)]
    assert [i for batch in shorter[:4] for i in batch] == stream[:8] and shorter[4] is None


def test_finished_shards_are_read_the_one_being_written_is_not_and_validation_stays_put(folders):
    target_dir, full, growing = folders
    target = load_target(str(target_dir))
    whole = load_shard_stream(target, full, max_length=512, validation_fraction=0.25, seed=0)
    part = load_shard_stream(target, growing, max_length=512, validation_fraction=0.25, seed=0)
    assert len(whole.blocks) == 3 and part.blocks == whole.blocks[:2] and part.key == whole.key
    assert [ex.input_ids for ex in part.train] == [ex.input_ids for ex in whole.train[: sum(part.blocks)]]
    assert [ex.input_ids for ex in part.validation] == [ex.input_ids for ex in whole.validation[:2]]  # 1 per shard
    assert whole.planned == sum(whole.blocks) and part.planned == sum(whole.blocks)  # 3 of 4 per shard, 12 in all


def train(target, data, out, *extra: str) -> int:
    return main(["train", "--target", str(target), "--data", str(data), "--output", str(out), *TINY,
                 "data_order=shards", "learning_rate=0.01", "save_every=1", *extra])


def test_a_run_stops_where_the_shards_end_and_resumes_to_the_weights_of_one_go(folders, tmp_path, caplog):
    """From the same start (`--init`: a fresh drafter counts its draft vocabulary on the shards finished when the
    run starts), a run that waits for shard 2 ends with the weights of a run on all three shards in one go."""
    target, full, growing = folders
    live = tmp_path / "live"  # this test finishes its shard 2
    shutil.copytree(growing, live)
    start = tmp_path / "start"
    assert main(["train", "--target", str(target), "--data", str(full), "--output", str(start), *TINY,
                 "max_steps=1"]) == 0
    assert train(target, full, tmp_path / "one-go", "--init", str(start)) == 0  # 12 examples, batches of 2: 6 steps
    out = tmp_path / "growing-run"
    with caplog.at_level(logging.WARNING, logger="mmvsd.training.trainer"):
        assert train(target, live, out, "--init", str(start)) == 0
    assert "trained through the 2 finished shards at step 4 of 6" in caplog.text
    assert trainer.latest_checkpoint(out).name == "step-0000004" and (out / "model.safetensors").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mmvsd.training.trainer"):
        assert train(target, live, out, "--init", str(start), "--resume") == 0  # no new shard: nothing written
    assert "nothing to train" in caplog.text and trainer.latest_checkpoint(out).name == "step-0000004"
    shutil.copy(shard_path(full, 2), shard_path(live, 2))  # the regeneration finishes shard 2
    shutil.copy(full / MANIFEST, live / MANIFEST)
    assert train(target, live, out, "--init", str(start), "--resume") == 0
    state = json.loads((trainer.latest_checkpoint(out) / trainer.STATE_FILE).read_text())
    assert state["step"] == 6 and state["planned_steps"] == 6 and len(state["data_blocks"]) == 3
    one_go = load_file(str(tmp_path / "one-go" / "model.safetensors"))
    resumed = load_file(str(out / "model.safetensors"))
    assert one_go.keys() == resumed.keys() and all(torch.equal(one_go[k], resumed[k]) for k in one_go)


def test_a_run_that_waits_for_shards_trains_through_them_as_they_finish(folders, tmp_path, monkeypatch, caplog):
    """`wait_for_shards=true`: at the finished shards' end the run reads the manifest again until the next shard is
    there, and trains through the shard that finished while it waited."""
    target, full, growing = folders
    live = tmp_path / "live"
    shutil.copytree(growing, live)
    waits = []

    def regeneration_finishes_shard_2(seconds: float) -> None:  # while the run waits, once
        waits.append(seconds)
        if len(waits) == 2:
            shutil.copy(shard_path(full, 2), shard_path(live, 2))
            shutil.copy(full / MANIFEST, live / MANIFEST)  # written last, as regenerate does (atomically)

    monkeypatch.setattr(shard_stream, "time", SimpleNamespace(monotonic=time.monotonic,
                                                              sleep=regeneration_finishes_shard_2))
    with caplog.at_level(logging.WARNING, logger="mmvsd.training"):
        assert train(target, live, tmp_path / "follow", "wait_for_shards=true", "max_steps=6") == 0
    assert waits == [shard_stream.POLL_SECONDS] * 2
    assert "waiting for shard 2" in caplog.text and "trained through" not in caplog.text
    state = json.loads((trainer.latest_checkpoint(tmp_path / "follow") / trainer.STATE_FILE).read_text())
    assert state["step"] == 6 and len(state["data_blocks"]) == 3
    with pytest.raises(UserError, match="takes data_order=shards"):
        TrainConfig(target="t", output="o", wait_for_shards=True).validate()


def test_a_resume_on_other_shards_or_settings_is_refused(folders, tmp_path, capsys):
    target, full, growing = folders
    stream = load_shard_stream(load_target(str(target)), full, max_length=512, validation_fraction=0, seed=0)
    with pytest.raises(UserError, match="another regeneration"):
        check_stream_resume("0123456789abcdef", stream.blocks, stream, tmp_path)
    with pytest.raises(UserError, match="the shards it trained on changed"):
        check_stream_resume(stream.key, [stream.blocks[0] + 1], stream, tmp_path)
    assert train(target, tmp_path, tmp_path / "out") == 2  # not a regeneration folder
    assert "not one (no manifest.json)" in capsys.readouterr().err
    with pytest.raises(UserError, match="features=online and regenerate=none"):
        TrainConfig(target="t", output="o", data_order="shards", features="offline", feature_cache="c").validate()


def test_regenerate_reads_a_mixture_as_train_does(tmp_path):
    """`--data A+B` is the two datasets one after the other (as `mmvsd train --data` mixes them), cut at
    --num-conversations."""
    target = save_tiny_target(tmp_path / "target")
    first, second = write_sharegpt(tmp_path / "a.json", num=3, seed=1), write_sharegpt(tmp_path / "b.json", seed=2)
    out = tmp_path / "out"
    assert main(["regenerate", "--target", str(target), "--data", f"{first}+{second}", "--output", str(out),
                 "--num-conversations", "5", "--max-new-tokens", "4", "--max-length", "0"]) == 0
    records = [json.loads(line) for line in shard_path(out, 0).read_text().splitlines()]
    wanted = load_conversations(str(first)) + load_conversations(str(second))[:2]
    assert [r["source"] for r in records] == [source_digest(conv) for conv in wanted]
    assert json.loads((out / MANIFEST).read_text())["num_conversations"] == 5
