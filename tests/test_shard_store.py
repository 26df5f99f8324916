"""Committed regeneration shards (mmvsd.training.shard_store): packed as token ids, restored byte for byte, damaged
files named and regenerated, another regeneration's store refused."""

from __future__ import annotations

import hashlib
import json
import lzma

import pytest
from test_regenerate import MAX_NEW, conv
from test_regenerate_shards import CONVS, SETTINGS

from mmvsd.errors import UserError
from mmvsd.training.regenerate import source_digest
from mmvsd.training.regenerate_shards import MANIFEST, RegenerateSettings, regenerate_dataset, shard_path
from mmvsd.training.shard_store import DamagedShard, ShardStore, pack_shard, store_path, tokenizer_digest, unpack_shard


def run(target, output, store, **kwargs):
    return regenerate_dataset(target, CONVS, output, data="test", settings=kwargs.pop("settings", SETTINGS),
                              progress=False, store=store, **kwargs)


def must_not_answer(prompts, budgets, temperature, seeds):
    raise AssertionError("a restored shard must not be answered again")


def test_a_fresh_folder_is_restored_byte_for_byte_from_the_store(chat_target, tmp_path):
    store = tmp_path / "store"
    run(chat_target, tmp_path / "work", store)
    manifest = json.loads((store / MANIFEST).read_text())
    assert sorted(manifest["shards"]) == ["0", "1", "2"] and manifest["tokenizer"] == tokenizer_digest(
        chat_target.tokenizer)
    run(chat_target, tmp_path / "fresh", store, answer=must_not_answer)
    for index in range(3):
        assert shard_path(tmp_path / "fresh", index).read_bytes() == shard_path(tmp_path / "work", index).read_bytes()
    work_manifest = json.loads((tmp_path / "fresh" / MANIFEST).read_text())
    assert sorted(work_manifest["shards"]) == ["0", "1", "2"]
    assert sum(s["tokens"] for s in work_manifest["shards"].values()) == sum(
        s["tokens"] for s in manifest["shards"].values()) > 0


def test_a_work_folder_made_without_a_store_is_packed_when_one_is_named(chat_target, tmp_path):
    regenerate_dataset(chat_target, CONVS, tmp_path / "work", data="test", settings=SETTINGS, progress=False)
    run(chat_target, tmp_path / "work", tmp_path / "store", answer=must_not_answer, restore_only=True)
    assert all(store_path(tmp_path / "store", index).is_file() for index in range(3))


def test_a_damaged_shard_is_named_and_regenerated_never_read(chat_target, tmp_path, capsys):
    store = tmp_path / "store"
    run(chat_target, tmp_path / "work", store)
    damaged = store_path(store, 1)
    good = damaged.read_bytes()
    damaged.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    stats = run(chat_target, tmp_path / "fresh", store)
    assert str(damaged) in capsys.readouterr().out
    assert (stats.num_regenerated, stats.num_answers) == (3, 6)  # shard 1 alone: three conversations, two answers
    assert damaged.read_bytes() == good  # packed again, the same bytes (deterministic)
    assert shard_path(tmp_path / "fresh", 1).read_text() == shard_path(tmp_path / "work", 1).read_text()


def test_another_regeneration_is_refused_with_one_message(chat_target, tmp_path):
    store = tmp_path / "store"
    run(chat_target, tmp_path / "work", store)
    other = RegenerateSettings(max_new_tokens=MAX_NEW - 1, max_prompt_tokens=None, batch_size=2, shard_size=3)
    with pytest.raises(UserError, match="another regeneration: its key"):
        run(chat_target, tmp_path / "other", store, settings=other)
    header = {**json.loads((store / MANIFEST).read_text()), "tokenizer": "another"}
    with pytest.raises(UserError, match="another regeneration: its tokenizer"):
        ShardStore.open(store, header)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(UserError, match="not a shard store"):
        run(chat_target, tmp_path / "work2", tmp_path / "notes")


def test_answers_whose_text_does_not_come_back_from_ids_are_kept_as_text(chat_target):
    source = conv("x", ("system", "w3"), ("user", "w1 w2"), ("assistant", "w5"), ("user", "w9"), ("assistant", "w6"))
    key = {"target": "tiny-chat"}
    record = {"key": key, "conv_id": "x", "source": source_digest(source), "status": "complete",
              "turns": [{"role": "system", "text": "w3"}, {"role": "user", "text": "w1 w2"},
                        {"role": "assistant", "text": "w7  w8"},  # two spaces: the word tokenizer keeps one
                        {"role": "user", "text": "w9"}, {"role": "assistant", "text": "w10 w11"}],
              "image": None}
    sources = {("x", record["source"]): source}
    data, num_tokens = pack_shard([record], sources, chat_target.tokenizer)
    assert num_tokens == 4  # both answers counted, the one kept as text too
    head = lzma.decompress(data).split(b"\n")[1]
    assert json.loads(head)["texts"] == {"0": "w7  w8"}  # the other answer went as token ids
    assert unpack_shard(data, sources, chat_target.tokenizer, key) == [record]
    with pytest.raises(DamagedShard, match="KeyError"):  # another dataset: the source is not there
        unpack_shard(data, {}, chat_target.tokenizer, key)


def test_a_shard_that_does_not_rebuild_its_lines_is_regenerated(chat_target, tmp_path, capsys):
    store = tmp_path / "store"
    run(chat_target, tmp_path / "work", store)
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"]["2"]["lines_sha256"] = "0" * 64  # as if another tokenizer build decoded the ids otherwise
    (store / MANIFEST).write_text(json.dumps(manifest))
    stats = run(chat_target, tmp_path / "fresh", store)
    assert "does not rebuild the lines" in capsys.readouterr().out and stats.num_regenerated == 1
    assert shard_path(tmp_path / "fresh", 2).read_text() == shard_path(tmp_path / "work", 2).read_text()
    repacked = json.loads((store / MANIFEST).read_text())["shards"]["2"]["lines_sha256"]
    assert repacked == hashlib.sha256(shard_path(tmp_path / "work", 2).read_bytes()).hexdigest()  # packed anew
