"""The docs check: run every `mmvsd` command of the README as written, from the repository root, and report
each one's exit code and time (the install and test commands are CI's; `tests/test_readme.py` parses all of
them and runs the quick ones). Outputs land in the folders the commands name (`runs/`, `bench-results/`,
both ignored by git); a command whose output folder exists is skipped, so a second run does not fail.

    python benchmarks/check_readme.py [--only generate,bench]
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def readme_commands(text: str | None = None) -> list[str]:
    """The shell commands of the README's bash blocks, continuation lines joined, comments dropped (the
    tests parse the README with it too: tests/test_readme.py)."""
    text = README.read_text() if text is None else text
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for command in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
            command = command.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def output_folder(argv: list[str]) -> Path | None:
    for flag in ("--output", "--out"):
        if flag in argv:
            return ROOT / argv[argv.index(flag) + 1]
    return ROOT / "bench-results" if argv[0] == "bench" else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated commands to run (e.g. generate,bench)")
    args = parser.parse_args()
    only = {c for c in args.only.split(",") if c}
    failed = 0
    for command in readme_commands():
        argv = shlex.split(command)
        if argv[0] != "mmvsd" or (only and argv[1] not in only):
            continue
        out = output_folder(argv[1:])
        if out is not None and out.exists():
            print(f"skip (output {out.relative_to(ROOT)} exists): {command}", flush=True)
            continue
        start = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "mmvsd", *argv[1:]], cwd=ROOT, check=False).returncode
        print(f"exit {code} in {time.perf_counter() - start:.0f} s: {command}", flush=True)
        failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
