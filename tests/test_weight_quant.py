"""Weight-only int4 draft models (`model:NAME@int4`): the quantisation against its formula, the kernel
against the dequantised weight, the per-call choice of kernel, the measured row threshold, lossless decoding
with an int4 draft, and the errors a user can cause."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import random_prompts, save_tiny_target
from mmvsd.decoding import weight_quant
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.engine import install_exact_engine, packed_linear
from mmvsd.decoding.tree import TreeShape
from mmvsd.decoding.weight_quant import GROUP, Int4Linear, dequantize_int4, quantize_module
from mmvsd.drafters.draft_model import parse_draft_spec
from mmvsd.drafters.spec import drafter_from_spec
from mmvsd.errors import UserError
from mmvsd.target_loader import load_target

pytestmark = pytest.mark.skipif(not weight_quant.int4_available(), reason="this torch has no CPU int4 kernel")


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


def test_the_int4_kernel_multiplies_by_the_dequantised_weight():
    linear = bf16_linear()
    layer = Int4Linear(linear, linear, int4_rows=4)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(linear.weight).T + linear.bias.float()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05, rtol=0.02)


def test_rows_above_the_threshold_take_the_dense_kernel():
    linear = bf16_linear()
    layer = Int4Linear(linear, linear, int4_rows=2)
    few, many = torch.randn(1, 2, 96, dtype=torch.bfloat16), torch.randn(1, 3, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(many), linear(many))
    assert not torch.equal(layer(few), linear(few)) and layer(few).shape == (1, 2, 48)
    assert layer.weight is linear.weight


def test_the_threshold_is_the_last_row_count_where_int4_measured_faster(monkeypatch):
    layer = Int4Linear(bf16_linear(), bf16_linear())
    timings = {1: (1.0, 3.0), 2: (1.0, 2.0), 4: (2.0, 2.0), 8: (1.0, 5.0)}  # rows: (int4 ms, dense ms)
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
    assert [type(m).__name__ for m in model] == ["Int4Linear", "Int4Linear", "Int4Linear", "Linear", "Linear"]
    assert len(layers) == 3 and all(layer.int4_rows == 4 for layer in layers) and measured == [48, 96]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return {"target": save_tiny_target(root / "target", seed=0), "other": save_tiny_target(root / "other", seed=7)}


def test_an_int4_draft_model_is_lossless_at_t0(folders):
    target = load_target(str(folders["target"]), dtype=torch.bfloat16)
    install_exact_engine(target, rows=1)  # exact on every CPU
    prompts = random_prompts(3, seed=21)
    config = DecodeConfig(max_new_tokens=24, tree=TreeShape(budget=12, depth=4, topk=3))
    expected = [r.output_ids for r in vanilla_generate(target, prompts, config)]
    drafter = drafter_from_spec(f"model:{folders['other']}@int4", target, ngram=False)
    layers = [m for m in drafter.model.model.modules() if isinstance(m, Int4Linear)]
    assert layers and drafter.drafter_type == f"model:{folders['other']}@int4"
    for layer in layers:
        layer.int4_rows = 64  # every draft forward on int4 weights, whatever this CPU measured
    assert [r.output_ids for r in speculative_generate(target, drafter, prompts, config)] == expected


def test_bad_quant_options_are_one_clear_error(folders):
    assert parse_draft_spec("model:a/b") == ("a/b", "none") and parse_draft_spec("model:x@int4") == ("x", "int4")
    with pytest.raises(UserError, match="'int3' is no weight format"):
        parse_draft_spec("model:x@int3")
    fp32 = load_target(str(folders["target"]))
    with pytest.raises(UserError, match="int4 draft weights run on a CPU with a bf16 target"):
        drafter_from_spec(f"model:{folders['other']}@int4", fp32, ngram=False)


def test_packed_linear_keeps_the_weight():
    linear = bf16_linear()
    assert packed_linear(linear).weight is linear.weight
