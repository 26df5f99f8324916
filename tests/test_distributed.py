"""Data-parallel training for real: `accelerate launch` starts 2 CPU processes (gloo) that must train the drafter one
process trains with the doubled batch, resume bit-exactly, resume with another number of processes, and stop
together on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import save_tiny_target, write_sharegpt
from mmvsd.cli import main
from mmvsd.errors import UserError
from mmvsd.training import sources, trainer
from mmvsd.training.distributed import BatchSplit, GlobalMean, batch_mean, rank_seed

SETTINGS = ["draft_vocab_size=64", "loss.ttt_steps=3", "loss.num_samples=4", "loss.num_anchors=2",
            "loss.path_length=3", "progress=false", "validation_fraction=0", "max_steps=4", "save_every=2",
            "learning_rate=0.01"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(tmp_path: Path, num_processes: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """`accelerate launch` of `python -m mmvsd train` with `num_processes` CPU processes: (command, environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MMVSD_CACHE=str(tmp_path / "cache"))
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes",
               str(num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "mmvsd", "train", *args]
    return command, env


def launch(tmp_path: Path, num_processes: int, *args: str) -> subprocess.CompletedProcess:
    command, env = launch_command(tmp_path, num_processes, *args)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def state(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"step-{step:07d}" / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny target and data, and two 2-process runs: ce with grad_accum=2, vsd-kl (E-step draws per process)."""
    root = tmp_path_factory.mktemp("ddp")
    target, data = save_tiny_target(root / "target"), write_sharegpt(root / "data.json", num=12)
    common = ["--target", str(target), "--data", str(data), *SETTINGS]
    for name, objective in (("ce", ["--objective", "ce", "grad_accum=2"]), ("vsd", ["--objective", "vsd-kl"])):
        done = launch(root, 2, *common, *objective, "batch_size=2", "--output", str(root / name))
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("drafter written to") == 1  # said once, not once per process
    return root, common


def test_two_processes_train_as_one_with_the_doubled_batch(runs, capsys):
    root, common = runs
    assert main(["train", *common, "--objective", "ce", "grad_accum=2", "batch_size=4", "--output",
                 str(root / "one")]) == 0
    two, one = weights(root / "ce"), weights(root / "one")
    assert two.keys() == one.keys()
    for key in two:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-5, msg=key)
    assert state(root / "ce", 4)["num_processes"] == 2 and state(root / "one", 4)["num_processes"] == 1
    assert state(root / "ce", 4)["tokens_seen"] == state(root / "one", 4)["tokens_seen"]  # summed over processes
    assert not torch.equal(two["fc.weight"], weights(root / "vsd")["fc.weight"])


def test_a_resumed_two_process_run_equals_the_uninterrupted_one(runs, tmp_path):
    root, common = runs
    cut = tmp_path / "cut"
    shutil.copytree(root / "vsd" / "checkpoints" / "step-0000002", cut / "checkpoints" / "step-0000002")
    done = launch(tmp_path, 2, *common, "--objective", "vsd-kl", "batch_size=2", "--output", str(cut), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    full, resumed = weights(root / "vsd"), weights(cut)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


def test_resuming_with_another_number_of_processes_keeps_the_global_batch(runs, tmp_path, capsys):
    root, common = runs
    cut = tmp_path / "cut"
    shutil.copytree(root / "ce" / "checkpoints" / "step-0000002", cut / "checkpoints" / "step-0000002")
    ce = [*common, "--objective", "ce", "grad_accum=2", "--output", str(cut), "--resume"]
    assert main(["train", *ce, "batch_size=2"]) == 2  # 1 x 2 is not the checkpoint's global batch of 2 x 2
    err = capsys.readouterr().err
    assert "global batch of 4 (2 process(es) x 2)" in err and "global_batch_size=4" in err
    assert not (cut / "model.safetensors").exists()
    assert main(["train", *ce, "global_batch_size=4"]) == 0
    two, one = weights(root / "ce"), weights(cut)
    for key in two:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-5, msg=key)


def test_sigterm_to_the_launcher_stops_both_processes_at_one_step_with_a_checkpoint(runs, tmp_path, capsys):
    """What a scheduler's preemption does (`kill` of the launcher; torch's agent passes SIGTERM on to its workers):
    both processes stop after the same step, save it and the drafter, and the drafter is that step's training."""
    root, common = runs
    out = tmp_path / "stopped"
    settings = [*common, "--objective", "ce", "max_steps=100000", "save_every=100000"]
    command, env = launch_command(tmp_path, 2, *settings, "batch_size=2", "--output", str(out))
    log = out / "train_log.jsonl"
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=tmp_path) as launcher:
        deadline = time.monotonic() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 3) and launcher.poll() is None:
            assert time.monotonic() < deadline, "the run logged no steps in 300 s"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=300)
    assert "SIGTERM: stopping after this step" in stderr, stderr[-3000:]
    assert stdout.count("drafter written to") == 1, stderr[-3000:]
    step = json.loads(log.read_text().splitlines()[-1])["step"]
    assert 3 <= step < 100000, step
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{step:07d}"]
    assert state(out, step)["num_processes"] == 2
    one = tmp_path / "one"  # one process with the doubled batch, told to stop at the same step
    assert main(["train", *settings, "batch_size=4", f"stop_at_step={step}", "--output", str(one)]) == 0
    stopped, direct = weights(out), weights(one)
    for key in direct:
        torch.testing.assert_close(stopped[key], direct[key], rtol=1e-5, atol=1e-5, msg=key)
    assert main(["train", *settings, "global_batch_size=4", f"stop_at_step={step + 1}", "--output", str(out),
                 "--resume"]) == 0
    assert state(out, step + 1)["step"] == step + 1


def test_batch_split_rows_and_bad_splits():
    split = BatchSplit.of(3, 0, num_processes=2, rank=1)
    assert (split.global_size, split.per_process) == (6, 3) and split.rows(list(range(6))) == [3, 4, 5]
    assert BatchSplit.of(1, 8, num_processes=4, rank=3).rows(list(range(8))) == [6, 7]
    with pytest.raises(UserError, match="does not split evenly across 4 processes"):
        BatchSplit.of(1, 6, num_processes=4, rank=0)
    with pytest.raises(UserError, match="fewer than one example each"):
        BatchSplit.of(1, 2, num_processes=4, rank=0)
    with pytest.raises(UserError, match="exceeds the 5 training examples"):
        BatchSplit.of(3, 0, num_processes=2, rank=0).check_fits(5)
    assert rank_seed(7, 5, 0) == 7 * 1_000_003 + 5 and rank_seed(7, 5, 1) != rank_seed(7, 6, 0)


class SummingAccelerator:
    """Stands for 2 processes whose other process holds `others` items."""

    num_processes = 2

    def __init__(self, others: float) -> None:
        self.others = others

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        return tensor + self.others


def test_global_mean_makes_the_averaged_gradient_the_global_batch_mean():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0], requires_grad=True)  # rank 0 holds 2 items, rank 1 holds 3
    grads = []
    for mine, others in ((values[:2], 3.0), (values[2:], 2.0)):
        loss = GlobalMean(SummingAccelerator(others))(mine.pow(2).sum(), torch.tensor(len(mine)))
        grads.append(torch.autograd.grad(loss, values)[0])
    averaged = (grads[0] + grads[1]) / 2  # what data parallelism applies
    direct = torch.autograd.grad(batch_mean(values.pow(2).sum(), torch.tensor(5)), values)[0]
    torch.testing.assert_close(averaged, direct)


def test_every_micro_batch_is_full_and_each_epoch_covers_every_example():
    batches = [sources.batch_indices(10, 4, seed=1, micro_step=step) for step in range(6)]
    assert all(len(batch) == 4 for batch in batches)
    first_epoch = [i for batch in batches[:3] for i in batch]
    assert set(first_epoch) == set(range(10)) and len(first_epoch) == 12  # the last batch filled up with 2


def test_too_large_a_global_batch_is_one_clear_error(runs, tmp_path, capsys):
    root, common = runs
    code = main(["train", *common, "batch_size=13", "--output", str(tmp_path / "out")])
    assert code == 2 and "exceeds the 12 training examples" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["train", *common, "batch_size=2", "global_batch_size=4", "--output", str(tmp_path / "o")]) == 2
    assert "not both" in capsys.readouterr().err


def test_the_zero2_config_resolves_and_receives_our_batch_settings():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    from mmvsd.training.config import TrainConfig
    from mmvsd.training.plan import DEEPSPEED_JSON, ZERO2

    launch_config = load_config_from_file(str(ZERO2))
    assert launch_config.distributed_type == DistributedType.DEEPSPEED and launch_config.mixed_precision == "bf16"
    assert Path(launch_config.deepspeed_config["deepspeed_config_file"]).name == DEEPSPEED_JSON.name
    plugin = DeepSpeedPlugin(hf_ds_config=str(DEEPSPEED_JSON))
    assert plugin.zero_stage == 2
    config = TrainConfig(global_batch_size=24, max_grad_norm=0.25)
    trainer.fill_deepspeed_config(plugin.deepspeed_config, config, BatchSplit.of(1, 24, num_processes=8, rank=0))
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 3
    assert plugin.deepspeed_config["train_batch_size"] == 24
    assert plugin.deepspeed_config["gradient_clipping"] == 0.25
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    with pytest.raises(UserError, match="grad_accum=1"):
        trainer.fill_deepspeed_config({}, TrainConfig(grad_accum=2), BatchSplit.of(1, 0, num_processes=1, rank=0))


def test_checkpoints_keep_the_drafter_names(runs):
    root, _ = runs
    saved = load_file(str(root / "ce" / "checkpoints" / "step-0000004" / "model.safetensors"))
    assert set(saved) == set(weights(root / "ce"))  # as a drafter folder names them, no wrapper prefix
