"""`mmvsd generate` end to end on a tiny saved target, and its bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli, save_tiny_target
from mmvsd.cli import main
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.target_loader import load_target


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def texts_of(out: str) -> list[str]:
    lines = out.splitlines()
    return [lines[i + 1] for i, line in enumerate(lines) if line.startswith("=== prompt")]


def test_generate_vanilla_and_random_drafter_print_identical_text(tiny_dir, tmp_path, capsys):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(
        json.dumps({"prompt": "w1 w2 w3"}) + "\n" + json.dumps({"turns": ["w9 w8", "w7"]}) + "\n"
        + json.dumps({"prompt": "w40 w41 w42 w43 w44"}) + "\n"
    )
    common = ["generate", "--target", str(tiny_dir), "--prompt-file", str(prompt_file), "--max-new-tokens", "20"]
    code, vanilla_out, _ = run_cli(capsys, *common, "--drafter", "none", "--json", str(tmp_path / "v.json"))
    assert code == 0
    code, spec_out, _ = run_cli(capsys, *common, "--drafter", "random", "--batch-size", "2",
                                "--json", str(tmp_path / "s.json"))
    assert code == 0
    assert texts_of(vanilla_out) == texts_of(spec_out) and len(texts_of(spec_out)) == 3
    assert "tau" in spec_out and "tok/s" in spec_out and "target forwards" in spec_out
    vanilla = json.loads((tmp_path / "v.json").read_text())["results"]
    spec = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [r["output_ids"] for r in vanilla] == [r["output_ids"] for r in spec]
    assert all(r["new_tokens"] == len(r["output_ids"]) and r["tau"] >= 1.0 for r in spec)
    assert spec[1]["prompt"] == "w9 w8"


def test_saved_drafter_round_trip(tiny_dir, tmp_path, capsys):
    target = load_target(str(tiny_dir))
    drafter = Eagle3Drafter.from_target(target, seed=1).eval()
    drafter.save_pretrained(tmp_path / "drafter")
    code, out, err = run_cli(capsys, "generate", "--target", str(tiny_dir), "--drafter", str(tmp_path / "drafter"),
                             "--prompt", "w5 w6", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3")
    assert code == 0, err
    assert len(texts_of(out)) == 1


def bad_input_cases(tiny_dir: Path, tmp: Path) -> dict[str, list[str]]:
    other = save_tiny_target(tmp / "other", vocab=96, seed=1)
    mismatched = tmp / "mismatched-drafter"
    Eagle3Drafter.from_target(load_target(str(other)), seed=0).save_pretrained(mismatched)
    no_weights = tmp / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_dir / "config.json").read_text())
    corrupt = tmp / "corrupt"
    corrupt.mkdir()
    for f in tiny_dir.iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    empty = tmp / "empty.jsonl"
    empty.write_text("\n")
    base = ["generate", "--drafter", "none", "--max-new-tokens", "8"]
    return {
        "unknown target": base + ["--target", "no-such-model", "--prompt", "w1"],
        "llava weights absent": base + ["--target", "llava-1.5-7b", "--prompt", "w1"],
        "missing weights": base + ["--target", str(no_weights), "--prompt", "w1"],
        "corrupt weights": base + ["--target", str(corrupt), "--prompt", "w1"],
        "bad gguf": base + ["--target", str(tmp / "missing.gguf"), "--prompt", "w1"],
        "mismatched drafter": ["generate", "--target", str(tiny_dir), "--drafter", str(mismatched),
                               "--prompt", "w1"],
        "not a drafter": ["generate", "--target", str(tiny_dir), "--drafter", str(tmp), "--prompt", "w1"],
        "too long": base + ["--target", str(tiny_dir), "--prompt", " ".join(["w1"] * 600)],
        "empty prompt file": base + ["--target", str(tiny_dir), "--prompt-file", str(empty)],
        "missing prompt file": base + ["--target", str(tiny_dir), "--prompt-file", str(tmp / "nope.jsonl")],
        "bad device": base + ["--target", str(tiny_dir), "--prompt", "w1", "--device", "tpu"],
    }


def test_bad_input_gives_one_clear_line_and_exit_2(tiny_dir, tmp_path, capsys):
    for case, argv in bad_input_cases(tiny_dir, tmp_path).items():
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, case
        lines = [line for line in err.splitlines() if line.startswith("mmvsd: error:")]
        assert len(lines) == 1, (case, err)
        assert "Traceback" not in err, case


def test_missing_llava_weights_message_names_what_to_put_where(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code, _, err = run_cli(capsys, "generate", "--target", "llava-1.5-13b", "--drafter", "none", "--prompt", "hi")
    assert code == 2
    assert "llava-hf/llava-1.5-13b-hf" in err and "--target /path/to/llava-1.5-13b-hf" in err


def test_batch_size_zero_is_rejected(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--target", str(tiny_dir), "--drafter", "none", "--prompt", "w1", "--batch-size", "0"])
    assert exc.value.code == 2
    assert "--batch-size: must be >= 1" in capsys.readouterr().err


def test_drafter_save_load_keeps_logits(tiny_target, tmp_path):
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=64, seed=2).eval()
    drafter.set_draft_vocab(torch.arange(0, 128, 2))
    drafter.save_pretrained(tmp_path / "d")
    from mmvsd.drafter_base import load_drafter

    loaded = load_drafter(tmp_path / "d", tiny_target)
    features = torch.randn(2, 5, 3 * tiny_target.hidden_size)
    ids = torch.randint(0, 128, (2, 5))
    mask = torch.zeros(1, 1, 5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -1e9)
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        a = drafter.draft_logits(drafter.read_target(features, ids, pos, mask, None))
        b = loaded.draft_logits(loaded.read_target(features, ids, pos, mask, None))
    assert torch.equal(a, b)
    assert torch.equal(loaded.draft_to_target(torch.arange(64)), torch.arange(0, 128, 2))
    assert loaded.t2d.sum() == 64 and not (tmp_path / "d" / "embed_tokens.weight").exists()
    assert set(json.loads((tmp_path / "d" / "config.json").read_text())) >= {"mmvsd_drafter_type", "draft_vocab_size"}


@pytest.mark.smollm2
def test_smollm2_cli_vanilla_and_random_drafter_identical(capsys):
    common = ["generate", "--target", "smollm2-135m", "--prompt", "Name three colours.", "--max-new-tokens", "24"]
    code, vanilla_out, _ = run_cli(capsys, *common, "--drafter", "none")
    assert code == 0
    code, spec_out, _ = run_cli(capsys, *common, "--drafter", "random", "--tree-budget", "16", "--tree-depth", "4")
    assert code == 0
    assert texts_of(vanilla_out) == texts_of(spec_out) and texts_of(spec_out)[0].strip()
