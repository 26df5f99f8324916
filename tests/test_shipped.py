"""Shipped drafters: manifests, `--drafter default` / shipped names per target, corrupt or missing files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import save_tiny_target
from mmvsd import shipped
from mmvsd.cli import main
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.shipped import missing_card_info, model_card
from mmvsd.target_loader import BUILTIN_TARGETS, BuiltinTarget

INFO = {"target_sha256": "0" * 64, "training": {"objective": "ce", "max_steps": 3}, "data": "sharegpt",
        "steps": 3, "tokens_seen": 1536, "machine": "test (CPU)", "tau": {"mt_bench 60/7/10": 1.23},
        "tau_command": "mmvsd eval-drafter --target tiny-llama --drafter default --prompt-file mt_bench",
        "objective": "ce", "hours": 0.01,
        "held_out": {"prompts": "4 held-out prompts", "first_token": 0.25, "chain_3": 0.5, "tau_60_7_10": 1.75,
                     "command": "mmvsd eval-drafter --tree 3/3/1 --ngram off"}}


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """An empty shipped tree in place of the package's."""
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", folder)
    return folder


@pytest.fixture(scope="module")
def trained_folder(tiny_target, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("drafter") / "eagle3"
    Eagle3Drafter.from_target(tiny_target, seed=4).save_pretrained(folder)
    return folder


def ship(trained_folder: Path, name: str = "eagle3-ce", target: str = "tiny-llama", **extra) -> Path:
    return shipped.ship_drafter(trained_folder, target, name, **{**INFO, **extra})


def test_shipped_drafter_loads_by_default_and_by_name(root, trained_folder, tiny_target):
    folder = ship(trained_folder, default=True)
    assert folder == root / "tiny-llama" / "eagle3-ce"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}  # the card is not one of them
    card = (folder / "README.md").read_text()
    assert card == model_card(manifest)
    assert "| first draft token accepted (argmax chain) | 0.250 |" in card and "| hours | 0.01 |" in card
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == shipped.file_sha256(folder / name)
    assert manifest["target"] == "tiny-llama" and manifest["drafter_type"] == "eagle3" and manifest["default"]
    assert {k: manifest[k] for k in INFO} == INFO
    weights = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    original = load_file(str(trained_folder / "model.safetensors"))
    for spec in ("default", "eagle3-ce"):
        drafter = drafter_from_spec(spec, tiny_target, ngram=False)
        state = drafter.state_dict()
        for key, value in original.items():
            expected = value.to(torch.bfloat16).to(value.dtype) if value.is_floating_point() else value
            assert torch.equal(state[key], expected), key
    assert [(d.target, d.name) for d in shipped.list_shipped()] == [("tiny-llama", "eagle3-ce")]


def test_a_card_gives_held_out_acceptance_per_domain_and_names_a_missing_figure():
    """Per-domain figures (chat, math, code; as public heads report them) render as a table under the held-out
    acceptance; a domain without one of them is a missing card fact, not a silent blank."""
    domains = {"chat": {"prompts": 20, "first_token": 0.4, "chain_3": 0.55, "tau_4_3_1": 1.5},
               "math": {"prompts": 20, "first_token": 0.3, "chain_3": 0.4, "tau_4_3_1": 1.4}}
    held_out = {**INFO["held_out"], "by_domain": {"command": "mmvsd eval-drafter --tree 4/3/1", "domains": domains}}
    manifest = {**INFO, "name": "eagle3-ce", "target": "tiny-llama", "held_out": held_out}
    assert not missing_card_info(manifest)
    card = model_card(manifest)
    assert "| domain | prompts | first draft token accepted | accepted tokens per depth-3 chain (0-3) | tau, " in card
    assert "| chat | 20 | 0.400 | 0.550 | 1.500 |" in card and "| math | 20 | 0.300 | 0.400 | 1.400 |" in card
    del domains["math"]["chain_3"]
    assert missing_card_info(manifest) == ["held_out.by_domain.domains.math.chain_3"]


def test_corrupt_or_missing_files_name_the_file(root, trained_folder, tiny_target):
    folder = ship(trained_folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"corrupt: sha256 of .*model\.safetensors"):
        drafter_from_spec("default", tiny_target)
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match=r"config\.json is missing"):
        drafter_from_spec("eagle3-ce", tiny_target)
    (folder / "manifest.json").unlink()
    with pytest.raises(UserError, match=r"manifest\.json is missing"):
        shipped.resolve_drafter("eagle3-ce", "tiny-llama")


def test_default_resolves_per_target(root, trained_folder):
    with pytest.raises(UserError, match=r"no shipped drafter \(targets with one: none yet\)"):
        shipped.resolve_drafter("default", "tiny-llama")
    ship(trained_folder, "eagle3-ce", "tiny-llama")
    ship(trained_folder, "eagle3-vsd", "other-target")
    assert shipped.resolve_drafter("default", "tiny-llama") == root / "tiny-llama" / "eagle3-ce"  # its only one
    with pytest.raises(UserError,
                       match=r"'third' has no shipped drafter \(targets with one: other-target, tiny-llama\)"):
        shipped.resolve_drafter("default", "third")
    with pytest.raises(UserError, match=r"shipped for it: eagle3-ce; 'eagle3-vsd' ships for other-target"):
        shipped.resolve_drafter("eagle3-vsd", "tiny-llama")
    ship(trained_folder, "msd", "tiny-llama")
    with pytest.raises(UserError, match="none is marked default: eagle3-ce, msd"):
        shipped.resolve_drafter("default", "tiny-llama")
    ship(trained_folder, "msd", "tiny-llama", default=True)
    assert shipped.resolve_drafter("default", "tiny-llama") == root / "tiny-llama" / "msd"


def test_write_manifest_refuses_what_must_not_ship(root, trained_folder, monkeypatch):
    with pytest.raises(UserError, match="fp16 or bf16"):
        shipped.write_manifest(trained_folder, target="tiny-llama", **{k: v for k, v in INFO.items()})
    with pytest.raises(UserError, match="lacks tokens_seen, machine"):
        shipped.write_manifest(trained_folder, **{k: v for k, v in INFO.items() if k not in ("tokens_seen", "machine")},
                               target="tiny-llama")
    unmeasured = {**INFO, "held_out": {"prompts": "4 prompts", "first_token": 0.25, "command": "c"}}
    with pytest.raises(UserError, match="lacks held_out.chain_3, held_out.tau_BUDGET_DEPTH_TOPK"):
        shipped.write_manifest(trained_folder, **unmeasured, target="tiny-llama")
    monkeypatch.setattr(shipped, "MAX_FILE_BYTES", 1000)
    with pytest.raises(UserError, match="at most 0 MB"):
        ship(trained_folder)
    assert not (root / "tiny-llama" / "eagle3-ce").exists()  # nothing half-written
    assert not (trained_folder / "manifest.json").exists()
    with pytest.raises(UserError, match="dtype"):
        ship(trained_folder, dtype="fp32")


@pytest.fixture
def builtin_tiny(tmp_path, monkeypatch) -> str:
    """A built-in target name `tiny-test` for a tiny saved target."""
    folder = save_tiny_target(tmp_path / "tiny-test")
    monkeypatch.setitem(BUILTIN_TARGETS, "tiny-test", BuiltinTarget("tiny-test", assemble=lambda: folder))
    return "tiny-test"


def test_cli_default_drafter_and_list(root, builtin_tiny, tmp_path, capsys):
    argv = ["generate", "--target", builtin_tiny, "--prompt", "w1 w2", "--max-new-tokens", "5"]
    assert main(argv) == 2
    assert "no --drafter given and target 'tiny-test' has no shipped drafter" in capsys.readouterr().err
    assert main(["drafters", "list"]) == 0 and "no shipped drafters" in capsys.readouterr().out
    from mmvsd.target_loader import load_target

    source = tmp_path / "trained"
    Eagle3Drafter.from_target(load_target(builtin_tiny), seed=1).save_pretrained(source)
    ship(source, "eagle3-ce", builtin_tiny, default=True)
    assert main(argv) == 0, capsys.readouterr().err
    assert "tau" in capsys.readouterr().out
    assert main([*argv, "--drafter", "eagle3-ce"]) == 0
    capsys.readouterr()
    assert main(["drafters", "list"]) == 0
    listing = capsys.readouterr().out
    assert "tiny-test" in listing and "eagle3-ce" in listing and "yes" in listing and "1.23" in listing
    assert main(["drafters", "card", "tiny-test/eagle3-ce"]) == 0
    card = capsys.readouterr().out
    assert card.startswith("# tiny-test / eagle3-ce (the target's default)") and "| tau, tree 60/7/10" in card
    assert main(["drafters", "card", "eagle3-xx"]) == 2
    assert "no shipped drafter 'eagle3-xx'; name one of: tiny-test/eagle3-ce" in capsys.readouterr().err


def test_every_shipped_drafter_matches_its_manifest():
    """The package's own shipped drafters (none until trained weights are added) verify and are complete."""
    for drafter in shipped.list_shipped():
        drafter.verify()
        manifest = drafter.manifest()
        assert all(key in manifest for key in shipped.REQUIRED_INFO), drafter.folder
        assert not missing_card_info(manifest), drafter.folder
        assert (drafter.folder / "README.md").read_text() == model_card(manifest), f"{drafter.folder}: card is stale"
        assert all(entry["bytes"] <= shipped.MAX_FILE_BYTES for entry in manifest["files"].values())


def test_the_listing_names_benchmarks_and_says_shared_conditions_once():
    tau = {"mt_bench_80_first_turns_256_tokens_60/7/10_T0": 1.99, "gsm8k_80_first_turns_256_tokens_60/7/10_T0": 2.12}
    assert shipped._tau_text(tau) == "mt_bench 1.99, gsm8k 2.12 (80 first turns each; 256 tokens, tree 60/7/10, T0)"
    mixed = {"chartqa_mini_long_30_prompts_256_tokens_60/5/8_T0": 3.84, "all_six_tasks_180_prompts": 3.77}
    assert shipped._tau_text(mixed) == ("chartqa_mini_long 3.84 (30), all_six_tasks 3.77 (180) "
                                        "(256 tokens, tree 60/5/8, T0)")
    assert shipped._tau_text({"custom key": "pending"}) == "custom key pending" and shipped._tau_text(1.234) == "1.23"
    both = {"mt_bench_80_first_turns_128_tokens_60/7/10_T0": 1.95, "gsm8k_80_prompts_128_tokens_60/7/10_T0": 2.14,
            "mt_bench_20_first_turns_128_tokens_60/7/10_T1": 1.56}  # what differs is said per entry
    assert shipped._tau_text(both) == ("mt_bench T0 1.95 (80), gsm8k T0 2.14 (80), mt_bench T1 1.56 (20) "
                                       "(128 tokens, tree 60/7/10)")


def test_a_listing_into_a_closed_pipe_stops_quietly():
    """`mmvsd drafters list | head -0`: the reader is gone before the first line, so no traceback, exit 141."""
    process = subprocess.Popen([sys.executable, "-m", "mmvsd", "drafters", "list"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # long before the interpreter has started and printed
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and "Traceback" not in stderr, stderr
