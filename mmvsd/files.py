"""Files: atomic writes (results appear whole under their final name, or not at all), checksums,
the mmvsd cache folder."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
