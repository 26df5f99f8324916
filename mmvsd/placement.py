"""Where and in what precision a target loads: `--device` and `--dtype` of the commands that load one.

Torch is imported only when a placement is resolved, so the command line starts without it.
"""

from __future__ import annotations

import argparse

from mmvsd.errors import UserError

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")


def positive_int(text: str) -> int:
    """argparse type of counts that must be >= 1 (batch sizes, token budgets) in the commands that load a target."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}  # the short names and the long ones lmms-eval users write


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (default: the first CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N")


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    add_device_argument(p)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="precision of the target and the drafter (default auto: bf16 on a GPU, fp16 on one without "
                        "bf16; on the CPU fp32 or bf16 with the exact kernels, measured once per machine)")


def placement(device: str = "auto", dtype: str = "auto"):
    """(torch dtype, device) to load a target with. auto device: the first CUDA GPU when there is one, else the
    CPU. auto dtype: bf16 on a GPU that has it (fp16 on one that does not); None on the CPU, where the mmvsd engine's
    kernel step (`mmvsd.decoding.cpu_kernels.decoding_kernels`) measures fp32 against bf16 with the exact kernels
    (fast on CPUs with AMX or AVX-512-bf16, slow elsewhere)."""
    import torch  # CLI start-up: torch only once a command loads a target

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind, colon, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise UserError(f"device {device!r}: use auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r}: this PyTorch ({torch.__version__}) sees no CUDA GPU; use cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise UserError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if dtype == "auto":
        if kind == "cpu":
            return None, device
        return (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16), device
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype {dtype!r}: use {', '.join(DTYPE_CHOICES)} (or float32, bfloat16, float16)")
    return getattr(torch, DTYPE_NAMES[dtype]), device


def half_precision_warning(target) -> str | None:
    """What a user of speculative decoding should know about a half-precision target: None for fp32 and for
    the exact kernels, whose verify steps give the bits of one-token steps (`mmvsd.decoding.cpu_kernels`)."""
    if target.engine.startswith("exact"):
        return None
    name = str(target.dtype).removeprefix("torch.")
    spacing = {"bfloat16": "0.125", "float16": "0.016"}.get(name)  # between representable values near 20
    if spacing is None:
        return None
    return (f"mmvsd: warning: with a {name} target, speculative output equals vanilla decoding's only up to "
            f"near-ties of the logits (a verify step computes them with other batch shapes, and {name} logits "
            f"near 20 are {spacing} apart); --dtype fp32 for token-for-token equality")
