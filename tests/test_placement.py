"""`--device` / `--dtype`: where and in what precision a target (and with it its drafter) loads."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli, save_tiny_target
from mmvsd.errors import UserError
from mmvsd.placement import placement


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    """What placement sees on a machine with one CUDA GPU (nothing is moved to it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)


def test_auto_is_measured_on_the_cpu_and_bf16_on_a_gpu(no_gpu):
    assert placement() == (None, "cpu")  # the kernel step measures fp32 against bf16 with the exact kernels
    assert placement("cpu", "bf16") == (torch.bfloat16, "cpu")
    assert placement("cpu", "float16") == (torch.float16, "cpu")  # the long names lmms-eval users write


def test_gpu_choices(one_gpu, monkeypatch):
    assert placement() == (torch.bfloat16, "cuda")
    assert placement("cuda:0", "fp32") == (torch.float32, "cuda:0")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert placement("auto", "auto") == (torch.float16, "cuda")
    with pytest.raises(UserError, match="has 1 CUDA GPU"):
        placement("cuda:1")


@pytest.mark.parametrize("device", ["tpu", "cpu:0", "cuda:x", "cuda:"])
def test_bad_devices(no_gpu, device):
    with pytest.raises(UserError, match="use auto, cpu, cuda or cuda:N"):
        placement(device)


def test_gpu_asked_for_where_there_is_none(no_gpu):
    with pytest.raises(UserError, match="sees no CUDA GPU; use cpu"):
        placement("cuda")
    with pytest.raises(UserError, match="dtype 'int8'"):
        placement("cpu", "int8")


def test_generate_loads_target_and_drafter_in_the_asked_precision(no_gpu, tmp_path, capsys, monkeypatch):
    import mmvsd.target_loader as loader
    from mmvsd.decoding import cpu_kernels

    seen = []
    real = loader.load_target

    def spy(spec, dtype=torch.float32, device="cpu"):
        seen.append((dtype, device))
        return real(spec, dtype, device)

    monkeypatch.setattr(loader, "load_target", spy)
    tiny = save_tiny_target(tmp_path / "tiny")
    common = ["generate", "--target", str(tiny), "--prompt", "w1 w2 w3", "--max-new-tokens", "6"]
    # a CPU whose bf16 kernels are not exact
    monkeypatch.setattr(cpu_kernels, "exact_bound_for", lambda target: (1, True))
    code, _, err = run_cli(capsys, *common, "--drafter", "random", "--dtype", "bf16")
    assert code == 0, err
    assert seen == [(torch.bfloat16, "cpu")]
    assert err.count("mmvsd: warning: with a bfloat16 target") == 1 and "--dtype fp32" in err
    # one whose kernels are exact to 8 rows
    monkeypatch.setattr(cpu_kernels, "exact_bound_for", lambda target: (8, False))
    code, _, err = run_cli(capsys, *common, "--drafter", "random", "--dtype", "bf16")
    assert code == 0 and "warning" not in err
    code, _, err = run_cli(capsys, *common, "--drafter", "random")
    assert code == 0 and "warning" not in err and seen[-1] == (None, "cpu")
    code, _, err = run_cli(capsys, *common, "--drafter", "none", "--device", "cuda")
    assert code == 2 and err.count("mmvsd: error:") == 1 and "sees no CUDA GPU" in err
