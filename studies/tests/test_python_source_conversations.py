"""studies/mmvsd_studies/python_source_conversations.py: standard-library code as training conversations."""

import json

from mmvsd.data.conversations import read_conversations
from mmvsd_studies import python_source_conversations as script

SMALL = 'def small(x):\n    """Twice x."""\n    return 2 * x\n'
BIG = "class Big:\n" + "".join(f"    def m{i}(self):\n        return {i} + {i} + {i} + {i}\n\n" for i in range(12))


def _library(root):
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("@staticmethod\n" + SMALL)
    (root / "mod.py").write_text("import os\n\n" + SMALL + "\n\n" + BIG)
    (root / "broken.py").write_text("def (:\n")
    (root / "test").mkdir()
    (root / "test" / "skipped.py").write_text(SMALL)
    (root / "test_mod.py").write_text(SMALL)
    return root


def test_units_functions_whole_big_classes_by_method(tmp_path):
    units = list(script.code_units((_library(tmp_path) / "mod.py").read_text(), min_chars=20, max_chars=200))
    assert units[0] == ("function", "small", SMALL)
    assert [name for _, name, _ in units[1:]] == [f"Big.m{i}" for i in range(12)]
    assert all(kind == "method" and text.startswith("def m") for kind, _, text in units[1:])  # dedented
    assert list(script.code_units("def (:\n", 0, 100)) == []
    assert [name for _, name, _ in script.code_units(SMALL + "\n\n" + BIG, 20, 10_000)] == ["small", "Big"]
    assert list(script.code_units(SMALL, len(SMALL) + 1, 10_000)) == []  # below min_chars


def test_files_skip_tests_and_decorators_are_kept(tmp_path):
    root = _library(tmp_path)
    assert [p.relative_to(root).as_posix() for p in script.source_files(root)] == [
        "broken.py", "mod.py", "pkg/__init__.py"]
    records = {r["id"]: r for r in script.conversations(root, 20, 200)}
    assert records["pkg:small"]["conversations"][1]["value"] == f"```python\n@staticmethod\n{SMALL}```"
    assert records["mod:small"]["conversations"][0]["value"] == "Write the Python function `small` of the `mod` module."


def test_main_writes_shuffled_readable_records_and_manifest(tmp_path, capsys):
    root, out = _library(tmp_path / "lib"), tmp_path / "out" / "code.jsonl"
    assert script.main(["--out", str(out), "--root", str(root), "--min-chars", "20", "--max-chars", "200"]) == 0
    first = out.read_text()
    manifest = json.loads((tmp_path / "out" / "code.jsonl.manifest.json").read_text())
    assert manifest["conversations"] == 14 == len(first.splitlines())
    conversations, _ = read_conversations(str(out))
    assert len(conversations) == 14 and conversations[0].turns[1].role == "assistant"
    assert script.main(["--out", str(out), "--root", str(root), "--min-chars", "20", "--max-chars", "200"]) == 0
    assert out.read_text() == first  # the same seed, the same file
    assert script.main(["--out", str(out), "--root", str(root), "--min-chars", "20", "--max-chars", "200",
                        "--seed", "1"]) == 0
    assert out.read_text() != first and sorted(out.read_text().splitlines()) == sorted(first.splitlines())
    assert script.main(["--out", str(tmp_path / "none.jsonl"), "--root", str(root), "--min-chars", "10000"]) == 2
    assert not list(tmp_path.glob("none.jsonl*"))  # nothing half-written


def test_stub_style_asks_with_signature_and_docstring_as_humaneval_does(tmp_path):
    assert script.stub(SMALL, min_docstring=8) == 'def small(x):\n    """Twice x."""\n'
    assert script.stub(SMALL, min_docstring=9) is None  # "Twice x." is 8 characters
    assert script.stub('def f():\n    """Only a docstring, nothing to write."""\n', 1) is None
    assert script.stub("def f():\n    return 1\n", 0) is None  # no docstring
    assert script.stub('class C:\n    """A class."""\n    x = 1\n', 0) is None  # functions and methods only
    assert script.stub("def (:\n", 0) is None
    decorated = '@staticmethod\ndef g(a):\n    """Doc of g."""\n    return a\n'
    assert script.stub(decorated, 0) == '@staticmethod\ndef g(a):\n    """Doc of g."""\n'
    root, out = _library(tmp_path / "lib"), tmp_path / "stub.jsonl"
    args = ["--out", str(out), "--root", str(root), "--min-chars", "20", "--max-chars", "200", "--style", "stub",
            "--min-docstring", "8"]
    assert script.main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["mod:small", "pkg:small"]  # Big's methods have no docstring
    by_id = {r["id"]: r["conversations"] for r in records}
    assert by_id["mod:small"][0]["value"] == 'def small(x):\n    """Twice x."""\n'
    assert by_id["mod:small"][1]["value"] == f"```python\n{SMALL}```"
    manifest = json.loads((tmp_path / "stub.jsonl.manifest.json").read_text())
    assert manifest["style"] == "stub" and manifest["conversations"] == 2
