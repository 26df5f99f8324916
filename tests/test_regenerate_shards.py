"""`mmvsd regenerate`'s sharded, resumable runs (mmvsd.training.regenerate_shards) on a tiny chat Llama."""

from __future__ import annotations

import json

import pytest
from test_regenerate import MAX_NEW, conv

from mmvsd.data.conversations import load_conversations
from mmvsd.errors import UserError
from mmvsd.training import regenerate_shards
from mmvsd.training.regenerate import mmvsd_answers, regenerate_conversations
from mmvsd.training.regenerate_shards import MANIFEST, RegenerateSettings, regenerate_dataset, shard_path

CONVS = [conv(f"c{i}", ("user", f"w{i + 1} w{i + 2}"), ("assistant", "w5"), ("user", "w9"), ("assistant", "w6"))
         for i in range(7)]
SETTINGS = RegenerateSettings(max_new_tokens=MAX_NEW, max_prompt_tokens=None, batch_size=2, shard_size=3)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(target, output, **kwargs):
    return regenerate_dataset(target, CONVS, output, data="test", settings=kwargs.pop("settings", SETTINGS),
                              progress=False, **kwargs)


def test_shards_hold_the_conversations_in_order_and_read_back_as_a_dataset(chat_target, tmp_path):
    out = tmp_path / "regen"
    stats = run(chat_target, out)
    shards = [lines(shard_path(out, i)) for i in range(3)]
    assert [[r["conv_id"] for r in shard] for shard in shards] == [["c0", "c1", "c2"], ["c3", "c4", "c5"], ["c6"]]
    assert not shard_path(out, 3).exists()
    whole = regenerate_conversations(chat_target, CONVS, cache_path=tmp_path / "one.jsonl", max_new_tokens=MAX_NEW,
                                     batch_size=2, progress=False)
    read = load_conversations(str(out))
    assert [(c.conv_id, c.turns) for c in read] == [(c.conv_id, c.turns) for c in whole]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["num_shards"] == 3 and sorted(manifest["shards"]) == ["0", "1", "2"]
    assert sum(s["tokens"] for s in manifest["shards"].values()) == stats.num_tokens > 0
    assert manifest["tokens_per_s"] > 0


def test_an_interrupted_run_resumes_without_duplicates_or_losses(chat_target, tmp_path):
    out, calls = tmp_path / "regen", []
    exact = mmvsd_answers(chat_target)

    def dies_on_third_call(prompts, budgets, temperature, seeds):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return exact(prompts, budgets, temperature, seeds)

    with pytest.raises(KeyboardInterrupt):
        run(chat_target, out, answer=dies_on_third_call)
    with open(shard_path(out, 1), "a") as shard:  # and a line cut off by the kill
        shard.write('{"key": {"target": "tiny')
    run(chat_target, out)
    clean = tmp_path / "clean"
    run(chat_target, clean)
    for i in range(3):
        assert lines(shard_path(out, i)) == lines(shard_path(clean, i))
    before = [shard_path(out, i).read_text() for i in range(3)]
    assert run(chat_target, out).num_regenerated == 0  # finished: nothing is generated or written again
    assert [shard_path(out, i).read_text() for i in range(3)] == before


def test_estimate_only_and_a_full_disk_write_nothing(chat_target, tmp_path, monkeypatch, capsys):
    out = tmp_path / "regen"
    run(chat_target, out, estimate_only=True)
    printed = capsys.readouterr().out
    assert "7 conversations left" in printed and "answer tokens" in printed and "tokens/s" in printed
    assert not out.exists()

    class Usage:
        free = 10

    monkeypatch.setattr(regenerate_shards.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(UserError, match="MB free.*nothing written"):
        run(chat_target, out)
    assert not out.exists()


def test_estimate_counts_the_answers_that_regeneration_caps(chat_target):
    settings = RegenerateSettings(max_new_tokens=1, max_prompt_tokens=None)
    tokens, disk = regenerate_shards.estimate_work(chat_target, CONVS, settings)
    assert tokens == 2 * len(CONVS)  # two answers each, capped at one token
    assert disk > len(CONVS) * regenerate_shards.RECORD_OVERHEAD_BYTES


def test_other_settings_or_a_foreign_folder_are_refused(chat_target, tmp_path):
    out = tmp_path / "regen"
    run(chat_target, out)
    with pytest.raises(UserError, match="another key"):
        run(chat_target, out, settings=RegenerateSettings(max_new_tokens=MAX_NEW - 1, max_prompt_tokens=None,
                                                          shard_size=3))
    with pytest.raises(UserError, match="another shard_size"):
        run(chat_target, out, settings=RegenerateSettings(max_new_tokens=MAX_NEW, max_prompt_tokens=None,
                                                          shard_size=2))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a regeneration folder"):
        run(chat_target, foreign)


def test_another_engine_joins_the_key(chat_target, tmp_path):
    def always_w7(prompts, budgets, temperature, seeds):
        return [chat_target.tokenizer.convert_tokens_to_ids(["w7"]) for _ in prompts]

    out = tmp_path / "regen"
    run(chat_target, out, answer=always_w7, engine="fake:1")
    record = lines(shard_path(out, 0))[0]
    assert record["key"]["engine"] == "fake:1"
    assert [t["text"] for t in record["turns"] if t["role"] == "assistant"] == ["w7", "w7"]
    with pytest.raises(UserError, match="another key"):
        run(chat_target, out)  # mmvsd's own answers never mix into this folder
