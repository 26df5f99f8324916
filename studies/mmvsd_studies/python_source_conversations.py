"""Code conversations for drafter training, from the Python standard library this interpreter ships.

A drafter for a code model (issue 35: an EAGLE-3 head for `qwen2.5-coder-1.5b`) learns the target's next-token
distributions, which `mmvsd prepare` / `mmvsd train` compute on whatever text the data holds: the text only has
to be of the right kind. ShareGPT holds little Python; the standard library is a large, offline, licence-clean
body of it (PSF licence). Every top-level function and class (a class longer than `--max-chars`: each of its
methods instead) between `--min-chars` and `--max-chars` becomes one conversation:

    user:      Write the Python function `name` of the `module` module.
    assistant: ```python
               <its source, as the file has it>
               ```

`--style stub` asks as HumanEval does instead: the user turn is a function's or method's signature and docstring
(those with a docstring of at least `--min-docstring` characters), the answer its source; on-policy answers
(`mmvsd regenerate`) replace the source with what the target writes after such a stub.

Files are read in sorted order and units in file order, then the records are shuffled with `--seed` (so the
first N, which `num_conversations` takes, are a sample of the whole library): the output depends only on the
interpreter's version and the seed (`OUT.manifest.json` records them, the count and the file's sha256). Test
suites, `idlelib`, `lib2to3`, `turtledemo` and `site-packages` are left out.

    python -m mmvsd_studies.python_source_conversations --out ~/data/pystdlib.jsonl
    mmvsd prepare --config mmvsd/configs/qwen15_coder_eagle3_cpu.yaml --data sharegpt+$HOME/data/pystdlib.jsonl ...
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

SKIPPED_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo"}


def source_files(root: Path) -> list[Path]:
    """The `.py` files under `root`, sorted, outside test suites and the skipped packages."""
    return sorted(path for path in root.rglob("*.py")
                  if not SKIPPED_PARTS & set(path.relative_to(root).parts[:-1]) and not path.name.startswith("test_"))


def _segment(lines: list[str], node: ast.AST) -> str:
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return "".join(lines[start - 1: node.end_lineno]).rstrip() + "\n"


def code_units(text: str, min_chars: int, max_chars: int) -> Iterator[tuple[str, str, str]]:
    """(kind, qualified name, source) of the top-level functions and classes of one module's `text`; a class
    over `max_chars` gives its methods instead. Units outside [min_chars, max_chars] are skipped; so is a file
    that does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            source = _segment(lines, node)
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            if len(source) > max_chars and isinstance(node, ast.ClassDef):
                for child in node.body:
                    if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                        method = textwrap.dedent(_segment(lines, child))
                        if min_chars <= len(method) <= max_chars:
                            yield "method", f"{node.name}.{child.name}", method
            elif min_chars <= len(source) <= max_chars:
                yield kind, node.name, source


def stub(source: str, min_docstring: int) -> str | None:
    """A function's `source` cut after its docstring, as a HumanEval prompt is; None for a class, a unit that does
    not parse alone, or a docstring shorter than `min_docstring` characters."""
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, ValueError, IndexError):
        return None
    doc = node.body[0] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.body else None
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None
    if len(doc.value.value.strip()) < min_docstring or doc.end_lineno >= (node.end_lineno or 0):
        return None  # too short to say what to write, or nothing after it to write
    return "".join(source.splitlines(keepends=True)[: doc.end_lineno])


def conversations(root: Path, min_chars: int, max_chars: int, style: str = "name",
                  min_docstring: int = 40) -> Iterator[dict]:
    """ShareGPT records, one per code unit of the standard library under `root`: asked by name (`style="name"`)
    or, for functions and methods with a docstring, by their signature and docstring (`"stub"`)."""
    for path in source_files(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        text = path.read_text(encoding="utf-8", errors="replace")
        for kind, name, source in code_units(text, min_chars, max_chars):
            if style == "stub":
                question = stub(source, min_docstring)
                if question is None:
                    continue
            else:
                question = f"Write the Python {kind} `{name}` of the `{module}` module."
            yield {"id": f"{module}:{name}", "conversations": [
                {"from": "human", "value": question}, {"from": "gpt", "value": f"```python\n{source}```"}]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON Lines file to write (ShareGPT records)")
    parser.add_argument("--min-chars", type=int, default=300)
    parser.add_argument("--max-chars", type=int, default=3000)
    parser.add_argument("--style", choices=["name", "stub"], default="name",
                        help="ask for a unit by name, or give a function's signature and docstring (HumanEval's form)")
    parser.add_argument("--min-docstring", type=int, default=40, help="--style stub: shortest docstring kept")
    parser.add_argument("--seed", type=int, default=0, help="order of the records")
    parser.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="the standard library's folder")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    records = list(conversations(Path(args.root), args.min_chars, args.max_chars, args.style,
                                args.min_docstring))
    random.Random(args.seed).shuffle(records)
    digest, count = hashlib.sha256(), 0
    with partial.open("w", encoding="utf-8") as f:
        for record in records:
            line = json.dumps(record, ensure_ascii=False) + "\n"
            f.write(line)
            digest.update(line.encode())
            count += 1
    if not count:
        partial.unlink()
        print(f"no code units under {args.root}", file=sys.stderr)
        return 2
    partial.replace(out)
    manifest = {"python": sys.version.split()[0], "root": args.root, "conversations": count, "seed": args.seed,
                "min_chars": args.min_chars, "max_chars": args.max_chars, "style": args.style,
                "min_docstring": args.min_docstring, "sha256": digest.hexdigest()}
    out.with_name(out.name + ".manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{count} conversations -> {out} (sha256 {digest.hexdigest()[:16]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
