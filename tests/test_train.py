"""`mmvsd train` / `mmvsd prepare` end to end on a tiny saved target, resume identity, bad input."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import TINY, save_tiny_target, write_sharegpt
from mmvsd.cli import main
from mmvsd.errors import UserError
from mmvsd.training import sources, trainer
from mmvsd.training.config import TrainConfig, load_train_config
from mmvsd.training.dataset import draft_vocab_from_counts


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("train")
    return save_tiny_target(root / "target"), write_sharegpt(root / "data.json")


def train_cli(capsys, target: Path, data: Path, out: Path, *extra: str) -> tuple[int, str]:
    code = main(["train", "--target", str(target), "--data", str(data), "--output", str(out), *TINY, *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("objective", ["ce", "vsd", "vsd-kl", "ce+vsd", "accept", "ce+accept", "vsd-rloo",
                                       "ce+vsd-rloo"])
def test_two_step_train_then_generate(setup, tmp_path, capsys, objective):
    target, data = setup
    code, err = train_cli(capsys, target, data, tmp_path / "out", "--objective", objective, "max_steps=2")
    assert code == 0, err
    out = tmp_path / "out"
    assert {"config.json", "model.safetensors", "train_config.yaml"} <= {p.name for p in out.iterdir()}
    assert (out / "checkpoints" / "step-0000002" / "trainer_state.json").is_file()
    assert list((out / "logs").rglob("events.out.tfevents*"))
    code = main(["generate", "--target", str(target), "--drafter", str(out), "--prompt", "w5 w6",
                 "--max-new-tokens", "8"])
    assert code == 0


def test_training_reads_each_dataset_file_once(setup, tmp_path, capsys, monkeypatch):
    from mmvsd.data import conversations

    target, data = setup
    opened = []
    real = conversations.iter_records
    monkeypatch.setattr(conversations, "iter_records", lambda path, stats: opened.append(path) or real(path, stats))
    code, err = train_cli(capsys, target, data, tmp_path / "out", "max_steps=1")
    assert code == 0, err
    assert opened == [data]  # the check before the target loads read it; the examples reuse what it read


def test_draft_vocab_comes_from_assistant_token_frequencies(setup, tmp_path, capsys):
    target, data = setup
    assert train_cli(capsys, target, data, tmp_path / "out", "max_steps=1")[0] == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["draft_vocab_size"] == 64
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    draft_ids = torch.arange(64) + weights["d2t"]
    # the data only uses w4..w119 in assistant turns: w0..w3 (ids 4..7) are never counted
    assert weights["t2d"].sum() == 64 and not weights["t2d"][4:8].any()
    assert (draft_ids.diff() > 0).all()
    counts = torch.tensor([5, 0, 7, 7, 1, 0])
    assert draft_vocab_from_counts(counts, 4).tolist() == [2, 3, 0, 4]  # by count, ties by lower id


def test_resume_ends_with_the_same_weights(setup, tmp_path, capsys, monkeypatch):
    target, data = setup
    common = ["--objective", "vsd-kl", "max_steps=4", "save_every=2", "learning_rate=0.01"]
    assert train_cli(capsys, target, data, tmp_path / "full", *common)[0] == 0
    real_step = trainer._optimizer_step

    def interrupted(run, state):
        if state.step == 3:
            raise KeyboardInterrupt
        return real_step(run, state)

    monkeypatch.setattr(trainer, "_optimizer_step", interrupted)
    assert train_cli(capsys, target, data, tmp_path / "cut", *common)[0] == 130
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    assert trainer.latest_checkpoint(tmp_path / "cut").name == "step-0000002"
    monkeypatch.setattr(trainer, "_optimizer_step", real_step)
    code, err = train_cli(capsys, target, data, tmp_path / "cut", *common)
    assert code == 2 and "--resume" in err  # never silently restarts over an earlier run
    code, err = train_cli(capsys, target, data, tmp_path / "cut", *common[:-1], "learning_rate=0.02", "--resume")
    assert code == 2 and "settings differ (learning_rate: 0.01 -> 0.02)" in err
    # a time budget is this process's own: a resumed run may get another one (max_minutes); so are the target's
    # kernels (target_engine: a run begun before its default became stock resumes on either)
    assert train_cli(capsys, target, data, tmp_path / "cut", *common, "max_minutes=30", "target_engine=exact",
                     "--resume")[0] == 0
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    # the per-step log: one line per step, the resumed run's equal to the whole one's but for the step's duration
    logs = [[json.loads(line) for line in (tmp_path / run / trainer.TRAIN_LOG).read_text().splitlines()]
            for run in ("full", "cut")]
    assert [line["step"] for line in logs[0]] == [1, 2, 3, 4] == [line["step"] for line in logs[1]]
    assert all(line["seconds"] > 0 and line["tokens_seen"] > 0 and "loss" in line for line in logs[1]), logs[1]
    assert [{**line, "seconds": 0} for line in logs[0]] == [{**line, "seconds": 0} for line in logs[1]]


def test_sigterm_or_a_first_ctrl_c_stops_with_a_checkpoint_and_the_drafter(setup, tmp_path, capsys, monkeypatch,
                                                                         caplog):
    """A stop asked for mid-step ends the run after that step as max_minutes would (checkpoint, drafter, exit 0),
    so --resume loses nothing; a second Ctrl-C interrupts at once."""
    target, data = setup
    common = ["max_steps=4", "save_every=10", "learning_rate=0.01"]
    assert train_cli(capsys, target, data, tmp_path / "full", *common)[0] == 0
    real_step = trainer._optimizer_step
    signals = {"cut": [signal.SIGTERM], "ctrl-c": [signal.SIGINT], "twice": [signal.SIGINT, signal.SIGINT]}
    for name, sent in signals.items():
        def asked(run, state, sent=sent):
            if state.step == 1:
                for sig in sent:
                    os.kill(os.getpid(), sig)
            return real_step(run, state)

        monkeypatch.setattr(trainer, "_optimizer_step", asked)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mmvsd.training"):
            code, err = train_cli(capsys, target, data, tmp_path / name, *common)
        if name == "twice":
            assert code == 130 and not (tmp_path / name / "model.safetensors").exists()
            continue
        assert code == 0 and "stopping after this step" in caplog.text, err
        assert trainer.latest_checkpoint(tmp_path / name).name == "step-0000002"
        assert (tmp_path / name / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are the run's only
    monkeypatch.setattr(trainer, "_optimizer_step", real_step)
    assert train_cli(capsys, target, data, tmp_path / "cut", *common, "--resume")[0] == 0
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert all(torch.equal(full[key], resumed[key]) for key in full)


def test_interrupted_checkpoint_write_keeps_the_previous_one(setup, tmp_path, capsys, monkeypatch):
    target, data = setup
    assert train_cli(capsys, target, data, tmp_path / "out", "max_steps=2", "save_every=1")[0] == 0
    half_written = tmp_path / "out" / "checkpoints" / ".step-0000003.tmp"
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"partial")
    assert trainer.latest_checkpoint(tmp_path / "out").name == "step-0000002"
    assert len(list((tmp_path / "out" / "checkpoints").glob("step-*"))) == 2  # keep_checkpoints


def test_non_finite_losses_are_skipped_then_stop_the_run(setup, tmp_path, capsys, monkeypatch):
    target, data = setup
    from mmvsd.training import terms

    real = terms.make_objective
    calls = {"n": 0}

    def sometimes_nan(name, config):
        objective = real(name, config)

        def wrapped(drafter, target, batch, generator, mean):
            loss, metrics = objective(drafter, target, batch, generator, mean)
            calls["n"] += 1
            return (loss * float("nan") if calls["n"] >= 3 else loss), metrics

        return wrapped

    monkeypatch.setattr(trainer, "make_objective", sometimes_nan)
    code, err = train_cli(capsys, target, data, tmp_path / "out", "max_steps=10", "save_every=2", "max_bad_steps=3")
    assert code == 2 and "non-finite loss" in err and "max_bad_steps=3" in err
    latest = trainer.latest_checkpoint(tmp_path / "out")  # skipped steps count as steps: 3 and 4 were skipped
    assert latest.name == "step-0000004"
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["num_bad_steps"] == 2 and state["tokens_seen"] > 0
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_offline_feature_cache_trains_like_online(setup, tmp_path, capsys):
    target, data = setup
    cache = tmp_path / "cache"
    assert main(["prepare", "--target", str(target), "--data", str(data), "--output", str(cache), "--yes", *TINY]) == 0
    assert "will write" in capsys.readouterr().out
    common = ["--objective", "ce+vsd", "max_steps=2", "learning_rate=0.01"]
    assert train_cli(capsys, target, data, tmp_path / "online", *common)[0] == 0
    assert train_cli(capsys, target, data, tmp_path / "offline", *common, "features=offline",
                     f"feature_cache={cache}")[0] == 0
    online = load_file(str(tmp_path / "online" / "model.safetensors"))
    offline = load_file(str(tmp_path / "offline" / "model.safetensors"))
    for key in online:
        torch.testing.assert_close(online[key], offline[key], atol=1e-4, rtol=1e-3)
    code, err = train_cli(capsys, target, data, tmp_path / "other", "max_steps=1", "max_length=10",
                          "features=offline", f"feature_cache={cache}")
    assert code == 2 and "max_length" in err


def bad_cases(target: Path, data: Path, tmp: Path, drafter_for_other: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp / "empty.json"
    empty.write_text("")
    corrupt = tmp / "corrupt.json"
    corrupt.write_text('[{"conversations": [{"from": "human", "value": "w1"}, ')
    no_answer = tmp / "no_answer.json"
    no_answer.write_text(json.dumps([{"conversations": [{"from": "human", "value": "w5 w6"}]}]))
    base = ["--target", str(target), "--output", str(tmp / "bad-out"), *TINY]
    return {
        "missing data": (["--data", str(tmp / "nope.json"), *base], "nope.json"),
        "empty data": (["--data", str(empty), *base], "empty.json"),
        "corrupt data": (["--data", str(corrupt), *base], "corrupt.json"),
        "no assistant turn": (["--data", str(no_answer), *base], "without an assistant turn"),
        "all too long": (["--data", str(data), *base, "max_length=2"], "max_length=2"),
        "init for another target": (["--data", str(data), *base, "--init", str(drafter_for_other)], "does not fit"),
        "unknown key": (["--data", str(data), *base, "learning_rat=1"], "unknown config key 'learning_rat'"),
        "wrong type": (["--data", str(data), *base, "batch_size=two"], "batch_size"),
        "bad objective": (["--data", str(data), *base, "--objective", "kl"], "objective"),
        "missing config": (["--data", str(data), *base, "--config", str(tmp / "none.yaml")], "none.yaml"),
    }


def test_bad_input_is_one_clear_error(setup, tmp_path, capsys):
    target, data = setup
    other = save_tiny_target(tmp_path / "other-target", vocab=96)
    other_out = tmp_path / "other-drafter"
    assert main(["train", "--target", str(other), "--data", str(data), "--output", str(other_out), *TINY,
                 "max_steps=1"]) == 0
    capsys.readouterr()
    for name, (argv, message) in bad_cases(target, data, tmp_path, other_out).items():
        code = main(["train", *argv])
        err = capsys.readouterr().err
        assert code == 2, name
        last = err.strip().splitlines()[-1]  # (after the target's own loading bar, if it got that far)
        assert last.startswith("mmvsd: error:") and message in last, (name, err)
        assert "Traceback" not in err
        assert not (tmp_path / "bad-out" / "model.safetensors").exists(), name


def test_config_resolution_order(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("target: a\noutput: o\nlearning_rate: 0.5\nloss:\n  num_samples: 9\n  use_car: false\n")
    config = load_train_config(str(yaml_file), {"target": "b", "objective": None},
                               ["loss.num_samples=3", "epochs=2", "learning_rate=1e-4"])
    assert (config.target, config.learning_rate, config.epochs) == ("b", 1e-4, 2.0)
    assert (config.loss.num_samples, config.loss.use_car, config.loss.path_length) == (3, False, 7)
    shipped = load_train_config("smollm2_cpu", {"output": "o"}, [])
    assert shipped.target == "smollm2-135m" and shipped.draft_vocab_size == 8192
    # a run's length given last wins: `epochs` on the command line replaces the file's `max_steps`
    assert (shipped.max_steps, shipped.epochs) == (400, 1.0)
    assert load_train_config("smollm2_cpu", {"output": "o"}, ["epochs=6"]).max_steps == 0
    both = load_train_config("smollm2_cpu", {"output": "o"}, ["epochs=6", "max_steps=50"])
    assert (both.max_steps, both.epochs) == (50, 6.0)
    assert load_train_config("smollm2_cpu", {"output": "o"}, ["learning_rate=1e-3"]).max_steps == 400
    yaml_file.write_text("target: a\noutput: o\nepochs: 3\n")
    assert load_train_config(str(yaml_file), {}, ["max_steps=7"]).max_steps == 7
    # VSD's paths are as deep as the tree the drafter is evaluated with, unless the path length is given
    assert load_train_config(None, {"target": "a", "output": "o"}, ["eval_tree=60/5/8"]).loss.path_length == 5
    assert load_train_config(str(yaml_file), {}, ["eval_tree=60/5/8", "loss.path_length=3"]).loss.path_length == 3
    yaml_file.write_text("target: a\noutput: o\neval_tree: 30/4/6\nloss:\n  path_length: 6\n")
    assert load_train_config(str(yaml_file), {}, []).loss.path_length == 6
    assert load_train_config(str(yaml_file), {}, ["loss.num_samples=2"]).loss.path_length == 6
    # YAML 1.1 reads on/off as booleans: a text setting takes them back as the words
    assert load_train_config(None, {"target": "a", "output": "o"}, ["media_curriculum=off"]).media_curriculum == "off"
    assert load_train_config(None, {"target": "a", "output": "o"}, ["media_curriculum=on"]).media_curriculum == "on"


def test_learning_rate_schedule_warmup_then_cosine_to_floor():
    config = TrainConfig(warmup_ratio=0.1, min_lr_ratio=0.01)
    factor = trainer.lr_lambda(config, 100)
    assert factor(0) == 0 and factor(5) == pytest.approx(0.5) and factor(10) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.01 + 0.99 * 0.5) and factor(100) == pytest.approx(0.01)
    linear = trainer.lr_lambda(TrainConfig(warmup_ratio=0.1, schedule="linear"), 100)
    assert linear(55) == pytest.approx(0.5) and linear(100) == pytest.approx(0.0)
    # a continuation's warm-up in optimizer steps (60 steps: warmup_ratio 0.02 would give one)
    steps = trainer.lr_lambda(TrainConfig(warmup_steps=10, schedule="linear"), 60)
    assert steps(0) == 0 and steps(5) == pytest.approx(0.5) and steps(10) == 1.0 and steps(35) == pytest.approx(0.5)
    with pytest.raises(UserError, match="warmup_steps"):
        TrainConfig(target="a", output="o", warmup_steps=-1).validate()


def test_batches_cover_every_example_once_per_epoch():
    seen = [i for step in range(5) for i in sources.batch_indices(10, 2, seed=3, micro_step=step)]
    assert sorted(seen) == list(range(10))
    second_epoch = [i for step in range(5, 10) for i in sources.batch_indices(10, 2, seed=3, micro_step=step)]
    assert sorted(second_epoch) == list(range(10)) and second_epoch != seen  # reshuffled each epoch


def test_bf16_and_on_policy_regeneration(setup, tmp_path, capsys, monkeypatch):
    target, data = setup
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    code, err = train_cli(capsys, target, data, tmp_path / "out", "max_steps=1", "precision=bf16",
                          "regenerate=greedy", "regenerate_max_new_tokens=6", "num_conversations=3")
    assert code == 0, err
    [cache] = (tmp_path / "cache" / "regenerated").glob("*.jsonl")  # shared by runs with the same settings
    cached = [json.loads(line) for line in cache.read_text().splitlines()]
    assert len(cached) == 3  # validation_fraction=0: every conversation is a training one
    original = {r["id"]: r for r in json.loads(data.read_text())}
    for record in cached:
        answers = [t["text"] for t in record["turns"] if t["role"] == "assistant"]
        assert answers and answers[0] != original[record["conv_id"]]["conversations"][1]["value"]


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parents[1] / "mmvsd" / "configs").glob("*.yaml")
                                        if p.stem != "accelerate_zero2"))
def test_every_shipped_training_config_resolves(name):
    """The configs in mmvsd/configs/ (by name, as `--config NAME` finds them) hold only known keys and valid values
    (given what their comments say to pass: an output folder, and a target where they name none)."""
    config = load_train_config(name, {"output": "OUT"}, [] if "target:" in _shipped_config(name) else ["target=T"])
    assert config.objective


def _shipped_config(name: str) -> str:
    return (Path(__file__).parents[1] / "mmvsd" / "configs" / f"{name}.yaml").read_text()


def test_target_loads_on_the_training_device(setup, tmp_path, capsys, monkeypatch):
    """The target loads where the drafter trains: loaded on the CPU and moved, a bf16 target kept the CPU's
    packed-weight engine and broke on a GPU (seen on an H200, benchmarks/gpu_fullsize_llava.py)."""
    target, data = setup
    devices, accelerators = [], []
    real_load, real_accelerator = trainer.load_target, trainer._accelerator
    monkeypatch.setattr(trainer, "load_target", lambda spec, dtype, device: devices.append(device)
                        or real_load(spec, dtype=dtype, device=device))
    monkeypatch.setattr(trainer, "_accelerator", lambda *args: accelerators.append(real_accelerator(*args))
                        or accelerators[-1])
    code, err = train_cli(capsys, target, data, tmp_path / "out", "max_steps=1", "target_dtype=bf16")
    assert code == 0, err
    assert devices == [str(accelerators[0][0].device)]


@pytest.mark.parametrize("engine", ["exact", "stock"])
def test_target_engine_chooses_decoding_s_exact_kernels_or_torch_s(setup, tmp_path, capsys, monkeypatch, engine):
    """`target_engine=stock` (the default) trains on torch's own kernels; `exact` takes decoding's kernel step,
    which a CPU without exact bf16 rows declines (so only the request is checked there)."""
    target, data = setup
    loaded, kernels = [], []
    real_load, real_kernels = trainer.load_target, trainer.decoding_kernels
    monkeypatch.setattr(trainer, "load_target", lambda *args, **kwargs: loaded.append(real_load(*args, **kwargs))
                        or loaded[-1])
    monkeypatch.setattr(trainer, "decoding_kernels", lambda target: kernels.append(target) or real_kernels(target))
    extra = [] if engine == "stock" else ["target_engine=exact"]
    code, err = train_cli(capsys, target, data, tmp_path / "out", "max_steps=1", "target_dtype=bf16", *extra)
    assert code == 0, err
    [loaded_target] = loaded
    assert kernels == ([loaded_target] if engine == "exact" else [])
    if engine == "stock":
        assert loaded_target.engine == "stock"
    code, err = train_cli(capsys, target, data, tmp_path / "bad", "max_steps=1", "target_engine=fast")
    assert code == 2 and "target_engine='fast' is not one of exact, stock" in err


def test_a_target_with_the_cpu_engine_is_refused_on_a_gpu(setup, tmp_path, monkeypatch):
    """A bf16 target loaded on the CPU carries the exact kernels, whose packed weights cannot run on a GPU:
    training it there is one clear error, not a kernel's traceback."""
    from types import SimpleNamespace

    from mmvsd.target_loader import load_target

    target_dir, data = setup
    target = load_target(str(target_dir), dtype=torch.bfloat16)
    target.engine = "exact2-test"  # as `use_exact_engine` marks it (whether this CPU installs it varies)
    real = trainer._accelerator

    def on_a_gpu(*args):
        accelerator, split = real(*args)
        return SimpleNamespace(device=torch.device("cuda", 0), state=accelerator.state), split

    monkeypatch.setattr(trainer, "_accelerator", on_a_gpu)
    config = load_train_config(None, {"target": str(target_dir), "data": str(data), "output": str(tmp_path / "o")},
                               [*TINY, "max_steps=1"])
    with pytest.raises(UserError, match="carries the CPU's exact kernels"):
        trainer.train(config, target=target)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine would have")
def test_prepare_on_a_missing_gpu_is_one_message(setup, tmp_path, capsys):
    """`mmvsd prepare --device` places the target as generate's --device does: a GPU that is not there is a
    clear error before anything is written."""
    target, data = setup
    cache = tmp_path / "cache"
    code = main(["prepare", "--target", str(target), "--data", str(data), "--output", str(cache), "--yes",
                 "--device", "cuda", *TINY])
    assert code == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
    assert not cache.exists()


def test_a_checkpoint_from_before_a_setting_existed_reads_it_as_its_default(tmp_path):
    """A checkpoint written before a setting was added (here: a loss key) resumes; one whose settings differ
    does not."""
    config = TrainConfig()
    old = config.to_dict()
    del old["loss"]["rloo_weight"], old["loss"]["rloo_score"]
    old["loss"]["a_removed_setting"] = old["a_removed_setting"] = 1  # what this version no longer has: not compared
    (tmp_path / "train_config.yaml").write_text(yaml.safe_dump(old))
    trainer.check_resume_config(tmp_path, config)
    old["loss"]["num_samples"] += 1
    (tmp_path / "train_config.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(UserError, match=r"settings differ \(loss.num_samples: 41 -> 40\)"):
        trainer.check_resume_config(tmp_path, config)


def test_the_progress_bar_shows_what_the_objective_computes():
    shown = trainer._postfix({"loss": 1.0, "acc_0": 0.5, "accept": 1.25, "rloo_score": 2.5, "ce": 3.0})
    assert shown == {"loss": "1.000", "acc": "0.500", "accept": "1.250", "rloo": "2.500"}
