"""The tree options: one grammar, one rule for unset parts (the paper's tree for the prompts' kind), and the same
flags giving the same tree in every command (generate, eval-drafter, bench, the lmms-eval plugin)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from mmvsd.cli import build_parser, main
from mmvsd.decoding import decode
from mmvsd.decoding.tree import TreeShape
from mmvsd.errors import UserError
from mmvsd.eval import acceptance, bench
from mmvsd.eval.lmms_plugin import MmvsdLmms
from mmvsd.tree_options import TEXT_TREE, tree_parts, tree_shape, tree_spec, tree_spec_from_args

TEXT_BENCHMARK, IMAGE_BENCHMARK = "gsm8k", "vqav2_val_mini_long"  # a text and an image benchmark (or prompt set)


def test_unset_parts_take_the_papers_tree_for_the_prompts_kind():
    assert tree_shape("paper", media=False) == TreeShape(60, 7, 10) == TreeShape(*TEXT_TREE) == TreeShape()
    assert tree_shape("paper", media=True) == TreeShape(60, 5, 8)
    assert tree_shape(tree_spec(None, None, 5, None), media=False) == TreeShape(60, 5, 10)
    assert tree_shape(tree_spec(None, None, 5, None), media=True) == TreeShape(60, 5, 8)
    assert tree_shape("12/0/3", media=True) == TreeShape(12, 5, 3)  # a 0 part takes the paper's value
    assert tree_shape("auto", media=True) == "auto" and tree_parts("auto") is None


@pytest.mark.parametrize(("args", "message"), [
    (("60/7", None, None, None), "expected auto, paper or BUDGET/DEPTH/TOPK"),
    (("big", None, None, None), "expected auto, paper"),
    (("-1/2/3", None, None, None), "expected auto, paper"),
    (("auto", 12, None, None), "two ways to say one thing"),
    ((None, 0, None, None), "must be >= 1"),
    ((None, None, None, -2), "must be >= 1"),
])
def test_malformed_or_contradictory_tree_options_fail_clearly(args, message):
    with pytest.raises(UserError, match=message):
        tree_spec(*args)


def test_each_commands_default_tree():
    parser = build_parser()
    generate = parser.parse_args(["generate", "--target", "t", "--prompt", "p"])
    replay = parser.parse_args(["eval-drafter", "--target", "t", "--prompt-file", "f"])
    assert tree_spec_from_args(generate) == "auto" and tree_spec_from_args(replay) == "paper"


# --- the same flags through every command's own path --------------------------------------------------------------

class Captured(Exception):
    """Raised by a stand-in where a command hands its tree to decoding: the test reads what it was given."""

    def __init__(self, tree) -> None:
        super().__init__("captured")
        self.tree = tree


def generate_tree(monkeypatch, llava_dir: Path, flags: list[str], media: bool):
    """The tree `mmvsd generate FLAGS` decodes with (one prompt, with an image when `media`)."""
    def stop(target, drafter, prompts, config, **_):
        raise Captured(config.tree)

    monkeypatch.setattr(decode, "speculative_generate", stop)
    image = ["--image", str(llava_dir / "a.png")] if media else []
    with pytest.raises(Captured) as caught:
        main(["generate", "--target", str(llava_dir), "--drafter", "random", "--prompt", "w5 w6", *image, *flags])
    return caught.value.tree


def eval_drafter_tree(monkeypatch, llava_dir: Path, tmp_path: Path, flags: list[str], media: bool):
    """The tree `mmvsd eval-drafter FLAGS` replays (a text prompt file, or an image task with its images)."""
    def stop(target, prompts, max_new_tokens, shape):
        raise Captured(shape)

    monkeypatch.setattr(acceptance, "check_eval_prompts", stop)
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "w5 w6"}) + "\n")
    source = IMAGE_BENCHMARK if media else str(prompt_file)
    with pytest.raises(Captured) as caught:
        main(["eval-drafter", "--target", str(llava_dir), "--drafter", "random", "--prompt-file", source,
              "--limit", "1", *flags])
    return caught.value.tree


def bench_tree(monkeypatch, flags: list[str], media: bool):
    """The tree `mmvsd bench FLAGS` decodes a text or an image benchmark's rows with."""
    def stop(config, **_):
        raise Captured(config)

    monkeypatch.setattr(bench, "run_bench", stop)
    with pytest.raises(Captured) as caught:
        main(["bench", *flags])
    config = caught.value.tree
    (spec,) = config.trees
    method = bench.Method("tree", lambda prompts, config: [], True, tree=spec)
    return bench.decode_config(config, method, 0.0, IMAGE_BENCHMARK if media else TEXT_BENCHMARK).tree


def plugin_trees(llava_dir: Path, model_args: str) -> dict[bool, object]:
    """The trees the lmms-eval plugin decodes a text request and a request with an image with."""
    model = MmvsdLmms.create_from_arg_string(f"target={llava_dir},drafter=none,{model_args}", {"batch_size": 1})
    image = Image.open(llava_dir / "a.png")
    prompts = {False: model.encode("w5 w6", []), True: model.encode("<image>\nw5 w6", [image])}
    return {media: model.decode_config({}, prompt).tree for media, prompt in prompts.items()}


@pytest.mark.parametrize(("flags", "model_args", "expected"), [
    (["--tree-depth", "5"], "tree_depth=5", {False: (60, 5, 10), True: (60, 5, 8)}),
    (["--tree", "paper"], "tree=paper", {False: (60, 7, 10), True: (60, 5, 8)}),
    (["--tree", "12/0/3"], "tree=12/0/3", {False: (12, 7, 3), True: (12, 5, 3)}),
    (["--tree-budget", "30", "--tree-topk", "4"], "tree_budget=30,tree_topk=4", {False: (30, 7, 4), True: (30, 5, 4)}),
    (["--tree", "16/4/4"], "tree=16/4/4", {False: (16, 4, 4), True: (16, 4, 4)}),
])
def test_the_same_flags_give_the_same_tree_in_every_command(monkeypatch, llava_dir, tmp_path, flags, model_args,
                                                            expected):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    plugin = plugin_trees(llava_dir, model_args)
    for media, parts in expected.items():
        trees = {"generate": generate_tree(monkeypatch, llava_dir, flags, media),
                 "eval-drafter": eval_drafter_tree(monkeypatch, llava_dir, tmp_path, flags, media),
                 "bench": bench_tree(monkeypatch, flags, media),
                 "lmms-eval plugin": plugin[media]}
        assert trees == dict.fromkeys(trees, TreeShape(*parts)), f"media={media}"
