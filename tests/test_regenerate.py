"""On-policy regeneration (mmvsd.training.regenerate) on a tiny random Llama with a chat-template tokenizer."""

from __future__ import annotations

import json

import pytest

from mmvsd.data.conversations import Conversation, Turn
from mmvsd.decoding.decode import DecodeConfig, vanilla_generate
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.training import regenerate as regenerate_module
from mmvsd.training.regenerate import RegenerateStats, regenerate_conversations

MAX_NEW = 10


def conv(conv_id: str, *pairs: tuple[str, str]) -> Conversation:
    return Conversation(conv_id, [Turn(role, text) for role, text in pairs])


CONVS = [
    conv("a", ("user", "w1 w2 w3"), ("assistant", "w5"), ("user", "w9 w8"), ("assistant", "w6")),
    conv("b", ("system", "w20"), ("user", "w40 w41"), ("assistant", "w7")),
    conv("c", ("user", "w11"), ("assistant", "w12"), ("user", "w13 w14 w15"), ("assistant", "w16"),
         ("user", "w17"), ("assistant", "w18")),
]


def template_ids(target: Target, turns: list[Turn]) -> list[int]:
    messages = [{"role": t.role, "content": t.text} for t in turns]
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def counting_generate(monkeypatch) -> list[int]:
    """Wrap vanilla_generate in the module under test; returns the list of batch sizes it was called with."""
    calls: list[int] = []

    def wrapper(target, prompts, config, **kwargs):
        calls.append(len(prompts))
        return vanilla_generate(target, prompts, config, **kwargs)

    monkeypatch.setattr(regenerate_module, "vanilla_generate", wrapper)
    return calls


def test_greedy_matches_hand_decoding_with_regenerated_history(chat_target, tmp_path):
    first_turns = CONVS[0].turns
    [out] = regenerate_conversations(chat_target, [CONVS[0]], cache_path=tmp_path / "c.jsonl",
                                     max_new_tokens=MAX_NEW, progress=False)
    config = DecodeConfig(max_new_tokens=MAX_NEW)
    prompt1 = template_ids(chat_target, first_turns[:1])
    answer1 = chat_target.decode(vanilla_generate(chat_target, [prompt1], config)[0].output_ids)
    history = [first_turns[0], Turn("assistant", answer1), first_turns[2]]
    prompt2 = template_ids(chat_target, history)
    answer2 = chat_target.decode(vanilla_generate(chat_target, [prompt2], config)[0].output_ids)
    assert answer1.strip() and answer1 != "w5"
    assert out.turns == history + [Turn("assistant", answer2)]
    assert answer1 in chat_target.tokenizer.decode(prompt2)  # the 2nd prompt holds the regenerated answer
    assert out.conv_id == "a" and out.image is None


def test_resume_after_interrupt_generates_only_the_missing(chat_target, tmp_path, monkeypatch):
    cache = tmp_path / "cache.jsonl"
    calls = counting_generate(monkeypatch)
    first = regenerate_conversations(chat_target, CONVS, cache_path=cache, max_new_tokens=MAX_NEW,
                                     batch_size=2, progress=False)
    assert [c.conv_id for c in first] == ["a", "b", "c"]
    assert sum(calls) == 6  # one row per assistant turn
    lines = cache.read_text().splitlines(keepends=True)
    assert len(lines) == 3
    done_first = json.loads(lines[0])["conv_id"]
    cache.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # killed mid-write of the 2nd line
    calls.clear()
    stats = RegenerateStats()
    again = regenerate_conversations(chat_target, CONVS, cache_path=cache, max_new_tokens=MAX_NEW,
                                     batch_size=2, progress=False, stats=stats)
    assert again == first
    assert stats.num_cached == 1 and stats.num_regenerated == 2
    assert sum(calls) == 6 - len([t for t in next(c for c in CONVS if c.conv_id == done_first).turns
                                  if t.role == "assistant"])
    assert [json.loads(line)["conv_id"] for line in cache.read_text().splitlines()].count(done_first) == 1
    calls.clear()
    assert regenerate_conversations(chat_target, CONVS[::-1], cache_path=cache, max_new_tokens=MAX_NEW,
                                    progress=False) == first[::-1]
    assert calls == []


def test_a_record_holding_unicode_line_separators_resumes(chat_target, tmp_path):
    """JSON written with ensure_ascii=False keeps U+2028, U+2029 and U+0085 as they are (ShareGPT's texts have
    them); the cache is read at "\\n" alone, so such a record is one line, found again on resume."""
    cache = tmp_path / "cache.jsonl"
    odd = conv("odd", ("user", "w1\u2028w2\u2029w3\x85w4"), ("assistant", "w5"))
    first = regenerate_conversations(chat_target, [odd, CONVS[1]], cache_path=cache, max_new_tokens=MAX_NEW,
                                     progress=False)
    assert "\u2028" in cache.read_text(encoding="utf-8")  # written unescaped
    stats = RegenerateStats()
    again = regenerate_conversations(chat_target, [odd, CONVS[1]], cache_path=cache, max_new_tokens=MAX_NEW,
                                     progress=False, stats=stats)
    assert again == first and stats.num_cached == 2 and stats.num_regenerated == 0


def test_cache_with_other_settings_or_garbage_is_refused(chat_target, tmp_path):
    cache = tmp_path / "cache.jsonl"
    regenerate_conversations(chat_target, CONVS[1:2], cache_path=cache, max_new_tokens=MAX_NEW, progress=False)
    with pytest.raises(UserError, match="other settings.*another cache path"):
        regenerate_conversations(chat_target, CONVS[1:2], cache_path=cache, max_new_tokens=MAX_NEW + 1,
                                 progress=False)
    with pytest.raises(UserError, match="other settings"):
        regenerate_conversations(chat_target, CONVS[1:2], cache_path=cache, max_new_tokens=MAX_NEW, seed=1,
                                 progress=False)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"not": "a cache"}\n')
    with pytest.raises(UserError, match="line 1 is not a regeneration cache"):
        regenerate_conversations(chat_target, CONVS[1:2], cache_path=garbage, progress=False)
    dataset = tmp_path / "dataset.json"  # a user file passed by mistake: refused and left untouched
    dataset.write_text('[{"id": "x", "conversations": []}]')
    with pytest.raises(UserError, match="not a regeneration cache"):
        regenerate_conversations(chat_target, CONVS[1:2], cache_path=dataset, progress=False)
    assert dataset.read_text() == '[{"id": "x", "conversations": []}]'
    with_image = Conversation("img", CONVS[1].turns, image="/tmp/x.png")
    with pytest.raises(UserError, match="image"):
        regenerate_conversations(chat_target, [with_image], cache_path=tmp_path / "i.jsonl", progress=False)


def test_sampling_is_independent_of_batch_size_order_and_resume(chat_target, tmp_path, monkeypatch):
    common = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": 5, "progress": False}
    one = regenerate_conversations(chat_target, CONVS, cache_path=tmp_path / "1.jsonl", batch_size=1, **common)
    calls = counting_generate(monkeypatch)
    three = regenerate_conversations(chat_target, CONVS[::-1], cache_path=tmp_path / "3.jsonl", batch_size=3,
                                     **common)
    assert three[::-1] == one
    assert set(calls) == {1}  # T > 0: one answer per call, so rows never share a generator
    cache = tmp_path / "1.jsonl"
    cache.write_text(cache.read_text().splitlines(keepends=True)[1])  # resume from the middle conversation
    assert regenerate_conversations(chat_target, CONVS, cache_path=cache, batch_size=2, **common) == one
    other_seed = regenerate_conversations(chat_target, CONVS, cache_path=tmp_path / "s.jsonl",
                                          **{**common, "seed": 6})
    assert other_seed != one
    greedy = regenerate_conversations(chat_target, CONVS, cache_path=tmp_path / "g.jsonl", max_new_tokens=MAX_NEW,
                                      progress=False)
    assert greedy != one


def test_stats_count_answers_and_their_generated_tokens(chat_target, tmp_path, monkeypatch):
    generated: list[int] = []

    def wrapper(target, prompts, config, **kwargs):
        results = vanilla_generate(target, prompts, config, **kwargs)
        generated.extend(len(r.output_ids) for r in results)
        return results

    monkeypatch.setattr(regenerate_module, "vanilla_generate", wrapper)
    stats = RegenerateStats()
    regenerate_conversations(chat_target, CONVS, cache_path=tmp_path / "c.jsonl", max_new_tokens=MAX_NEW,
                             batch_size=2, progress=False, stats=stats)
    assert stats.num_answers == len(generated) > len(CONVS)  # multi-turn conversations answer more than once
    assert stats.num_tokens == sum(generated) > 0
    assert f"{stats.num_tokens} tokens" in stats.summary()


def test_too_long_prompt_stops_the_conversation_and_is_counted(chat_target, tmp_path):
    long_text = " ".join(["w3"] * (chat_target.max_positions - MAX_NEW))
    convs = [
        conv("fits", ("user", "w1"), ("assistant", "w2")),
        conv("long-first", ("user", long_text), ("assistant", "w2")),
        conv("long-second", ("user", "w1 w2"), ("assistant", "w4"), ("user", long_text), ("assistant", "w5")),
    ]
    stats = RegenerateStats()
    out = regenerate_conversations(chat_target, convs, cache_path=tmp_path / "c.jsonl", max_new_tokens=MAX_NEW,
                                   progress=False, stats=stats)
    assert [c.conv_id for c in out] == ["fits", "long-second"]
    assert [t.role for t in out[1].turns] == ["user", "assistant"]  # kept up to the last regenerated answer
    assert stats.num_too_long == 2 and stats.num_dropped == 1 and stats.num_answers == 2
    statuses = [json.loads(line)["status"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert sorted(statuses) == ["complete", "too_long", "too_long"]


def test_leading_assistant_turn_is_dropped_and_trailing_user_turn_kept(chat_target, tmp_path):
    greeting = conv("g", ("assistant", "w50"), ("user", "w1 w2 w3"), ("assistant", "w5"), ("user", "w60"))
    [out] = regenerate_conversations(chat_target, [greeting], cache_path=tmp_path / "c.jsonl",
                                     max_new_tokens=MAX_NEW, progress=False)
    [reference] = regenerate_conversations(chat_target, [CONVS[0]], cache_path=tmp_path / "r.jsonl",
                                           max_new_tokens=MAX_NEW, progress=False)
    assert [t.role for t in out.turns] == ["user", "assistant", "user"]
    assert out.turns[:2] == reference.turns[:2] and out.turns[2].text == "w60"


def test_encode_chat_handles_list_and_dict_returns(chat_target, monkeypatch):
    turns = CONVS[0].turns[:1]
    messages = [{"role": t.role, "content": t.text} for t in turns]
    expected = template_ids(chat_target, turns)
    monkeypatch.setattr(chat_target.tokenizer, "apply_chat_template",
                        lambda *a, **k: {"input_ids": list(expected)})
    assert chat_target.encode_chat(messages) == expected
    monkeypatch.setattr(chat_target.tokenizer, "apply_chat_template", lambda *a, **k: list(expected))
    assert chat_target.encode_chat(messages) == expected


def test_training_length_stops_conversations_and_caps_answers(chat_target, tmp_path):
    """max_prompt_tokens (the training max_length): no answer is asked for a prompt that long, and an answer
    is generated only up to that length plus the margin."""
    long_conv = CONVS[2]
    first_prompt = len(template_ids(chat_target, long_conv.turns[:1]))
    limit = first_prompt + 2  # room for a 2-token answer (+ margin), never for the second user turn
    [out] = regenerate_conversations(chat_target, [long_conv], cache_path=tmp_path / "c.jsonl", max_new_tokens=40,
                                     max_prompt_tokens=limit, progress=False)
    assert [t.role for t in out.turns] == ["user", "assistant"]  # stopped: the 2nd prompt would reach the limit
    budget = regenerate_module.answer_budget(first_prompt, 40, limit)
    assert budget == 2 + regenerate_module.BUDGET_MARGIN
    full = vanilla_generate(chat_target, [template_ids(chat_target, long_conv.turns[:1])],
                            DecodeConfig(max_new_tokens=40))[0].output_ids
    expected = full[:budget]
    eos = [i for i, t in enumerate(expected) if t in chat_target.eos_token_ids]
    assert out.turns[1].text == chat_target.decode(expected[: eos[0]] if eos else expected)
    record = json.loads((tmp_path / "c.jsonl").read_text())
    assert record["status"] == "too_long" and record["key"]["max_prompt_tokens"] == limit


def test_default_cache_is_shared_per_settings(chat_target, tmp_path, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    calls = counting_generate(monkeypatch)
    first = regenerate_conversations(chat_target, CONVS[:2], max_new_tokens=MAX_NEW, progress=False)
    files = list((tmp_path / "cache" / "regenerated").glob("tiny-chat-*.jsonl"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) == 2
    calls.clear()
    assert regenerate_conversations(chat_target, CONVS[:2], max_new_tokens=MAX_NEW, progress=False) == first
    assert calls == []  # a second run reuses the answers
    regenerate_conversations(chat_target, CONVS[:1], max_new_tokens=MAX_NEW + 1, progress=False)
    assert len(list((tmp_path / "cache" / "regenerated").glob("*.jsonl"))) == 2  # other settings: another file


def test_vanilla_row_budgets_cut_each_row_like_its_own_run(chat_target):
    prompts = [template_ids(chat_target, CONVS[i].turns[:1]) for i in (0, 2)]
    config = DecodeConfig(max_new_tokens=12)
    full = [r.output_ids for r in vanilla_generate(chat_target, prompts, config)]
    cut = vanilla_generate(chat_target, prompts, config, row_max_new_tokens=[3, 12])
    assert cut[0].output_ids == full[0][:3] and cut[1].output_ids == full[1]
    with pytest.raises(UserError, match="one budget"):
        vanilla_generate(chat_target, prompts, config, row_max_new_tokens=[13, 1])
