"""Cheap checks first: every command checks the files, names and options a user typed before it loads a target or
measures this machine, so a mistake ends at once in one message and exit 2."""

from __future__ import annotations

import pytest

from conftest import run_cli
from mmvsd import target_loader

MISSING = "no-such-prompts.jsonl"
SMOL = ["--target", "smollm2-135m"]

# (command line, words of its one error message); each is wrong in one input only
MISTAKES = {
    "eval-drafter: missing prompt file": (["eval-drafter", *SMOL, "--drafter", "default", "--prompt-file", MISSING],
                                          "prompt file not found"),
    "eval-drafter: missing drafter folder": (["eval-drafter", *SMOL, "--drafter", "./no/such/drafter",
                                              "--prompt-file", "gsm8k"], "no such drafter folder"),
    "eval-drafter: unknown adapter": (["eval-drafter", *SMOL, "--drafter", "ngram", "--prompt-file", "gsm8k",
                                       "--adapter", "nope"], "no modality adapter 'nope'"),
    "eval-drafter: bad tree": (["eval-drafter", *SMOL, "--drafter", "ngram", "--prompt-file", "gsm8k", "--tree",
                                "6/3"], "expected auto, paper or BUDGET/DEPTH/TOPK"),
    "eval-drafter: bad limit": (["eval-drafter", *SMOL, "--drafter", "ngram", "--prompt-file", "gsm8k", "--limit",
                                 "-1"], "--limit must be >= 0"),
    "generate: missing prompt file": (["generate", *SMOL, "--drafter", "ngram", "--prompt-file", MISSING],
                                      "prompt file not found"),
    "generate: unknown shipped drafter": (["generate", *SMOL, "--drafter", "no-such-drafter", "--prompt", "hi"],
                                          "neither a drafter folder nor a shipped drafter"),
    "generate: bad n-gram option": (["generate", *SMOL, "--drafter", "ngram:max_n=x", "--prompt", "hi"], "max_n"),
    "generate: unknown adapter": (["generate", *SMOL, "--drafter", "none", "--prompt", "hi", "--adapter", "nope"],
                                  "no modality adapter 'nope'"),
    "bench: unknown suite": (["bench", *SMOL, "--suite", "nosuite"], "unknown suite or benchmark 'nosuite'"),
    "bench: missing drafter folder": (["bench", *SMOL, "--suite", "gsm8k", "--drafter", "./no/such/drafter"],
                                      "no such drafter folder"),
    "bench: unknown adapter": (["bench", *SMOL, "--suite", "gsm8k", "--adapter", "nope"], "no modality adapter"),
    "bench: missing assistant": (["bench", *SMOL, "--suite", "gsm8k", "--methods", "vanilla,assisted", "--assistant",
                                  "./no/such/model"], "unknown target './no/such/model'"),
    "bench: missing draft model": (["bench", *SMOL, "--suite", "gsm8k", "--drafter", "model:./no/such/model.gguf"],
                                   "GGUF file not found"),
    "bench: unknown engine": (["bench", *SMOL, "--suite", "gsm8k", "--engine", "nope"], "--engine 'nope': choose"),
    "bench: unknown target": (["bench", "--target", "no-such-target", "--suite", "gsm8k"],
                              "unknown target 'no-such-target'"),
    "generate: unknown target": (["generate", "--target", "no-such-target", "--prompt", "hi", "--drafter", "none"],
                                 "unknown target 'no-such-target'"),
    "eval-drafter: prompt set without its data": (["eval-drafter", *SMOL, "--drafter", "ngram", "--prompt-file",
                                                   "vqav2_val"], "lmms-eval task 'vqav2_val' cannot be loaded"),
    "regenerate: unknown engine": (["regenerate", *SMOL, "--output", "{tmp}/out", "--engine", "nope"],
                                   "--engine 'nope': choose"),
    "regenerate: missing data file": (["regenerate", *SMOL, "--output", "{tmp}/out", "--data", "no-such.json"],
                                      "dataset file not found"),
    "bench: bad llama.cpp chain": (["bench", *SMOL, "--suite", "gsm8k", "--engine", "llama.cpp", "--chain", "x/y",
                                    "--methods", "vanilla"], "--chain 'x/y'"),
    "train: missing data file": (["train", *SMOL, "--data", "no-such-chats.json", "--output", "{tmp}/out"],
                                 "dataset file not found"),
    "train: unknown objective": (["train", *SMOL, "--objective", "ce+nope", "--output", "{tmp}/out"],
                                 "unknown objective 'ce+nope'"),
    "train: unknown adapter": (["train", *SMOL, "--output", "{tmp}/out", "adapter=nope"], "no modality adapter"),
    "train: layers of a fresh drafter with --init": (["train", *SMOL, "--init", "eagle3-ce", "--output", "{tmp}/out",
                                                      "draft_layers=2"], "shape a fresh one"),
    "train: no decoder layers": (["train", *SMOL, "--output", "{tmp}/out", "draft_layers=0"], "draft_layers"),
    "train: layers for a one-layer kind": (["train", *SMOL, "--drafter", "vispec", "--output", "{tmp}/out",
                                            "draft_layers=2"], "are EAGLE-3's"),
    "train: layer weights the exact kernels pack": (["train", *SMOL, "--output", "{tmp}/out", "target_engine=exact",
                                                     "init_layers_from_target=true"], "use target_engine=stock"),
    "train: missing tau prompts": (["train", *SMOL, "--output", "{tmp}/out", "eval_every=1",
                                    f"eval_prompts={MISSING}"], "prompt file not found"),
    "profile: missing drafter folder": (["profile", *SMOL, "--drafter", "./no/such/drafter"],
                                        "no such drafter folder"),
    "export: unknown format": (["export", "--drafter", "default", *SMOL, "--format", "nope", "{tmp}/out"],
                               "unknown checkpoint layout 'nope'"),
    "draft-vocab: missing data file": (["draft-vocab", *SMOL, "--drafter", "random", "--data", "no-such.json",
                                        "--out", "{tmp}/out"], "dataset file not found"),
    "draft-vocab: not a neural drafter": (["draft-vocab", *SMOL, "--drafter", "ngram", "--data", "sharegpt",
                                           "--out", "{tmp}/out"], "not a neural drafter"),
}


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a target (and so measuring this machine with it) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a target loaded before the command checked its inputs")

    monkeypatch.setattr(target_loader, "resolve_target_folder", refuse)
    monkeypatch.setattr(target_loader, "load_target_folder", refuse)


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_ends_in_one_message_before_anything_loads(case, nothing_loads, tmp_path, capsys):
    argv, words = MISTAKES[case]
    code, _, err = run_cli(capsys, *[arg.format(tmp=tmp_path) for arg in argv])
    assert code == 2, err
    assert err.startswith("mmvsd: error: ") and words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_llamacpp_refuses_a_multi_layer_drafter_before_anything_loads(nothing_loads, tmp_path, capsys):
    folder = tmp_path / "two-layers"
    folder.mkdir()
    (folder / "config.json").write_text('{"num_layers": 2}')
    code, _, err = run_cli(capsys, "bench", *SMOL, "--suite", "gsm8k", "--engine", "llama.cpp", "--drafter",
                           str(folder), "--chain", "3/0.1", "--methods", "vanilla,tree")
    assert code == 2 and "llama.cpp's EAGLE-3 holds one decoder layer; this drafter has 2" in err, err
