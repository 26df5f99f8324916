"""A whole dataset answered by the target, in shards: `mmvsd regenerate`.

Output folder (a dataset: `mmvsd train --data FOLDER` reads its shards in order):

    manifest.json        settings key, dataset, shard size, the conversations' order digest, per-shard figures
    shard-00000.jsonl    `mmvsd.training.regenerate` cache files, one per `shard_size` conversations in dataset order

Resume: a shard is finished when every conversation of it has a line. A restart with the same settings skips
finished shards and resumes the first unfinished one from its last complete line (lines are flushed one by one;
an incomplete last line left by a kill is cut off), so no record is written twice or lost. Other settings, or
another dataset order, in the same folder are refused.

Before anything is written the run prints an estimate: answer tokens and disk bytes from a sample of the pending
conversations replayed with the dataset's own answers as stand-ins (each capped as regeneration caps it; image
tokens are not counted), and the time at the throughput earlier shards of this folder measured, else at a short
calibration call of the engine (a small batch, so on the slow side). A disk estimate above the free space stops
the run there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmvsd.adapter_base import ModalityAdapter
from mmvsd.data.conversations import Conversation
from mmvsd.errors import UserError
from mmvsd.files import atomic_file, read_folder_manifest
from mmvsd.target import Target
from mmvsd.training.regenerate import (
    AnswerFn,
    RegenerateStats,
    answer_budget,
    cache_key,
    first_prompt,
    mmvsd_answers,
    read_cache,
    regenerate_conversations,
    source_digest,
)
from mmvsd.training.shard_store import ShardStore, tokenizer_digest

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "mmvsd-regenerated/1"
SAMPLE_SIZE = 200  # pending conversations the estimate replays
CALIBRATION_PROMPTS = 16
CALIBRATION_TOKENS = 32
RECORD_OVERHEAD_BYTES = 260  # key, ids, status and JSON punctuation of one cache line


@dataclass(frozen=True)
class RegenerateSettings:
    """What the answers depend on (and `batch_size`, `shard_size`: how the work is cut)."""

    temperature: float = 0.0
    max_new_tokens: int = 448
    max_prompt_tokens: int | None = 512  # the training length: answers past it would be cut off
    batch_size: int = 64
    shard_size: int = 256
    seed: int = 0


@dataclass(frozen=True)
class Estimate:
    """Work left: answer tokens, disk bytes, and the throughput the time is estimated at."""

    conversations: int
    answer_tokens: int
    disk_bytes: int
    tokens_per_s: float
    throughput_source: str

    def describe(self) -> str:
        hours = self.answer_tokens / max(self.tokens_per_s, 1e-9) / 3600
        return (f"{self.conversations} conversations left: about {self.answer_tokens / 1e6:.2f} M answer tokens, "
                f"{self.disk_bytes / 1e6:.0f} MB on disk, {hours:.1f} h at {self.tokens_per_s:.0f} tokens/s "
                f"({self.throughput_source})")


def shard_path(output: Path, index: int) -> Path:
    return output / f"shard-{index:05d}.jsonl"


def order_digest(conversations: list[Conversation]) -> str:
    """Digest of the conversations in order: a resumed run must cut the same shards."""
    digest = hashlib.sha1()
    for conv in conversations:
        digest.update(f"{conv.conv_id}\0{source_digest(conv)}\n".encode())
    return digest.hexdigest()[:16]


def read_manifest(output: Path) -> dict[str, Any] | None:
    """The folder's manifest, None for a folder that does not exist or is empty; refuses a folder not ours."""
    return read_folder_manifest(output, MANIFEST, FORMAT, "a regeneration folder", "--output")


def _check_resume(manifest: dict[str, Any], fresh: dict[str, Any], output: Path) -> None:
    for field_name in ("key", "data", "shard_size", "order"):
        if manifest.get(field_name) != fresh[field_name]:
            raise UserError(f"{output} holds a regeneration with another {field_name} ({manifest.get(field_name)!r}, "
                            f"now {fresh[field_name]!r}); pick another --output or repeat its settings")


def _sample_work(target: Target, conv: Conversation, settings: RegenerateSettings) -> tuple[int, int]:
    """(answer tokens, record bytes) of one conversation, its own answers standing in for the target's."""
    turns: list[dict[str, str]] = []
    tokens = 0
    for turn in conv.turns:
        if turn.role != "assistant":
            turns.append({"role": turn.role, "content": turn.text})
            continue
        if not any(t["role"] == "user" for t in turns):
            continue
        prompt_len = len(target.encode_chat(turns))
        too_long = settings.max_prompt_tokens is not None and prompt_len >= settings.max_prompt_tokens
        if too_long or prompt_len + settings.max_new_tokens + 1 > target.max_positions:
            break
        answer_ids = target.tokenizer(turn.text, add_special_tokens=False)["input_ids"]
        kept = min(len(answer_ids), answer_budget(prompt_len, settings.max_new_tokens, settings.max_prompt_tokens))
        tokens += kept
        text = turn.text[: int(len(turn.text) * kept / max(len(answer_ids), 1))]
        turns.append({"role": "assistant", "content": text})
    record_bytes = len(json.dumps(turns, ensure_ascii=False).encode()) + RECORD_OVERHEAD_BYTES
    return tokens, record_bytes


def estimate_work(target: Target, pending: list[Conversation], settings: RegenerateSettings) -> tuple[int, int]:
    """(answer tokens, disk bytes) of `pending`, scaled up from an evenly spaced sample."""
    if not pending:
        return 0, 0
    step = max(1, len(pending) // SAMPLE_SIZE)
    sample = pending[::step][:SAMPLE_SIZE]
    work = [_sample_work(target, conv, settings) for conv in sample]
    scale = len(pending) / len(sample)
    return int(sum(w[0] for w in work) * scale), int(sum(w[1] for w in work) * scale)


def calibrate(target: Target, answer: AnswerFn, pending: list[Conversation], settings: RegenerateSettings,
              adapter: ModalityAdapter | None) -> float:
    """Answer tokens per second of one short call of the engine on the first pending prompts."""
    prompts = []
    for conv in pending:
        prompt = first_prompt(target, conv, settings.max_new_tokens, settings.max_prompt_tokens, adapter)
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) == min(CALIBRATION_PROMPTS, settings.batch_size):
            break
    if not prompts:
        return 0.0
    start = time.perf_counter()
    answers = answer(prompts, [CALIBRATION_TOKENS] * len(prompts), settings.temperature,
                     [settings.seed] * len(prompts))
    return sum(len(ids) for ids in answers) / max(time.perf_counter() - start, 1e-9)


def _pending_shards(output: Path, shards: list[list[Conversation]], key: dict[str, Any]) -> list[list[Conversation]]:
    """Per shard, the conversations without a line in its file yet (an incomplete last line is cut off here)."""
    pending = []
    for index, shard in enumerate(shards):
        done = read_cache(shard_path(output, index), key)
        pending.append([conv for conv in shard if (conv.conv_id, source_digest(conv)) not in done])
    return pending


def regenerate_dataset(target: Target, conversations: list[Conversation], output: str | Path, *, data: str,
                       settings: RegenerateSettings = RegenerateSettings(), answer: AnswerFn | None = None,
                       engine: str = "", adapter: ModalityAdapter | None = None, estimate_only: bool = False,
                       progress: bool = True, store: str | Path | None = None,
                       restore_only: bool = False) -> RegenerateStats:
    """Answer `conversations` into shards under `output` (resumable); prints the estimate first.

    `data`: the dataset spec the conversations came from (recorded, and checked on resume). `answer`/`engine`: as
    for `regenerate_conversations` (default mmvsd's exact decoding). `estimate_only`: print the estimate, write
    nothing. `store`: a shard store (mmvsd/training/shard_store.py) that the shards it holds are restored from and every
    finished shard is packed into; `restore_only`: restore and pack, answer nothing.
    """
    if settings.shard_size < 1:
        raise UserError(f"shard_size must be >= 1, got {settings.shard_size}")
    output = Path(output).expanduser()
    answer = answer or mmvsd_answers(target)
    key = cache_key(target, settings.temperature, settings.max_new_tokens, settings.seed, settings.max_prompt_tokens,
                    adapter.name if adapter else "", engine)  # every shard's key, text-only shards included
    shards = [conversations[i:i + settings.shard_size] for i in range(0, len(conversations), settings.shard_size)]
    fresh = {"format": FORMAT, "key": key, "data": data, "shard_size": settings.shard_size,
             "num_conversations": len(conversations), "num_shards": len(shards), "order": order_digest(conversations),
             "shards": {}, "tokens_per_s": None}
    manifest = read_manifest(output)
    if manifest is not None:
        _check_resume(manifest, fresh, output)
    manifest = manifest or fresh
    header = {**manifest, "tokenizer": tokenizer_digest(target.tokenizer)}
    shard_store = ShardStore.open(store, header) if store else None
    pending = _pending_shards(output, shards, key) if output.is_dir() else list(shards)
    restorable = _restorable(shard_store, manifest, len(shards))
    for index in restorable:
        pending[index] = []
    left = [] if restore_only else [c for shard in pending for c in shard]  # a restore answers nothing
    estimate = _estimate(target, answer, left, settings, adapter, manifest)
    restoring = f", {len(restorable)} to restore from {store}" if store else ""
    work = "restore only: nothing is answered" if restore_only else estimate.describe()
    print(f"regenerate into {output}: {len(conversations)} conversations in {len(shards)} shards of "
          f"{settings.shard_size}{restoring}; {work}", flush=True)
    free = shutil.disk_usage(_existing_parent(output)).free
    if estimate.disk_bytes > free:
        raise UserError(f"regeneration needs about {estimate.disk_bytes / 1e6:.0f} MB and {output} has "
                        f"{free / 1e6:.0f} MB free: free space or pick another --output (nothing written)")
    stats = RegenerateStats()
    if estimate_only:
        return stats
    output.mkdir(parents=True, exist_ok=True)
    _write_manifest(output, manifest)
    if shard_store is not None:
        _sync_store(shard_store, target, shards, output, manifest, key, restorable)
        pending = _pending_shards(output, shards, key)  # a stored shard that did not rebuild is pending again
    for index, shard in enumerate(shards):
        if not pending[index] or restore_only:
            continue
        _run_shard(target, shard, index, output, manifest, settings, answer, engine, adapter, progress, stats)
        if shard_store is not None:
            shard_store.pack(index, shard, target.tokenizer, key, shard_path(output, index),
                             manifest["shards"][str(index)])
    logger.info("regeneration in %s: %s", output, stats.summary())
    return stats


def _restorable(shard_store: ShardStore | None, manifest: dict[str, Any], num_shards: int) -> list[int]:
    """Shards the store holds, sound by their checksums, that the work folder has not finished (a damaged one is
    named here and left to regeneration; whether a sound one rebuilds its lines is checked on restore)."""
    if shard_store is None:
        return []
    restorable = []
    for index in range(num_shards):
        if str(index) in shard_store.manifest["shards"] and str(index) not in manifest["shards"]:
            reason = shard_store.damaged(index)
            if reason:
                print(f"stored shard {index}: {reason}; left out, regenerated", flush=True)
            else:
                restorable.append(index)
    return restorable


def _sync_store(shard_store: ShardStore, target: Target, shards: list[list[Conversation]], output: Path,
                manifest: dict[str, Any], key: dict[str, Any], restorable: list[int]) -> None:
    """Restore the store's shards into the work folder, then pack the work folder's finished shards it lacks."""
    for index in restorable:
        figures = shard_store.restore(index, shards[index], target.tokenizer, key, shard_path(output, index))
        if figures is not None:
            manifest["shards"][str(index)] = figures
    manifest["shards"] = dict(sorted(manifest["shards"].items(), key=lambda item: int(item[0])))
    _write_manifest(output, manifest)
    for index in sorted(int(i) for i in manifest["shards"]):
        shard_store.pack(index, shards[index], target.tokenizer, key, shard_path(output, index),
                         manifest["shards"][str(index)])


def _estimate(target: Target, answer: AnswerFn, pending: list[Conversation], settings: RegenerateSettings,
              adapter: ModalityAdapter | None, manifest: dict[str, Any]) -> Estimate:
    tokens, disk = estimate_work(target, pending, settings)
    if manifest.get("tokens_per_s"):
        rate, source = float(manifest["tokens_per_s"]), "measured by this folder's finished shards"
    elif pending:
        rate = calibrate(target, answer, pending, settings, adapter)
        source = (f"a {CALIBRATION_TOKENS}-token calibration of {min(CALIBRATION_PROMPTS, settings.batch_size)} "
                  "prompts; batches of more run faster")
    else:
        rate, source = 0.0, "nothing left"
    return Estimate(len(pending), tokens, disk, rate, source)


def _run_shard(target: Target, shard: list[Conversation], index: int, output: Path, manifest: dict[str, Any],
               settings: RegenerateSettings, answer: AnswerFn, engine: str, adapter: ModalityAdapter | None,
               progress: bool, stats: RegenerateStats) -> None:
    """Finish one shard (its counts added to `stats`), then record its figures and the folder's throughput in the
    manifest."""
    tokens_before = stats.num_tokens
    start = time.perf_counter()
    regenerate_conversations(target, shard, cache_path=shard_path(output, index), temperature=settings.temperature,
                             max_new_tokens=settings.max_new_tokens, max_prompt_tokens=settings.max_prompt_tokens,
                             batch_size=settings.batch_size, seed=settings.seed, progress=progress,
                             stats=stats, adapter=adapter, answer=answer, engine=engine)
    seconds, tokens = time.perf_counter() - start, stats.num_tokens - tokens_before
    previous = manifest["shards"].get(str(index), {"tokens": 0, "seconds": 0.0})
    manifest["shards"][str(index)] = {"conversations": len(shard), "tokens": previous["tokens"] + tokens,
                                      "seconds": round(previous["seconds"] + seconds, 1)}
    total_tokens = sum(s["tokens"] for s in manifest["shards"].values())
    total_seconds = sum(s["seconds"] for s in manifest["shards"].values())
    manifest["tokens_per_s"] = round(total_tokens / total_seconds, 2) if total_seconds > 0 else None
    _write_manifest(output, manifest)
    print(f"shard {index + 1}/{manifest['num_shards']}: {tokens} answer tokens in {seconds:.0f} s; "
          f"folder throughput {manifest['tokens_per_s']} tokens/s", flush=True)


def _write_manifest(output: Path, manifest: dict[str, Any]) -> None:
    with atomic_file(output / MANIFEST) as handle:
        json.dump(manifest, handle, indent=1)


def _existing_parent(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
