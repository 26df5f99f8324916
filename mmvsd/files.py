"""Files: atomic writes (results appear whole under their final name, or not at all), checksums,
the mmvsd cache folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mmvsd.errors import UserError


@contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary folder next to `out_dir`; on success it replaces `out_dir` in one rename."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp.", dir=out_dir.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
        os.replace(out_dir, old / "x")
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file name next to `path` for a writer that wants a name (safetensors, an exporter's
    folder); renamed to `path` when the block ends cleanly, removed otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file next to `path` for writing; rename it to `path` when closed cleanly."""
    with atomic_path(path) as tmp, open(tmp, mode) as handle:
        yield handle


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (shipped weights and manifests)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    """Where mmvsd keeps converted weights and other derived files."""
    if os.environ.get("MMVSD_CACHE"):
        return Path(os.environ["MMVSD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmvsd"


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSON Lines text, split at "\\n" alone: `str.splitlines` also splits at U+2028, U+2029, U+0085
    and other separators that JSON holds unescaped when written with `ensure_ascii=False` (ShareGPT's answers
    have them), which cut a record in two."""
    return text.split("\n")


def read_folder_manifest(folder: Path, name: str, fmt: str, what: str, option: str) -> dict[str, Any] | None:
    """The manifest `name` (JSON, `"format": fmt`) of a folder that mmvsd writes, None for a folder that is absent or
    empty; a folder that is something else (`what`, e.g. "a regeneration folder") is refused, naming `option`."""
    path = folder / name
    if not path.is_file():
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise UserError(f"{folder} exists and is not {what} (no {name}); pick another {option}")
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is not {what}'s manifest ({err}); pick another {option}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise UserError(f"{path} is not {what}'s manifest; pick another {option}")
    return manifest
