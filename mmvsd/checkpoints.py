"""Reading checkpoint folders: config.json, the weight files (single or sharded), their tensors and names,
and where the local HF hub cache is. Shared by every layout, the drafter loader and the target loader."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from mmvsd.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

CONFIG_FILE = "config.json"
# weight files a layout may use, in the order they are looked for
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def read_config(path: Path) -> dict:
    """config.json of the checkpoint folder `path` as a dict (UserError if absent or invalid)."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise UserError(f"checkpoint folder {path} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} does not hold a JSON object")
    return config


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint folder (single file or the shards an index names)."""
    path = Path(path)
    for name in WEIGHT_FILES:
        found = path / name
        if not found.is_file():
            continue
        if not name.endswith(".index.json"):
            return [found]
        try:
            shards = sorted(set(json.loads(found.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise UserError(f"{found} is not a valid weight index: {err}") from None
        return [path / shard for shard in shards]
    raise UserError(f"{path} holds no weights (looked for {', '.join(WEIGHT_FILES)})")


def _read_errors() -> tuple[type[Exception], ...]:
    """What reading a missing, truncated or corrupt weight file raises (safetensors, torch.load)."""
    return (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError)


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder by name, on the CPU, as stored (safetensors or .bin)."""
    import torch  # heavy: configs, tensor names and the HF cache path are read without it (eval.mllm_suite)
    from safetensors.torch import load_file  # imports torch too

    tensors: dict[str, Tensor] = {}
    for file in weight_files(path):
        try:
            if file.suffix == ".safetensors":
                part = load_file(str(file))
            else:
                part = torch.load(file, map_location="cpu", weights_only=True)
        except _read_errors() as err:
            raise UserError(f"cannot read weights {file}: {type(err).__name__}: {err}") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise UserError(f"{file} does not hold a flat mapping of tensor names to tensors")
        tensors.update(part)
    return tensors


def read_keys(path: Path) -> set[str]:
    """Tensor names of a checkpoint folder, without reading safetensors data."""
    files = weight_files(path)
    if all(f.suffix == ".safetensors" for f in files):
        try:
            keys: set[str] = set()
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    keys.update(handle.keys())
            return keys
        except _read_errors() as err:
            raise UserError(f"cannot read weights in {path}: {type(err).__name__}: {err}") from None
    return set(read_tensors(path))


def hf_hub_cache() -> str:
    """The HF hub cache folder, read from the environment now (not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hf_cache_snapshot(repo_id: str) -> Path | None:
    """The local HF-cache snapshot of `repo_id` (never downloads), or None when it is not cached."""
    from huggingface_hub import snapshot_download  # heavy: only when an HF id is looked up
    from huggingface_hub.errors import LocalEntryNotFoundError  # heavy as well (~0.1 s)

    try:
        return Path(snapshot_download(repo_id, cache_dir=hf_hub_cache(), local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
