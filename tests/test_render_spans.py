"""Loss spans of chat-template renders: a short answer that also occurs in the user turn is masked in
the assistant turn, and a chat template that fails on a prefix is an error, never a silent guess."""

from __future__ import annotations

import pytest

from mmvsd.data.conversations import Turn
from mmvsd.data.render import _render_chat_template
from mmvsd.errors import UserError


class TemplateTokenizer:
    """A tokenizer stand-in with a ChatML-like template; `fail_on_prefix` breaks renders of prefixes,
    `other_prompt` renders a generation prompt the full conversation does not contain."""

    all_special_tokens = ("<end>",)
    chat_template = "fake"

    def __init__(self, fail_on_prefix: bool = False, other_prompt: bool = False) -> None:
        self.fail_on_prefix = fail_on_prefix
        self.other_prompt = other_prompt
        self.full_length = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if self.full_length is None:
            self.full_length = len(messages)
        elif self.fail_on_prefix and len(messages) < self.full_length:
            raise ValueError("template error: roles must alternate")
        text = "".join(f"<{m['role']}>{m['content']}<end>\n" for m in messages)
        if add_generation_prompt:
            text += "<bot>" if self.other_prompt else "<assistant>"
        return text


TURNS = [Turn("user", "Is it yes or no? Say yes"), Turn("assistant", "yes"),
         Turn("user", "and again: yes"), Turn("assistant", "yes")]


@pytest.mark.parametrize("other_prompt", [False, True])
def test_a_short_answer_is_masked_in_its_own_turn(other_prompt):
    text, spans = _render_chat_template(TemplateTokenizer(other_prompt=other_prompt), TURNS)
    assistant_starts = [i + len("<assistant>") for i in range(len(text)) if text.startswith("<assistant>", i)]
    assert [start for start, _ in spans] == assistant_starts
    assert [text[start:end] for start, end in spans] == ["yes<end>", "yes<end>"]


def test_a_template_error_on_a_prefix_is_a_clear_error():
    with pytest.raises(UserError, match="chat template fails on a conversation prefix .ValueError: template error"):
        _render_chat_template(TemplateTokenizer(fail_on_prefix=True), TURNS)
