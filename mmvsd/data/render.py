"""Render conversations into training examples (token ids + loss mask) and split them.

Loss mask convention (as EAGLE / SpecForge): 1 on the tokens of every assistant turn's content and
on the end-of-turn token that closes it (e.g. `<|im_end|>` in ChatML), 0 on everything else
(system and user turns, template scaffolding, the assistant header such as
`<|im_start|>assistant\\n`, the newline after `<|im_end|>`).

How spans are found: the conversation is rendered once with the tokenizer's chat template; for
assistant turn i the prefix `turns[:i]` is rendered with the generation prompt, so the turn's
content starts after it (the header is never masked) and is located there verbatim (or stripped,
for templates that trim). The end-of-turn token is the first special token after the content
within the turn's own render (`turns[:i+1]`). Character spans become token masks through the fast
tokenizer's offsets, so the ids equal a plain tokenization of the rendered text.

Tokenizers without a chat template use a documented plain format instead:
`System: ...\\n`, `User: ...\\n`, `Assistant: ...\\n`; there the masked span is the assistant text
plus the newline that ends it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mmvsd.data.conversations import Conversation, Turn
from mmvsd.errors import UserError
from mmvsd.target import PLAIN_PREFIXES

logger = logging.getLogger(__name__)

T = TypeVar("T")
Span = tuple[int, int]  # [start, end) character offsets in the rendered text



@dataclass
class RenderedExample:
    """One training example: token ids and a 0/1 mask of the positions the drafter learns."""

    input_ids: list[int]
    loss_mask: list[int]
    media: tuple[str, ...] = ()  # media files whose spans the ids hold (placeholders already expanded)


def render_conversation(tokenizer: Any, conv: Conversation, max_length: int) -> RenderedExample | None:
    """Tokenize a conversation with its loss mask, truncated to `max_length` (start kept).

    Returns None when no loss-bearing token survives (no assistant turn, or truncated away).
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if getattr(tokenizer, "chat_template", None):
        text, spans = _render_chat_template(tokenizer, conv.turns)
    else:
        text, spans = render_plain(conv.turns)
    input_ids, loss_mask = tokenize_with_spans(tokenizer, text, spans, max_length=max_length)
    if not any(loss_mask):
        return None
    return RenderedExample(input_ids=input_ids, loss_mask=loss_mask)


def render_plain(turns: Sequence[Turn]) -> tuple[str, list[Span]]:
    """The fallback format (`User: ...\\nAssistant: ...\\n`) and its assistant spans (text + newline)."""
    pieces, spans, length = [], [], 0
    for turn in turns:
        header = PLAIN_PREFIXES[turn.role]
        body = turn.text + "\n"
        if turn.role == "assistant":
            spans.append((length + len(header), length + len(header) + len(body)))
        pieces.append(header + body)
        length += len(header) + len(body)
    return "".join(pieces), spans


def _apply_template(tokenizer: Any, turns: Sequence[Turn], add_generation_prompt: bool) -> str:
    """Chat-template text of `turns` (no tokenization)."""
    messages = [{"role": turn.role, "content": turn.text} for turn in turns]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _render_chat_template(tokenizer: Any, turns: Sequence[Turn]) -> tuple[str, list[Span]]:
    """Rendered text of the whole conversation and the character span of each assistant turn."""
    full = _apply_template(tokenizer, turns, add_generation_prompt=False)
    special_tokens = _special_token_strings(tokenizer)
    spans, cursor = [], 0
    for i, turn in enumerate(turns):
        if turn.role != "assistant":
            continue
        start = max(cursor, _content_search_start(tokenizer, turns[:i], full))
        content_start, content_end = _find_content(full, turn.text, start)
        with_turn = _apply_template(tokenizer, turns[: i + 1], add_generation_prompt=False)
        turn_end = len(with_turn) if full.startswith(with_turn) else len(full)
        end = _end_of_turn(full, content_end, turn_end, special_tokens)
        spans.append((content_start, end))
        cursor = end
    return full, spans


def _content_search_start(tokenizer: Any, history: Sequence[Turn], full: str) -> int:
    """Where an assistant reply to `history` can start in the rendered conversation: after the history's
    generation prompt, else after the history itself. Never before it, so a short answer that also occurs
    in a user turn cannot be masked there; a template that renders neither as a prefix is an error."""
    if not history:
        return 0
    for add_generation_prompt in (True, False):
        try:
            prefix = _apply_template(tokenizer, history, add_generation_prompt=add_generation_prompt)
        except Exception as err:  # noqa: BLE001 - jinja raises anything a template author wrote
            raise UserError(f"the tokenizer's chat template fails on a conversation prefix ({type(err).__name__}: "
                            f"{str(err)[:120]}), so the loss mask cannot be built") from None
        if full.startswith(prefix):
            return len(prefix)
    raise UserError("the tokenizer's chat template renders a conversation's first turns differently from the "
                    "whole conversation, so an assistant turn cannot be located safely for the loss mask")


def _find_content(full: str, text: str, start: int) -> Span:
    """Span of an assistant text in the rendered conversation, searched from `start`."""
    for candidate in (text, text.strip()):
        index = full.find(candidate, start)
        if candidate and index >= 0:
            return index, index + len(candidate)
    raise UserError("the tokenizer's chat template does not render assistant text verbatim, so the "
                    f"loss mask cannot be built (looked for {text[:60]!r})")


def _end_of_turn(full: str, content_end: int, turn_end: int, special_tokens: Sequence[str]) -> int:
    """End of the first special token (the end-of-turn marker) after an assistant turn's content."""
    tail = full[content_end:turn_end]
    best = None
    for token in special_tokens:
        index = tail.find(token)
        if index >= 0 and (best is None or index < best[0] or (index == best[0] and len(token) > best[1])):
            best = (index, len(token))
    return content_end + best[0] + best[1] if best is not None else content_end


def _special_token_strings(tokenizer: Any) -> list[str]:
    """Strings of the tokenizer's special tokens (named ones and added tokens marked special)."""
    tokens = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            tokens.add(str(added))
    return sorted(token for token in tokens if token)


def tokenize_with_spans(tokenizer: Any, text: str, spans: Sequence[Span],
                        max_length: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of `text` (the first `max_length`) and a mask, 1 on every token overlapping a span.

    A fast tokenizer tokenizes the whole text and maps spans through offsets; a slow one
    tokenizes the pieces between span boundaries separately (ids may differ slightly at boundaries).
    """
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(encoding["input_ids"][:max_length])
        return input_ids, _mask_from_offsets(encoding["offset_mapping"][:max_length], spans)
    input_ids, loss_mask, position = [], [], 0
    for start, end in list(spans) + [(len(text), len(text))]:
        for piece, masked in ((text[position:start], 0), (text[start:end], 1)):
            if piece:
                ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                input_ids.extend(ids)
                loss_mask.extend([masked] * len(ids))
        position = end
    return input_ids[:max_length], loss_mask[:max_length]


def _mask_from_offsets(offsets: Sequence[Span], spans: Sequence[Span]) -> list[int]:
    """1 for every token whose characters [start, end) overlap a span (one sweep; spans sorted)."""
    spans = sorted(spans)
    loss_mask, j, previous_start = [], 0, 0
    for start, end in offsets:
        if start < previous_start:  # offsets went backwards: restart the sweep
            j = 0
        previous_start = start
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        hit = end > start and any(s < end and e > start for s, e in spans[j:j + 2])
        loss_mask.append(int(hit))
    return loss_mask


def split_conversations(convs: Sequence[T], validation_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Deterministic (train, validation) split: `random.Random(seed)` shuffle, then cut.

    The same seed gives the same split on every platform. A positive fraction keeps at least one
    validation item when there are two or more items; the train part is never empty.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise UserError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    num_validation = round(len(convs) * validation_fraction)
    if validation_fraction > 0 and len(convs) >= 2:
        num_validation = min(max(num_validation, 1), len(convs) - 1)
    validation = [convs[i] for i in order[:num_validation]]
    train = [convs[i] for i in order[num_validation:]]
    return train, validation
