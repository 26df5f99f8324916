"""Imports run one way, as docs/architecture.md's layer map says: the core imports none of `drafters/ data/ eval/
adapters/`; those import the core alone; training sits above them; `eval/`, the CLI and the lab sit on top.
Every runtime import counts, function-level ones included (typing-only ones do not)."""

from __future__ import annotations

import re

import pytest
from test_imports import ROOT, package_modules, runtime_imports

# (layer, rank, what belongs to it); a module may import its own layer's modules and lower ranks' only. The
# plugin folders may each import the core and themselves, not one another.
LAYERS = [
    ("core", 0, re.compile(r"mmvsd(\.(?!cli$|__main__$|eval\b|lab\b|training\b|drafters\b|adapters\b|data\b)\w+.*)?$")),
    ("drafters", 1, re.compile(r"mmvsd\.drafters\b")),
    ("adapters", 1, re.compile(r"mmvsd\.adapters\b")),
    ("data", 1, re.compile(r"mmvsd\.data\b")),
    ("training", 2, re.compile(r"mmvsd\.training\b")),
    ("top", 3, re.compile(r"mmvsd\.(eval\b|lab\b|cli$|__main__$)")),
]


def layer_of(module: str) -> tuple[str, int]:
    for name, rank, pattern in LAYERS:
        if pattern.match(module):
            return name, rank
    raise AssertionError(f"{module} is in no layer of the map")


def allowed(importer: str, imported: str) -> bool:
    (layer, rank), (other, other_rank) = layer_of(importer), layer_of(imported)
    return layer == other or other_rank < rank


def test_the_map_places_each_folder():
    assert layer_of("mmvsd") == ("core", 0) and layer_of("mmvsd.decoding.decode") == ("core", 0)
    assert layer_of("mmvsd.layouts.registry") == ("core", 0) and layer_of("mmvsd.configs") == ("core", 0)
    assert layer_of("mmvsd.drafters.eagle3")[0] == "drafters" and layer_of("mmvsd.data.images")[0] == "data"
    assert layer_of("mmvsd.training.trainer") == ("training", 2) and layer_of("mmvsd.cli") == ("top", 3)
    assert layer_of("mmvsd.eval.bench") == ("top", 3) and layer_of("mmvsd.lab.smol_llava") == ("top", 3)
    assert not allowed("mmvsd.decoding.decode", "mmvsd.drafters.ngram")
    assert not allowed("mmvsd.drafters.eagle3", "mmvsd.data.images")
    assert not allowed("mmvsd.training.trainer", "mmvsd.eval.suites")
    assert allowed("mmvsd.training.trainer", "mmvsd.drafters.eagle3") and allowed("mmvsd.cli", "mmvsd.training.trainer")


@pytest.mark.parametrize("name", sorted(package_modules()))
def test_imports_run_one_way(name):
    modules = package_modules()
    wrong = sorted(m for m in runtime_imports(name, modules[name], set(modules)) if not allowed(name, m))
    assert not wrong, f"{name} ({layer_of(name)[0]}) imports a higher layer: {wrong} (docs/architecture.md)"


def test_the_architecture_doc_shows_the_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for folder in ("mmvsd/decoding/", "mmvsd/training/", "mmvsd/layouts/", "drafters/", "adapters/", "data/",
                   "eval/", "mmvsd/lab/"):
        assert f"`{folder}`" in text, f"docs/architecture.md's layer map does not place {folder}"


def test_the_core_stays_small_at_its_top_level():
    top = [path for path in (ROOT / "mmvsd").glob("*.py")]
    assert len(top) <= 16, sorted(p.name for p in top)
