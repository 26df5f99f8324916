"""A cost table's key: what identifies the hardware, the target and the drafter it was measured on."""

from __future__ import annotations

import hashlib
import json
import platform
import re
import weakref
from pathlib import Path

import torch

from mmvsd.decoding.costs import METHOD_VERSION
from mmvsd.target import Target


def machine_fingerprint(device: torch.device) -> dict[str, str]:
    """What makes timings from one machine meaningless on another: CPU, its flags, threads, torch, GPU."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.MULTILINE).group(1).strip()
        flags = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE).group(1).strip()
    except (OSError, AttributeError):
        pass
    accelerator = device.type
    if device.type == "cuda":
        accelerator = f"cuda:{torch.cuda.get_device_name(device)}"
    return {
        "cpu": model,
        "cpu_flags": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16],
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "device": accelerator,
    }


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> fingerprint


def target_fingerprint(target: Target) -> str:
    """A hash of the target's config and a few weight sums, computed once per loaded model (summing
    the embedding takes a tenth of a second, which every decode call would otherwise pay)."""
    if target.model not in _FINGERPRINTS:
        _FINGERPRINTS[target.model] = _fingerprint(target)
    return _FINGERPRINTS[target.model]


def _fingerprint(target: Target) -> str:
    config = target.model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    params = [p for _, p in target.model.named_parameters()]
    picked = [params[0], params[len(params) // 2], params[-1]] if params else []
    sums = [f"{p.detach().sum(dtype=torch.float64).item():.10e}" for p in picked]
    text = json.dumps(config, sort_keys=True, default=str) + "|" + ",".join(sums) + f"|{len(params)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def drafter_fingerprint(drafter) -> dict[str, str]:
    """The drafter fields costs depend on: architecture, hidden size, draft vocabulary ("none" without).

    `drafter`: None, a neural `Drafter`, or a proposer without weights (n-gram) or wrapping one (hybrid)."""
    if drafter is None:
        return {"drafter": "none"}
    fields = {"drafter": drafter.drafter_type or type(drafter).__name__}
    neural = drafter.neural  # the weights it runs: a drafter's own, a hybrid's neural part, none for n-grams
    if neural is not None:
        fields["drafter_hidden"] = str(getattr(getattr(neural, "config", None), "hidden_size", None))
        fields["draft_vocab"] = str(neural.draft_vocab_size)
        fields["drafter_params"] = str(sum(p.numel() for p in neural.parameters()))
    return fields


def cost_key(target: Target, drafter, batch_sizes: tuple[int, ...], context: int) -> dict[str, str]:
    """Everything a cached table must match to be reused."""
    return {
        "method": METHOD_VERSION,
        **machine_fingerprint(target.device),
        "target": target.name,
        "target_weights": target_fingerprint(target),
        "dtype": str(target.dtype).removeprefix("torch."),
        "engine": target.engine,
        **drafter_fingerprint(drafter),
        "batch_sizes": ",".join(str(b) for b in sorted(set(batch_sizes))),
        "context": str(context),
    }
