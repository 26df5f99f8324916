"""A regeneration's finished shards, packed small enough to commit: `mmvsd regenerate --store DIR`.

A work shard of `mmvsd regenerate` is JSON Lines text: the dataset's user turns beside the target's answers. The
store keeps only what the dataset cannot give back. Per conversation: its id, the digest of its source, its status,
its image path and its turn layout (which source turn each copied turn is; -1 where an answer goes); the answers
themselves as token ids of the target's tokenizer. One file per shard, `shard-NNNNN.ids.xz`:

    MAGIC, one JSON line {"dtype", "lengths", "records", "texts"}, the answers' token ids (little-endian)

all xz-compressed (deterministic bytes: the same shard packs to the same file). `texts` holds the rare answer
whose text does not come back from its token ids (decode(encode(text)) != text), so a restored line is byte for
byte the line regeneration wrote. `manifest.json` holds what a resume must agree with (the regeneration's key:
target, settings, engine; dataset, shard size, order digest; the tokenizer's digest) and, per shard, the file's
sha256, the sha256 of the lines it rebuilds, its conversations, answers, answer tokens and the seconds its
regeneration took.

Restore: a shard that the work folder has not finished is rebuilt from its file and the dataset's own
conversations. A file that fails its checksum or does not rebuild is named and left out: regeneration writes that
shard again and packs it over the bad file, so it is never trained on. Pack: every shard the work folder finished
that the store lacks (or holds damaged) is packed when it finishes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmvsd.data.conversations import Conversation
from mmvsd.errors import UserError
from mmvsd.files import atomic_file, file_sha256, read_folder_manifest
from mmvsd.training.regenerate import ConvKey, read_cache, source_digest

logger = logging.getLogger(__name__)

STORE_FORMAT = "mmvsd-regenerated-store/1"
MAGIC = b"mmvsd-shard-ids/1\n"
MANIFEST = "manifest.json"
ANSWER = -1  # a layout entry: the next answer goes here
AGREE = ("key", "data", "shard_size", "order", "num_conversations", "tokenizer")  # what a resume must repeat


class DamagedShard(Exception):
    """A stored shard that must not be used: its checksum fails or it does not rebuild."""


def tokenizer_digest(tokenizer: Any) -> str:
    """Digest of a tokenizer's vocabulary and special tokens: token ids mean the same only under the same one."""
    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps([vocab, sorted(map(str, tokenizer.all_special_tokens))], ensure_ascii=False)
    return hashlib.sha1(payload.encode()).hexdigest()[:16]


def read_store_manifest(folder: Path) -> dict[str, Any] | None:
    """A store's manifest, None for a folder that is absent or empty; anything else is refused (a cheap check that
    runs before the target loads)."""
    return read_folder_manifest(folder, MANIFEST, STORE_FORMAT, "a shard store", "--store")


def store_path(store: Path, index: int) -> Path:
    return store / f"shard-{index:05d}.ids.xz"


def _layout(record: dict[str, Any], source: Conversation) -> list[int]:
    """Where each turn of a regenerated record comes from: a source turn's index, or ANSWER."""
    layout, cursor = [], 0
    for turn in record["turns"]:
        if turn["role"] == "assistant":
            layout.append(ANSWER)
            continue
        while cursor < len(source.turns) and (source.turns[cursor].role, source.turns[cursor].text) != (
                turn["role"], turn["text"]):
            cursor += 1
        if cursor == len(source.turns):
            raise ValueError(f"conversation {record['conv_id']}: a {turn['role']} turn not in its source")
        layout.append(cursor)
        cursor += 1
    return layout


def pack_shard(records: list[dict[str, Any]], sources: dict[ConvKey, Conversation],
               tokenizer: Any) -> tuple[bytes, int]:
    """The store file of one finished shard's cache records (in their order), and the answer tokens it holds."""
    meta: dict[str, Any] = {"records": [], "lengths": [], "texts": {}}
    ids: list[int] = []
    num_tokens = 0
    for record in records:
        source = sources[(record["conv_id"], record["source"])]
        meta["records"].append({"conv_id": record["conv_id"], "source": record["source"], "status": record["status"],
                                "image": record.get("image"), "layout": _layout(record, source)})
        for turn in record["turns"]:
            if turn["role"] != "assistant":
                continue
            answer_ids = tokenizer(turn["text"], add_special_tokens=False)["input_ids"]
            num_tokens += len(answer_ids)
            if _decode(tokenizer, answer_ids) != turn["text"]:
                meta["texts"][str(len(meta["lengths"]))] = turn["text"]
                answer_ids = []
            meta["lengths"].append(len(answer_ids))
            ids += answer_ids
    meta["dtype"] = "<u2" if max(ids, default=0) < 1 << 16 else "<u4"
    body = json.dumps(meta, ensure_ascii=False).encode() + b"\n" + np.asarray(ids, dtype=meta["dtype"]).tobytes()
    return lzma.compress(MAGIC + body, preset=9), num_tokens


def unpack_shard(data: bytes, sources: dict[ConvKey, Conversation], tokenizer: Any,
                 key: dict[str, Any]) -> list[dict[str, Any]]:
    """The cache records a store file holds (DamagedShard if it does not rebuild against `sources`)."""
    try:
        raw = lzma.decompress(data)
        if not raw.startswith(MAGIC):
            raise ValueError("not a shard file")
        head, _, tail = raw[len(MAGIC):].partition(b"\n")
        meta = json.loads(head)
        ids = np.frombuffer(tail, dtype=meta["dtype"]).tolist()
        offsets = np.concatenate([[0], np.cumsum(meta["lengths"])]).tolist()
        if offsets[-1] != len(ids):
            raise ValueError("token count differs from the answers' lengths")
        answers = iter(range(len(meta["lengths"])))
        records = []
        for entry in meta["records"]:
            source = sources[(entry["conv_id"], entry["source"])]
            turns = []
            for where in entry["layout"]:
                if where == ANSWER:
                    number = next(answers)
                    text = meta["texts"].get(str(number))
                    text = text if text is not None else _decode(tokenizer, ids[offsets[number]:offsets[number + 1]])
                    turns.append({"role": "assistant", "text": text})
                else:
                    turns.append({"role": source.turns[where].role, "text": source.turns[where].text})
            records.append({"key": key, "conv_id": entry["conv_id"], "source": entry["source"],
                            "status": entry["status"], "turns": turns, "image": entry["image"]})
    except (lzma.LZMAError, ValueError, KeyError, IndexError, TypeError, StopIteration) as err:
        raise DamagedShard(f"{type(err).__name__}: {err}") from None
    return records


def _lines(records: list[dict[str, Any]]) -> str:
    """Cache records as the work shard's JSON Lines (as regeneration writes them)."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass
class ShardStore:
    """A store folder and its manifest (created on the first shard packed into it)."""

    folder: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path, header: dict[str, Any]) -> ShardStore:
        """The store at `folder` for a regeneration described by `header` (the work manifest's fields and the
        tokenizer's digest); a store of another regeneration is refused."""
        folder = Path(folder).expanduser()
        fresh = {"format": STORE_FORMAT, **{name: header[name] for name in AGREE}, "shards": {}}
        manifest = read_store_manifest(folder)
        for name in AGREE:
            if manifest is not None and manifest.get(name) != fresh[name]:
                raise UserError(f"--store {folder} holds shards of another regeneration: its {name} is "
                                f"{manifest.get(name)!r}, this run's {fresh[name]!r}; repeat its settings (target, "
                                "tokenizer, dataset, lengths, engine) or pick another --store")
        return cls(folder, manifest or fresh)

    def damaged(self, index: int) -> str | None:
        """Why shard `index`'s file cannot be used (missing, checksum fails), None when it is sound."""
        path = store_path(self.folder, index)
        if not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != self.manifest["shards"][str(index)]["sha256"]:
            return f"{path} fails its checksum"
        return None

    def restore(self, index: int, shard: list[Conversation], tokenizer: Any, key: dict[str, Any],
                work_path: Path) -> dict[str, Any] | None:
        """Write sound shard `index` from the store to `work_path` (its figures), or None when it does not rebuild."""
        data = store_path(self.folder, index).read_bytes()
        sources = {(conv.conv_id, source_digest(conv)): conv for conv in shard}
        try:
            records = unpack_shard(data, sources, tokenizer, key)
        except DamagedShard as err:
            print(f"{store_path(self.folder, index)} does not rebuild ({err}): left out, regenerated", flush=True)
            del self.manifest["shards"][str(index)]  # so that the regenerated shard is packed over it
            return None
        entry = self.manifest["shards"][str(index)]
        lines = _lines(records)
        if hashlib.sha256(lines.encode()).hexdigest() != entry["lines_sha256"]:  # another dataset or tokenizer build
            print(f"{store_path(self.folder, index)} does not rebuild the lines it was packed from: left out, "
                  "regenerated", flush=True)
            del self.manifest["shards"][str(index)]
            return None
        with atomic_file(work_path, "w") as handle:
            handle.write(lines)
        return {"conversations": entry["conversations"], "tokens": entry["tokens"], "seconds": entry["seconds"]}

    def pack(self, index: int, shard: list[Conversation], tokenizer: Any, key: dict[str, Any], work_path: Path,
             figures: dict[str, Any]) -> None:
        """Pack finished work shard `index` into the store (unless it holds a sound copy already); `figures`: the
        work manifest's, whose seconds are recorded (a shard resumed from another folder's lines took longer)."""
        if str(index) in self.manifest["shards"] and self.damaged(index) is None:
            return
        sources = {(conv.conv_id, source_digest(conv)): conv for conv in shard}
        records = list(read_cache(work_path, key).values())  # in the work file's order: training reads that order
        data, num_tokens = pack_shard(records, sources, tokenizer)
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_file(store_path(self.folder, index), "wb") as handle:
            handle.write(data)
        answers = sum(turn["role"] == "assistant" for record in records for turn in record["turns"])
        self.manifest["shards"][str(index)] = {
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "conversations": len(records),
            "lines_sha256": hashlib.sha256(_lines(records).encode()).hexdigest(),
            "answers": answers, "tokens": num_tokens, "seconds": figures["seconds"]}  # seconds: this folder's
        self.manifest["shards"] = dict(sorted(self.manifest["shards"].items(), key=lambda item: int(item[0])))
        with atomic_file(self.folder / MANIFEST) as handle:
            json.dump(self.manifest, handle, indent=1)
        print(f"packed shard {index} into {store_path(self.folder, index)} ({len(data) / 1e6:.2f} MB)", flush=True)
