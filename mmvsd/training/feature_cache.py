"""The offline target-feature cache: `mmvsd prepare` writes it, the trainer reads batches from it.

Layout of a cache folder:
- `manifest.json`: the caller's `settings` (target, data spec, max_length, seed, ...), the `layout`
  this module derives (target name and sizes, storage dtype, shard size, example and token counts,
  a fingerprint of the rendered examples) and the expected shards with their example/token counts.
  It is written first, so a rerun knows what to finish.
- `shard-00000.safetensors`, ...: `shard_size` examples each, stored as concatenated token rows
  (no padding): `input_ids` [N] int64, `loss_mask` [N] bool, `offsets` [E+1] int64 (example e owns
  rows offsets[e]:offsets[e+1]), `features` [N, F] and `target_hidden` [N, H] in the storage dtype.

Shape letters: E examples in a shard, N token rows in a shard, F = len(aux_layer_ids) * H feature
width, H target hidden size, B batch, T padded length. Every file appears whole or not at all
(temporary name, then rename); a rerun with the same settings rewrites only missing or unreadable
shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from mmvsd.data.render import RenderedExample
from mmvsd.errors import UserError
from mmvsd.files import atomic_file, atomic_path
from mmvsd.target import Target
from mmvsd.training.features import FeatureBatch, TokenBatch, capture_features, collate

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT = "mmvsd-feature-cache/1"
SHARD_KEYS = frozenset({"input_ids", "loss_mask", "offsets", "features", "target_hidden"})
STORAGE_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SHARD_HEADER_BYTES = 400  # safetensors JSON header of one shard (5 tensors), roughly
MANIFEST_BYTES = 1024  # manifest.json, roughly
RERUN_HINT = "rerun `mmvsd prepare` with the same arguments to finish it"


def storage_dtype(dtype: torch.dtype | str | None, target: Target) -> torch.dtype:
    """The dtype features are stored in: `dtype` (fp32/bf16/fp16) or, by default, the target's."""
    if dtype is None:
        dtype = target.dtype
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in STORAGE_DTYPES:
            raise UserError(f"unsupported feature-cache dtype {dtype!r}: use one of {sorted(STORAGE_DTYPES)}")
        dtype = STORAGE_DTYPES[dtype.removeprefix("torch.")]
    if dtype not in SAFETENSORS_DTYPES:
        raise UserError(f"unsupported feature-cache dtype {dtype}: use float32, bfloat16 or float16")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CachePlan:
    """What a cache of some examples will hold: counts and an estimate of its size on disk."""

    num_examples: int
    num_tokens: int
    num_shards: int
    num_bytes: int

    def describe(self, out_dir: str | Path) -> str:
        """One line for the user, e.g. `will write ~1.20 GB to DIR (N examples, M tokens)`."""
        size = f"{self.num_bytes / 1e9:.2f} GB" if self.num_bytes >= 1e8 else f"{self.num_bytes / 1e6:.1f} MB"
        return (
            f"will write ~{size} to {out_dir} "
            f"({self.num_examples} examples, {self.num_tokens} tokens, {self.num_shards} shards)"
        )


def plan_feature_cache(
    target: Target, examples: Sequence, *, dtype: torch.dtype | str | None = None, shard_size: int = 256
) -> CachePlan:
    """Counts and estimated bytes of the cache `write_feature_cache` would write for `examples`."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    itemsize = storage_dtype(dtype, target).itemsize
    num_tokens = sum(len(ex.input_ids) for ex in examples)
    num_shards = -(-len(examples) // shard_size)
    per_token = feature_bytes_per_token(len(target.aux_layer_ids), target.hidden_size, itemsize)
    per_shard = SHARD_HEADER_BYTES + 8  # header + the extra offsets entry
    num_bytes = num_tokens * per_token + 8 * len(examples) + num_shards * per_shard + MANIFEST_BYTES
    return CachePlan(len(examples), num_tokens, num_shards, num_bytes)


def feature_bytes_per_token(num_aux_layers: int, hidden_size: int, itemsize: int) -> int:
    """Bytes one token row takes in a shard: features F and target_hidden H, its int64 id and bool mask."""
    return (num_aux_layers + 1) * hidden_size * itemsize + 8 + 1


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def examples_fingerprint(examples: Sequence) -> str:
    """sha256 of every example's ids and loss mask: a rerun must cache the very same tokens."""
    digest = hashlib.sha256()
    for ex in examples:
        if len(ex.input_ids) != len(ex.loss_mask) or not ex.input_ids:
            raise ValueError("every example needs as many loss-mask entries as (at least one) input ids")
        digest.update(array("q", [len(ex.input_ids)]).tobytes())
        digest.update(array("q", ex.input_ids).tobytes())
        digest.update(bytes(int(bool(m)) for m in ex.loss_mask))
    return digest.hexdigest()


def build_manifest(
    target: Target, examples: Sequence, settings: dict, *, dtype: torch.dtype, shard_size: int
) -> dict:
    """The manifest of a cache: caller settings, derived layout and the expected shards."""
    layout = {
        "target": target.name,
        "hidden_size": target.hidden_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "feature_size": len(target.aux_layer_ids) * target.hidden_size,
        "dtype": _dtype_name(dtype),
        "shard_size": shard_size,
        "num_examples": len(examples),
        "num_tokens": sum(len(ex.input_ids) for ex in examples),
        "examples_sha256": examples_fingerprint(examples),
    }
    shards = []
    for index, start in enumerate(range(0, len(examples), shard_size)):
        chunk = examples[start : start + shard_size]
        num_tokens = sum(len(ex.input_ids) for ex in chunk)
        shards.append({"file": shard_name(index), "num_examples": len(chunk), "num_tokens": num_tokens})
    settings = json.loads(json.dumps(settings))  # as it will read back (tuples -> lists)
    return {"format": FORMAT, "settings": settings, "layout": layout, "shards": shards}


def _differences(old: dict, new: dict) -> list[str]:
    """`key (old in the cache, new now)` for each key whose value differs between two dicts."""
    keys = sorted(set(old) | set(new))
    return [f"{k} ({old.get(k)!r} in the cache, {new.get(k)!r} now)" for k in keys if old.get(k) != new.get(k)]


def read_manifest(out_dir: Path) -> dict:
    """The manifest of the cache in `out_dir`, or a UserError saying why there is none."""
    path = out_dir / MANIFEST_NAME
    if not path.is_file():
        raise UserError(f"no feature cache in {out_dir} ({MANIFEST_NAME} is missing): run `mmvsd prepare` first")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(
            f"unreadable feature-cache manifest {path} ({err}): delete {out_dir} and rerun `mmvsd prepare`"
        ) from None
    keys = {"format", "settings", "layout", "shards"}
    if not isinstance(manifest, dict) or not keys <= set(manifest) or manifest["format"] != FORMAT:
        raise UserError(f"{path} is not an mmvsd feature-cache manifest: delete {out_dir} and rerun `mmvsd prepare`")
    return manifest


def _claim_dir(out_dir: Path, manifest: dict) -> None:
    """Write the manifest into a new or empty `out_dir`, or check that the one there matches."""
    if (out_dir / MANIFEST_NAME).exists():
        old = read_manifest(out_dir)
        diffs = _differences(old["settings"], manifest["settings"]) + _differences(old["layout"], manifest["layout"])
        if diffs:
            raise UserError(
                f"the feature cache in {out_dir} was made with other settings: {'; '.join(diffs)}. "
                "Choose another output folder or delete that one."
            )
        return
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file, not a folder: choose another output folder for the feature cache")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} is not empty and holds no feature cache: choose another output folder")
    with atomic_file(out_dir / MANIFEST_NAME) as handle:
        json.dump(manifest, handle, indent=1)


def shard_ok(path: Path, shard: dict, layout: dict) -> bool:
    """Whether a shard file exists and its header has the expected tensors, shapes and dtype."""
    num_rows, num_examples = shard["num_tokens"], shard["num_examples"]
    expected = {
        "input_ids": ([num_rows], "I64"),
        "loss_mask": ([num_rows], "BOOL"),
        "offsets": ([num_examples + 1], "I64"),
        "features": ([num_rows, layout["feature_size"]], SAFETENSORS_DTYPES[STORAGE_DTYPES[layout["dtype"]]]),
        "target_hidden": ([num_rows, layout["hidden_size"]], SAFETENSORS_DTYPES[STORAGE_DTYPES[layout["dtype"]]]),
    }
    try:
        with safe_open(str(path), framework="pt") as handle:
            if set(handle.keys()) != SHARD_KEYS:
                return False
            for key, (shape, dtype) in expected.items():
                view = handle.get_slice(key)
                if list(view.get_shape()) != shape or view.get_dtype() != dtype:
                    return False
    except (OSError, SafetensorError):
        return False
    return True


@torch.no_grad()
def capture_shard(
    target: Target, examples: Sequence, batch_size: int, dtype: torch.dtype, bar: tqdm
) -> dict[str, Tensor]:
    """Capture the target features of some examples (length-sorted batches) as unpadded token rows."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    features: list[Tensor | None] = [None] * len(examples)
    hidden: list[Tensor | None] = [None] * len(examples)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        captured = capture_features(target, collate([examples[i] for i in rows]))
        for row, index in enumerate(rows):
            length = len(examples[index].input_ids)
            features[index] = captured.features[row, :length].to("cpu", dtype)  # [T_e, F]
            hidden[index] = captured.target_hidden[row, :length].to("cpu", dtype)  # [T_e, H]
        bar.update(len(rows))
    lengths = torch.tensor([len(ex.input_ids) for ex in examples], dtype=torch.long)  # [E]
    return {
        "input_ids": torch.cat([torch.as_tensor(ex.input_ids, dtype=torch.long) for ex in examples]),  # [N]
        "loss_mask": torch.cat([torch.as_tensor(ex.loss_mask, dtype=torch.bool) for ex in examples]),  # [N]
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),  # [E+1]
        "features": torch.cat(features).contiguous(),  # [N, F]
        "target_hidden": torch.cat(hidden).contiguous(),  # [N, H]
    }


def save_shard(tensors: dict[str, Tensor], path: Path) -> None:
    """Write a safetensors file under a temporary name, then rename it to `path`."""
    with atomic_path(path) as tmp:
        save_file(tensors, tmp)


def write_feature_cache(
    target: Target,
    examples: Sequence,
    out_dir: str | Path,
    *,
    settings: dict,
    shard_size: int = 256,
    batch_size: int = 4,
    dtype: torch.dtype | str | None = None,
    progress: bool = True,
) -> Path:
    """Capture and store the target features of `examples` in `out_dir`, finishing any earlier run.

    `settings` (JSON-serializable: target, data spec, max_length, seed, ...) is saved in the manifest;
    a rerun must pass equal settings and examples, and rewrites only missing or unreadable shards.
    """
    if not examples:
        raise UserError("no examples to cache: the data settings select no (loss-bearing) conversations")
    out_dir = Path(out_dir)
    dtype = storage_dtype(dtype, target)
    plan = plan_feature_cache(target, examples, dtype=dtype, shard_size=shard_size)
    manifest = build_manifest(target, examples, settings, dtype=dtype, shard_size=shard_size)
    _claim_dir(out_dir, manifest)
    logger.info(plan.describe(out_dir))
    for stale in out_dir.glob(".shard-*"):  # temporary files of a run that was killed mid-write
        stale.unlink(missing_ok=True)
    shards = manifest["shards"]
    todo = [i for i, shard in enumerate(shards) if not shard_ok(out_dir / shard["file"], shard, manifest["layout"])]
    done = len(examples) - sum(shards[i]["num_examples"] for i in todo)
    with tqdm(total=len(examples), initial=done, disable=not progress, unit="ex", desc="target features") as bar:
        for index in todo:
            chunk = examples[index * shard_size : (index + 1) * shard_size]
            save_shard(capture_shard(target, chunk, batch_size, dtype, bar), out_dir / shards[index]["file"])
    return out_dir


class FeatureCache:
    """Read padded `FeatureBatch`es from a finished feature cache, a few open shards at a time."""

    def __init__(self, out_dir: str | Path, max_open_shards: int = 2) -> None:
        self.out_dir = Path(out_dir)
        self.manifest = read_manifest(self.out_dir)
        self.layout: dict = self.manifest["layout"]
        self.shard_size: int = self.layout["shard_size"]
        self.dtype = STORAGE_DTYPES[self.layout["dtype"]]
        bad = [s["file"] for s in self.manifest["shards"] if not shard_ok(self.out_dir / s["file"], s, self.layout)]
        if bad:
            shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            raise UserError(
                f"the feature cache in {self.out_dir} is incomplete (missing or unreadable: {shown}): {RERUN_HINT}"
            )
        self.max_open_shards = max_open_shards
        self._open: OrderedDict[int, tuple[Any, list[int]]] = OrderedDict()

    @property
    def settings(self) -> dict:
        """The settings `mmvsd prepare` wrote the cache with."""
        return self.manifest["settings"]

    def __len__(self) -> int:
        return self.layout["num_examples"]

    def _shard(self, index: int) -> tuple[Any, list[int]]:
        """An open shard and its offsets; the least recently used one is closed beyond the limit."""
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        handle = safe_open(str(self.out_dir / self.manifest["shards"][index]["file"]), framework="pt")
        self._open[index] = (handle, handle.get_tensor("offsets").tolist())
        while len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return self._open[index]

    def token_examples(self) -> list[RenderedExample]:
        """Ids and loss masks of every example (no features read), e.g. to count token frequencies."""
        examples = []
        for shard in range(len(self.manifest["shards"])):
            handle, offsets = self._shard(shard)
            ids, mask = handle.get_tensor("input_ids").tolist(), handle.get_tensor("loss_mask").tolist()
            examples += [RenderedExample(ids[a:b], [int(m) for m in mask[a:b]]) for a, b in pairwise(offsets)]
        return examples

    def example(self, index: int) -> dict[str, Tensor]:
        """The unpadded token rows of one example: input_ids/loss_mask [T], features [T, F], target_hidden [T, H]."""
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range for a cache of {len(self)} examples")
        handle, offsets = self._shard(index // self.shard_size)
        local = index % self.shard_size
        start, end = offsets[local], offsets[local + 1]
        return {key: handle.get_slice(key)[start:end] for key in SHARD_KEYS - {"offsets"}}

    def batch(
        self, indices: Sequence[int], dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
    ) -> FeatureBatch:
        """Right-padded features of some examples (padding as `collate`: id 0, mask False, zero features)."""
        dtype = dtype or self.dtype
        rows = [self.example(i) for i in indices]
        lengths = torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.long)  # [B]
        batch, width = len(rows), int(lengths.max())
        input_ids = torch.zeros(batch, width, dtype=torch.long)  # [B, T]
        loss_mask = torch.zeros(batch, width, dtype=torch.bool)  # [B, T]
        features = torch.zeros(batch, width, self.layout["feature_size"], dtype=dtype)  # [B, T, F]
        target_hidden = torch.zeros(batch, width, self.layout["hidden_size"], dtype=dtype)  # [B, T, H]
        for b, row in enumerate(rows):
            length = int(lengths[b])
            input_ids[b, :length] = row["input_ids"]
            loss_mask[b, :length] = row["loss_mask"]
            features[b, :length] = row["features"].to(dtype)
            target_hidden[b, :length] = row["target_hidden"].to(dtype)
        tokens = TokenBatch(input_ids, loss_mask, lengths).to(device)
        return FeatureBatch(tokens, features.to(device), target_hidden.to(device))


def check_cache_matches(cache: FeatureCache, target: Target, settings: dict) -> None:
    """UserError unless the cache was made for this target and these settings (e.g. data, max_length).

    Every key of `settings` is compared with the cache's settings; pass only the keys that matter.
    """
    now = {
        "target": target.name,
        "hidden_size": target.hidden_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "feature_size": len(target.aux_layer_ids) * target.hidden_size,
    }
    diffs = _differences({k: cache.layout.get(k) for k in now}, now)
    settings = json.loads(json.dumps(settings))
    diffs += _differences({k: cache.settings.get(k) for k in settings}, settings)
    if diffs:
        raise UserError(
            f"the feature cache in {cache.out_dir} does not fit this run: {'; '.join(diffs)}. "
            "Rerun `mmvsd prepare` with this run's target and data settings, or train with online features."
        )
