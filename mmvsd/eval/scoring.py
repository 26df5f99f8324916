"""Task accuracy where it is cheap: GSM8K exact match and HumanEval pass@1.

HumanEval completions run in a separate Python process with a timeout, never in this one.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in `text`, without thousands separators or a trailing '.0'."""
    found = NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value.removesuffix(".0")


def gsm8k_correct(answer_text: str, reference: dict) -> bool:
    """Exact match of the last number in the answer with the number after '####' in the reference."""
    expected = last_number(reference["answer"].split("####")[-1])
    return expected is not None and last_number(answer_text) == expected


def completion_code(answer_text: str, problem: dict) -> str:
    """The program to test: a fenced code block of the answer if it defines the function, else prompt + answer."""
    blocks = re.findall(r"```(?:python)?\n(.*?)```", answer_text, flags=re.DOTALL)
    for block in blocks:
        if f"def {problem['entry_point']}" in block:
            return problem["prompt"].split(f"def {problem['entry_point']}")[0] + block
    return problem["prompt"] + answer_text


def humaneval_passed(answer_text: str, problem: dict, timeout: float = 10.0) -> bool:
    """Run the problem's tests on the answer in a fresh Python process; False on failure or timeout."""
    program = f"{completion_code(answer_text, problem)}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "candidate.py"
        path.write_text(program)
        try:
            result = subprocess.run([sys.executable, str(path)], cwd=folder, capture_output=True, timeout=timeout,
                                    check=False)
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0
