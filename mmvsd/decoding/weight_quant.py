"""Weight-only int4 linear layers for a draft model on a CPU: a quarter of bf16's bytes per step.

A draft model's numbers never reach the output (the target verifies every token), so its weights may be
rounded; what matters is how much a forward costs and how often the target still agrees. A single-token
forward on a CPU reads every weight once and is bound by memory bandwidth, so int4 weights make it up to
~4x cheaper, while a forward over many rows is bound by compute, where torch's int4 kernel is no faster than
oneDNN's packed bf16 one. `Int4Linear` keeps both and takes, per call, the kernel this machine measured
faster for that many rows (`measure_rows`).

Quantisation: groups of `GROUP` consecutive input weights per output row share a scale and an offset
(asymmetric min-max, 16 levels): w ~ q * scale + min, as GGUF's Q4 formats do.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

GROUP = 32
ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # the row counts measured per weight shape


def int4_available() -> bool:
    """Whether this torch has the CPU int4 weight-only matmul (torch >= 2.6)."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def quantize_int4(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """(packed int4 weight, scales and offsets [K / group, N, 2] bf16) of a [N, K] weight, K a multiple of
    `group`: torch's CPU layout, dequantised as (q - 8) * scale + (min + 8 * scale)."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels.reshape(out_features, in_features), 1)
    scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_and_zeros


def dequantize_int4(weight: Tensor, group: int = GROUP) -> Tensor:
    """The [N, K] fp32 weight `quantize_int4` stands for (for tests and error bounds)."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    # the kernel reads scale and offset in bf16
    scale, offset = scale.bfloat16().float(), (low + 8 * scale).bfloat16().float()
    return ((levels - 8) * scale[..., None] + offset[..., None]).reshape(out_features, in_features)


class Int4Linear(nn.Module):
    """A bf16 linear layer with an int4 copy of its weight: calls of at most `int4_rows` rows use the int4
    kernel, larger ones `dense` (the original layer, e.g. a packed bf16 RowChunkedLinear). `weight` stays the
    dense layer's, for code that reads it (a tied embedding)."""

    def __init__(self, linear: nn.Linear, dense: nn.Module, int4_rows: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dense, self.int4_rows = dense, int4_rows
        self.bias = linear.bias
        self.packed, self.scales_and_zeros = quantize_int4(linear.weight)

    @property
    def weight(self) -> Tensor:
        return self.dense.weight

    def int4(self, flat: Tensor) -> Tensor:
        out = torch._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), self.packed, GROUP, self.scales_and_zeros)
        return out if self.bias is None else out + self.bias

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.int4_rows:
            return self.dense(x)
        return self.int4(flat).view(*x.shape[:-1], self.out_features)


def _median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


@torch.no_grad()
def measure_rows(layer: Int4Linear, row_counts: tuple[int, ...] = ROW_COUNTS) -> int:
    """The largest row count up to which the int4 kernel measured faster than the dense one on this machine
    (0: never): row counts are tried in order and the first slower one ends the search."""
    best = 0
    for rows in row_counts:
        x = torch.randn(rows, layer.in_features, dtype=torch.bfloat16)
        if _median_ms(lambda: layer.int4(x)) >= _median_ms(lambda: layer.dense(x)):
            break
        best = rows
    return best


def quantize_module(module: nn.Module, dense_of=lambda linear: linear) -> list[Int4Linear]:
    """Give every bf16 linear layer of `module` whose input width is a multiple of GROUP an int4 copy
    (`dense_of(linear)` runs the calls with more rows) and set each one's row threshold by measuring each
    weight shape once. Returns the new layers (none where int4 is unavailable or the module is not bf16)."""
    if not int4_available():
        return []
    layers, thresholds = [], {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16 and child.in_features % GROUP == 0:
                layer = Int4Linear(child, dense_of(child))
                shape = (layer.out_features, layer.in_features)
                if shape not in thresholds:
                    thresholds[shape] = measure_rows(layer)
                layer.int4_rows = thresholds[shape]
                setattr(parent, name, layer)
                layers.append(layer)
    return layers
