"""Weight-only int4 and int8 draft models (`model:NAME@int4`, `@int8`): each quantisation against its formula,
the kernels against the dequantised weights, the per-call choice of kernel, the measured row threshold,
lossless decoding with a quantised draft, and the errors a user can cause."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import random_prompts, save_tiny_target
from mmvsd.decoding import weight_quant
from mmvsd.decoding.cpu_kernels import install_exact_engine, packed_linear
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape
from mmvsd.decoding.weight_quant import GROUP, QuantizedLinear, dequantize_int4, dequantize_int8, quantize_module
from mmvsd.drafters.draft_model import parse_draft_spec
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.target_loader import load_target

pytestmark = pytest.mark.skipif(not all(map(weight_quant.format_available, weight_quant.FORMATS)),
                                reason="this torch lacks a CPU weight-only kernel")


def bf16_linear(out_features: int = 48, in_features: int = 96, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=True).to(torch.bfloat16)


def test_the_dequantised_weight_is_within_half_a_level_of_the_original():
    linear = bf16_linear()
    weight = linear.weight.detach().float()
    groups = weight.reshape(48, 96 // GROUP, GROUP)
    level = (groups.amax(-1) - groups.amin(-1)) / 15  # 16 levels from each group's min to its max
    error = (dequantize_int4(linear.weight) - weight).reshape(48, 96 // GROUP, GROUP).abs()
    assert (error <= level[..., None] / 2 + 0.02 * level[..., None] + 1e-3).all()  # + bf16 scale rounding
    assert error.max() > 0  # it is a rounding, not a copy


def test_int8_serves_fp32_layers_and_int4_only_bf16_ones():
    fp32 = nn.Linear(96, 48)
    assert weight_quant.format_serves("int8", fp32) and not weight_quant.format_serves("int4", fp32)
    layer = QuantizedLinear(fp32, fp32, "int8", quant_rows=4)
    x = torch.randn(2, 96)
    expected = x @ dequantize_int8(fp32.weight).T + fp32.bias
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_the_int8_weight_is_within_half_a_level_of_the_original():
    linear = bf16_linear()
    weight = linear.weight.detach().float()
    level = weight.abs().amax(-1, keepdim=True) / 127  # one symmetric scale per output row
    error = (dequantize_int8(linear.weight) - weight).abs()
    assert (error <= level / 2 + 0.01 * level + 1e-6).all()  # + bf16 scale rounding
    assert error.max() > 0 and error.max() < (dequantize_int4(linear.weight) - weight).abs().max()


@pytest.mark.parametrize("fmt, dequantize", [("int4", dequantize_int4), ("int8", dequantize_int8)])
def test_the_weight_only_kernel_multiplies_by_the_dequantised_weight(fmt, dequantize):
    linear = bf16_linear()
    layer = QuantizedLinear(linear, linear, fmt, quant_rows=4)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    expected = x.float() @ dequantize(linear.weight).T + linear.bias.float()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05, rtol=0.02)


def test_rows_above_the_threshold_take_the_dense_kernel():
    linear = bf16_linear()
    layer = QuantizedLinear(linear, linear, quant_rows=2)
    few, many = torch.randn(1, 2, 96, dtype=torch.bfloat16), torch.randn(1, 3, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(many), linear(many))
    assert not torch.equal(layer(few), linear(few)) and layer(few).shape == (1, 2, 48)
    assert layer.weight is linear.weight


def test_the_threshold_is_the_last_row_count_where_int4_measured_faster(monkeypatch):
    layer = QuantizedLinear(bf16_linear(), bf16_linear())
    timings = {1: (1.0, 3.0), 2: (1.0, 2.0), 4: (2.0, 2.0), 8: (1.0, 5.0)}  # rows: (quantised ms, dense ms)
    calls = iter([t for rows in (1, 2, 4, 8) for t in timings[rows]])
    monkeypatch.setattr(weight_quant, "_median_ms", lambda fn: next(calls))
    assert weight_quant.measure_rows(layer, row_counts=(1, 2, 4, 8)) == 2  # 4 ties: the search ends there
    calls = iter([3.0, 1.0])
    monkeypatch.setattr(weight_quant, "_median_ms", lambda fn: next(calls))
    assert weight_quant.measure_rows(layer, row_counts=(1, 2)) == 0


def test_quantize_module_replaces_the_bf16_linears_and_measures_each_shape_once(monkeypatch):
    measured = []
    monkeypatch.setattr(weight_quant, "measure_rows", lambda layer: measured.append(layer.out_features) or 4)
    model = nn.Sequential(bf16_linear(48, 96), bf16_linear(48, 96, seed=1), bf16_linear(96, 64), nn.Linear(96, 8),
                          bf16_linear(8, 40))  # fp32, and a width that is no multiple of the group: kept
    layers = quantize_module(model)
    assert [type(m).__name__ for m in model] == ["QuantizedLinear"] * 3 + ["Linear", "Linear"]
    assert len(layers) == 3 and all(layer.quant_rows == 4 for layer in layers) and measured == [48, 96]
    model = nn.Sequential(bf16_linear(48, 96), nn.Linear(96, 8), bf16_linear(8, 40))
    assert len(quantize_module(model, "int8")) == 3  # int8 has no groups (any width) and serves fp32 too
    assert [m.fmt for m in model] == ["int8"] * 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return {"target": save_tiny_target(root / "target", seed=0), "other": save_tiny_target(root / "other", seed=7)}


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_quantised_draft_model_is_lossless_at_t0(folders, fmt):
    target = load_target(str(folders["target"]), dtype=torch.bfloat16)
    install_exact_engine(target, rows=1)  # exact on every CPU
    prompts = random_prompts(3, seed=21)
    config = DecodeConfig(max_new_tokens=24, tree=TreeShape(budget=12, depth=4, topk=3))
    expected = [r.output_ids for r in vanilla_generate(target, prompts, config)]
    drafter = drafter_from_spec(f"model:{folders['other']}@{fmt}", target, ngram=False)
    layers = [m for m in drafter.model.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.fmt == fmt for m in layers) and drafter.drafter_type == f"model:{folders['other']}@{fmt}"
    for layer in layers:
        layer.quant_rows = 64  # every draft forward on quantised weights, whatever this CPU measured
    assert [r.output_ids for r in speculative_generate(target, drafter, prompts, config)] == expected


def test_bad_quant_options_are_one_clear_error(folders):
    assert parse_draft_spec("model:a/b") == ("a/b", "none") and parse_draft_spec("model:x@int4") == ("x", "int4")
    assert parse_draft_spec("model:x@int8") == ("x", "int8")
    with pytest.raises(UserError, match="'int3' is no weight format"):
        parse_draft_spec("model:x@int3")
    fp32 = load_target(str(folders["target"]))
    with pytest.raises(UserError, match="int4 draft weights run on a CPU with a bfloat16 target"):
        drafter_from_spec(f"model:{folders['other']}@int4", fp32, ngram=False)
    fp16 = load_target(str(folders["target"]), dtype=torch.float16)
    with pytest.raises(UserError, match="int8 draft weights run on a CPU with a bfloat16 or float32 target"):
        drafter_from_spec(f"model:{folders['other']}@int8", fp16, ngram=False)


def test_an_int8_draft_model_next_to_an_fp32_target_is_lossless(folders):
    target = load_target(str(folders["target"]))  # fp32: int8 weights are a quarter of its bytes
    prompts = random_prompts(3, seed=22)
    config = DecodeConfig(max_new_tokens=24, tree=TreeShape(budget=12, depth=4, topk=3))
    expected = [r.output_ids for r in vanilla_generate(target, prompts, config)]
    drafter = drafter_from_spec(f"model:{folders['other']}@int8", target, ngram=False)
    layers = [m for m in drafter.model.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.scales.dtype == torch.float32 and not isinstance(m.dense, QuantizedLinear) for m in layers)
    for layer in layers:
        layer.quant_rows = 64
    assert [r.output_ids for r in speculative_generate(target, drafter, prompts, config)] == expected


def test_a_builtin_default_draft_model_drops_a_format_its_target_cannot_run(folders, monkeypatch):
    from mmvsd.target_loader import BUILTIN_TARGETS, BuiltinTarget

    monkeypatch.setitem(BUILTIN_TARGETS, "tiny-int8", BuiltinTarget(
        "tiny-int8", assemble=lambda: folders["target"], default_drafter=f"model:{folders['other']}@int8"))
    bf16 = load_target("tiny-int8", dtype=torch.bfloat16)
    assert drafter_from_spec("default", bf16, ngram=False).drafter_type == f"model:{folders['other']}@int8"
    fp16 = load_target("tiny-int8", dtype=torch.float16)  # int8's kernel serves bf16 and fp32 only
    assert drafter_from_spec("default", fp16, ngram=False).drafter_type == f"model:{folders['other']}"
    with pytest.raises(UserError, match="int8 draft weights run on a CPU"):  # asked for by name: an error
        drafter_from_spec(f"model:{folders['other']}@int8", fp16, ngram=False)


def test_bench_without_a_drafter_runs_the_targets_default_draft_model(folders, monkeypatch):
    """As `mmvsd generate` does: a built-in target's default draft model, not an untrained head."""
    from mmvsd.eval.bench import tree_methods
    from mmvsd.eval.bench_config import BenchConfig
    from mmvsd.target_loader import BUILTIN_TARGETS, BuiltinTarget

    monkeypatch.setitem(BUILTIN_TARGETS, "tiny-int8", BuiltinTarget(
        "tiny-int8", assemble=lambda: folders["target"], default_drafter=f"model:{folders['other']}@int8"))
    target = load_target("tiny-int8")
    (method,) = tree_methods(BenchConfig(suite="humaneval", target="tiny-int8"), target)
    assert method.name == "tree:default"
    assert method.generate.drafter.neural.drafter_type == f"model:{folders['other']}@int8"


def test_packed_linear_keeps_the_weight():
    linear = bf16_linear()
    assert packed_linear(linear).weight is linear.weight
