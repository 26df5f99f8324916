"""An adapter from another package (tests/packages/mmvsd_gray_adapter) registers through the
`mmvsd.adapters` entry point once installed, trains a drafter on image conversations and decodes an
image prompt through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import save_tiny_llava

PACKAGE = Path(__file__).parent / "packages" / "mmvsd_gray_adapter"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """The example package pip-installed into a private folder; the environment that sees it."""
    site = tmp_path_factory.mktemp("site")
    source = shutil.copytree(PACKAGE, tmp_path_factory.mktemp("src") / PACKAGE.name)  # builds leave the repo clean
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                            "--target", str(site), str(source)], capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def mmvsd(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmvsd.cli", *args], capture_output=True, text=True, env=env,
                          check=False)


def test_entry_point_adapter_is_listed(installed):
    result = mmvsd(["adapters", "list"], installed)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("gray "))
    assert "entry point mmvsd_gray_adapter:GrayImageAdapter (package mmvsd-gray-adapter)" in line


def write_llava_instruct(folder: Path, rng) -> Path:
    """Four LLaVA-Instruct records over generated images."""
    records = []
    for index in range(4):
        Image.fromarray((rng.random((30 + 6 * index, 40, 3)) * 255).astype("uint8")).save(folder / f"{index}.png")
        answer = " ".join(f"w{j}" for j in rng.integers(5, 100, 10))
        records.append({"id": str(index), "image": f"{index}.png", "conversations": [
            {"from": "human", "value": "<image>\nw5 w6"}, {"from": "gpt", "value": answer}]})
    (folder / "data.json").write_text(json.dumps(records))
    return folder / "data.json"


def test_entry_point_adapter_trains_and_decodes_through_the_cli(installed, tmp_path):
    folder = save_tiny_llava(tmp_path / "tiny-llava")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((40, 60, 3)) * 255).astype("uint8")).save(tmp_path / "a.png")
    data = write_llava_instruct(tmp_path, rng)
    trained = mmvsd(["train", "--target", str(folder), "--drafter", "vispec", "--data", f"llava-instruct:{data}",
                     "--output", str(tmp_path / "vispec"), "adapter=gray", "max_steps=3", "batch_size=2",
                     "progress=false", "validation_fraction=0", "loss.ttt_steps=2"], installed)
    assert trained.returncode == 0, trained.stderr
    assert "adapter: gray" in (tmp_path / "vispec" / "train_config.yaml").read_text()
    common = ["generate", "--target", str(folder), "--prompt", "w5 w6", "--image", str(tmp_path / "a.png"),
              "--max-new-tokens", "12", "--json"]
    runs = {}
    for name, extra in {"gray": ["--adapter", "gray", "--drafter", str(tmp_path / "vispec")],
                        "gray-vanilla": ["--adapter", "gray", "--drafter", "none"],
                        "colour": ["--drafter", "none"]}.items():
        result = mmvsd([*common, str(tmp_path / f"{name}.json"), *extra], installed)
        assert result.returncode == 0, result.stderr
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())["results"][0]["output_ids"]
    assert runs["gray"] == runs["gray-vanilla"]  # lossless with the outside adapter
    assert runs["gray"] != runs["colour"]  # and it really changed what the target saw


def test_without_the_package_the_name_is_unknown(tmp_path):
    result = mmvsd(["generate", "--target", str(save_tiny_llava(tmp_path / "t")), "--drafter", "none",
                    "--prompt", "w5", "--adapter", "gray"], dict(os.environ))
    assert result.returncode == 2 and "no modality adapter 'gray'" in result.stderr
