"""mmvsd.files: a result appears whole under its name, or not at all (and no temporary file is left)."""

from __future__ import annotations

import pytest

from mmvsd.files import atomic_dir, atomic_file, atomic_path


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    for opener in (lambda: atomic_file(path), lambda: atomic_path(path)):
        with pytest.raises(RuntimeError), opener():
            raise RuntimeError("writer died")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_clean_writes_replace_in_one_rename(tmp_path):
    path = tmp_path / "sub" / "out.bin"
    with atomic_path(path) as tmp:
        assert tmp.parent == path.parent and not path.exists()
        tmp.write_bytes(b"new")
    with atomic_file(path, "ab") as handle:  # a fresh file each time: mode "a" does not append to the old one
        handle.write(b"!")
    assert path.read_bytes() == b"!"
    with atomic_dir(tmp_path / "folder") as folder:
        (folder / "x").write_text("1")
    assert (tmp_path / "folder" / "x").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "sub"]
