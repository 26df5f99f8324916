"""Weight-only int4 and int8 linear layers for a draft model on a CPU: a quarter or half of bf16's bytes per step.

A draft model's numbers never reach the output (the target verifies every token), so its weights may be
rounded; what matters is how much a forward costs and how often the target still agrees. A single-token
forward on a CPU reads every weight once and is bound by memory bandwidth, so int4 (int8) weights make each
matrix product up to ~4x (~2x) cheaper, while a forward over many rows is bound by compute, where torch's
weight-only kernels are no faster than oneDNN's packed bf16 one. `QuantizedLinear` keeps both and takes, per
call, the kernel this machine measured faster for that many rows (`measure_rows`).

Formats:
- int4: groups of `GROUP` consecutive input weights per output row share a scale and an offset (asymmetric
  min-max, 16 levels): w ~ q * scale + min, as GGUF's Q4 formats do. Coarse: a model that already ships
  rounded (a GGUF's Q4/Q5/Q6 grid) is rounded a second time onto another grid.
- int8: one scale per output row (symmetric, 255 levels): w ~ q * max|w_row| / 127, fine enough that the
  rounding rarely changes the model's top token. It serves bf16 and fp32 models (a quarter of fp32's bytes).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

GROUP = 32  # int4: input weights per scale
FORMATS = ("int4", "int8")
ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # the row counts measured per weight shape


def format_available(fmt: str) -> bool:
    """Whether this torch has the CPU weight-only matmul of `fmt` (int4: torch >= 2.6)."""
    if fmt == "int4":
        return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
    return hasattr(torch, "_weight_int8pack_mm")


def format_dtypes(fmt: str) -> tuple[torch.dtype, ...]:
    """The weight dtypes `fmt`'s kernel serves (int4: bf16 activations only)."""
    return (torch.bfloat16,) if fmt == "int4" else (torch.bfloat16, torch.float32)


def format_serves(fmt: str, linear: nn.Linear) -> bool:
    """Whether `fmt` can stand for this layer's weight (its dtype; int4: an input width that is a multiple of
    GROUP)."""
    return linear.weight.dtype in format_dtypes(fmt) and (fmt != "int4" or linear.in_features % GROUP == 0)


def _int4_levels(weight: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """(levels 0..15 [N, K / group, group], each group's min and scale [N, K / group]) of a [N, K] weight."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    return torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15), low, scale


def quantize_int4(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """(packed int4 weight, scales and offsets [K / group, N, 2] bf16) of a [N, K] weight, K a multiple of
    `group`: torch's CPU layout, dequantised as (q - 8) * scale + (min + 8 * scale)."""
    levels, low, scale = _int4_levels(weight, group)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32).reshape(weight.shape), 1)
    scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_and_zeros


def dequantize_int4(weight: Tensor, group: int = GROUP) -> Tensor:
    """The [N, K] fp32 weight `quantize_int4` stands for (for tests and error bounds)."""
    levels, low, scale = _int4_levels(weight, group)
    # the kernel reads scale and offset in bf16
    scale, offset = scale.bfloat16().float(), (low + 8 * scale).bfloat16().float()
    return ((levels - 8) * scale[..., None] + offset[..., None]).reshape(weight.shape)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 weight [N, K], scales [N] in the weight's dtype) of a [N, K] weight: row n is q[n] * scales[n]."""
    rows = weight.detach().float()
    scale = (rows.abs().amax(-1) / 127).clamp(min=1e-8).to(weight.dtype)  # the kernel reads it in that dtype
    return torch.round(rows / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale


def dequantize_int8(weight: Tensor) -> Tensor:
    """The [N, K] fp32 weight `quantize_int8` stands for."""
    q, scale = quantize_int8(weight)
    return q.float() * scale.float()[:, None]


class QuantizedLinear(nn.Module):
    """A linear layer (bf16; int8 also fp32) with an int4 or int8 copy of its weight: calls of at most `quant_rows`
    rows use the weight-only kernel, larger ones `dense` (the original layer, e.g. a packed bf16
    RowChunkedLinear). `weight` stays the dense layer's, for code that reads it (a tied embedding)."""

    def __init__(self, linear: nn.Linear, dense: nn.Module, fmt: str = "int4", quant_rows: int = 1) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"weight format {fmt!r}: one of {', '.join(FORMATS)}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dense, self.fmt, self.quant_rows = dense, fmt, quant_rows
        self.bias = linear.bias
        self.packed, self.scales = (quantize_int4 if fmt == "int4" else quantize_int8)(linear.weight)

    @property
    def weight(self) -> Tensor:
        return self.dense.weight

    def quantized(self, flat: Tensor) -> Tensor:
        if self.fmt == "int4":
            out = torch._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), self.packed, GROUP, self.scales)
        else:
            out = torch._weight_int8pack_mm(flat.to(self.scales.dtype), self.packed, self.scales)
        return out if self.bias is None else out + self.bias

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.quant_rows:
            return self.dense(x)
        return self.quantized(flat).view(*x.shape[:-1], self.out_features)


def _median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


@torch.no_grad()
def measure_rows(layer: QuantizedLinear, row_counts: tuple[int, ...] = ROW_COUNTS) -> int:
    """The largest row count up to which the weight-only kernel measured faster than the dense one on this machine
    (0: never): row counts are tried in order and the first slower one ends the search."""
    best = 0
    for rows in row_counts:
        x = torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)
        if _median_ms(lambda: layer.quantized(x)) >= _median_ms(lambda: layer.dense(x)):
            break
        best = rows
    return best


def quantize_module(module: nn.Module, fmt: str = "int4", dense_of=lambda linear: linear) -> list[QuantizedLinear]:
    """Give every linear layer of `module` that `fmt` serves (`format_serves`) a `fmt` copy (`dense_of(linear)` runs
    the calls with more rows) and set each one's row threshold by measuring each weight shape once. Returns the
    new layers (none where the format is unavailable)."""
    if not format_available(fmt):
        return []
    layers, thresholds = [], {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and format_serves(fmt, child):
                layer = QuantizedLinear(child, dense_of(child), fmt)
                shape = (layer.out_features, layer.in_features)
                if shape not in thresholds:
                    thresholds[shape] = measure_rows(layer)
                layer.quant_rows = thresholds[shape]
                setattr(parent, name, layer)
                layers.append(layer)
    return layers
