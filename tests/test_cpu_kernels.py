"""The exact CPU engine: float64 attention, row-chunked linears, the measured bound and the precision choice.

No test depends on this CPU's kernels: where a kernel's row-count dependence matters, a kernel that gives other
bits for other row counts is injected, and the bound 1 (every linear one row at a time) is exact on any CPU."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import PROMPT_POOL, make_tiny_llama, random_prompts
from mmvsd.decoding import cpu_kernels
from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
from mmvsd.decoding.tree import TreeShape
from mmvsd.placement import half_precision_warning
from mmvsd.target import Target

MEASURE_CHOICE = cpu_kernels._measure_choice  # the real one, taken before conftest's session fixture replaces it
PACKING = cpu_kernels._packing_available  # the real probe


def no_fp32_packing(monkeypatch) -> None:
    """A CPU without oneDNN's fp32 kernel: the choice is between stock fp32 and the bf16 engine."""
    monkeypatch.setattr(cpu_kernels, "_packing_available",
                        lambda dtype=torch.bfloat16: dtype != torch.float32 and PACKING(dtype))


def needs_fp32_packing() -> None:
    if not PACKING(torch.float32):
        pytest.skip("this torch has no oneDNN fp32 linear")


def direct_attention(query, key, value, seen):
    """Attention computed the plain way in float64 (GQA heads repeated), rounded to the query's dtype."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(-1, -2) / query.shape[-1] ** 0.5
    scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).to(query.dtype)


@pytest.mark.parametrize("form", ["bool", "additive", "causal"])
def test_exact_attention_is_float64_attention(form):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 5, 16, generator=gen).bfloat16()
    key, value = (torch.randn(2, 3, 12, 16, generator=gen).bfloat16() for _ in range(2))
    seen = torch.rand(2, 1, 5, 12, generator=gen) < 0.7
    seen[..., 0] = True
    if form == "causal":
        seen = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=12 - 5)[None, None].expand(2, 1, 5, 12)
        mask = None
    elif form == "bool":
        mask = seen
    else:
        mask = torch.zeros(seen.shape, dtype=torch.bfloat16).masked_fill(~seen, torch.finfo(torch.bfloat16).min)
    out, weights = cpu_kernels.exact_attention(None, query, key, value, mask)
    assert weights is None and out.dtype == torch.bfloat16 and out.shape == (2, 5, 6, 16)
    assert torch.equal(out, direct_attention(query, key, value, seen))


def test_a_querys_attention_does_not_depend_on_its_company():
    """One query alone over its own keys gives the very bits it gets among other queries, with masked keys
    between and after its own (a tree's block) and a longer cache."""
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 9, 32, generator=gen).bfloat16()
    key, value = (torch.randn(1, 2, 40, 32, generator=gen).bfloat16() for _ in range(2))
    seen = torch.rand(1, 1, 9, 40, generator=gen) < 0.5
    seen[..., 0] = True
    together, _ = cpu_kernels.exact_attention(None, query, key, value, seen)
    for i in range(9):
        own = seen[0, 0, i].nonzero().flatten()  # the keys query i sees, packed in order, no masked ones
        alone, _ = cpu_kernels.exact_attention(None, query[:, :, i : i + 1], key[:, :, own], value[:, :, own], None)
        assert torch.equal(alone[:, 0], together[:, i])


@pytest.mark.parametrize("pack", [False, True])
def test_row_chunked_linear_computes_the_linear_in_chunks(pack, monkeypatch):
    if pack and not cpu_kernels._packing_available():
        pytest.skip("this torch has no oneDNN linear")
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 24).bfloat16()
    chunked = cpu_kernels.RowChunkedLinear(linear, rows=4, pack=pack)
    calls = []
    real = cpu_kernels.RowChunkedLinear._rows
    monkeypatch.setattr(cpu_kernels.RowChunkedLinear, "_rows",
                        lambda self, x: calls.append(x.numel() // 16) or real(self, x))
    x = torch.randn(2, 5, 16).bfloat16()
    out = chunked(x)
    assert out.shape == (2, 5, 24) and calls == [4, 4, 2]
    assert torch.allclose(out.float(), F.linear(x, linear.weight, linear.bias).float(), atol=0.05)
    assert hasattr(chunked, "weight") != pack  # a packed layer keeps no second copy of the weight


def bf16_target(seed: int = 0) -> Target:
    return Target(make_tiny_llama(seed).to(torch.bfloat16), None, "tiny-llama-bf16")


def inject_row_dependent_kernel(monkeypatch, above: int, strength: float = 0.02):
    """Linears whose results change with the number of rows in a call beyond `above`: what a CPU kernel that
    picks another blocking for more rows does, exaggerated. Below that they compute row by row, so they give
    every row the same bits on any CPU."""
    real = cpu_kernels.RowChunkedLinear._rows

    def kernel(self, x):
        flat = x.reshape(-1, self.in_features)
        out = torch.cat([real(self, row[None]) for row in flat]).view(*x.shape[:-1], self.out_features)
        rows = flat.shape[0]
        return out * (1 + strength * (rows - above)) if rows > above else out

    monkeypatch.setattr(cpu_kernels.RowChunkedLinear, "_rows", kernel)


# a lone row goes into the kernel twice (pad_single), so a kernel that changes results beyond 1 row still gives
# blocks of 2 the bits of single rows
@pytest.mark.parametrize("above,expected", [(1, 2), (5, 5), (12, 12), (100, 32)])
def test_the_bound_is_where_the_kernel_stops_giving_the_same_bits(monkeypatch, above, expected):
    inject_row_dependent_kernel(monkeypatch, above)
    target = bf16_target()
    cpu_kernels.install_exact_engine(target, rows=max(cpu_kernels.ROW_CANDIDATES), pack=False)
    assert cpu_kernels.measure_exact_rows(target, context=12) == expected


def test_a_kernel_that_treats_one_row_apart_keeps_the_full_bound(monkeypatch):
    """What Qwen2.5-1.5B's 8960-wide down projection does here: one row takes another kernel, 2..32 rows agree.
    Single rows padded to two give the bound 32; without the padding it would be 1."""
    real = cpu_kernels.RowChunkedLinear._rows

    def kernel(self, x):
        out = real(self, x)
        return out * 1.03 if x.reshape(-1, self.in_features).shape[0] == 1 else out

    monkeypatch.setattr(cpu_kernels.RowChunkedLinear, "_rows", kernel)
    target = bf16_target()
    cpu_kernels.install_exact_engine(target, rows=max(cpu_kernels.ROW_CANDIDATES), pack=False)
    assert cpu_kernels.measure_exact_rows(target, context=12) == 32
    for module in target.model.modules():
        if isinstance(module, cpu_kernels.RowChunkedLinear):
            module.pad_single = False
    assert cpu_kernels.measure_exact_rows(target, context=12) == 1
    assert cpu_kernels._bound_of(bf16_target(), pack=False) == (32, True)  # so the bound is measured padded there


def test_lone_rows_go_in_alone_where_the_kernel_gives_them_the_same_bits(monkeypatch):
    """A one-token step computes one row, not two, where the bound holds unpadded (measured so for oneDNN's fp32
    kernel on an AVX2 EPYC); a kernel that changes results beyond 5 rows is bounded at 5 either way. Rows are
    computed one by one (the injected kernel), so no CPU's own kernels decide the outcome."""
    inject_row_dependent_kernel(monkeypatch, above=100)
    target = bf16_target()
    assert cpu_kernels._bound_of(target, pack=False) == (32, False)
    assert target.engine == f"exact{cpu_kernels.ENGINE_VERSION}-rows32-unpadded"
    assert not any(m.pad_single for m in target.model.modules() if isinstance(m, cpu_kernels.RowChunkedLinear))
    inject_row_dependent_kernel(monkeypatch, above=5)
    assert cpu_kernels._bound_of(bf16_target(), pack=False) == (5, False)


def test_the_measured_bound_makes_bf16_decoding_equal_vanilla(monkeypatch, fitted_drafter):
    """With a kernel that changes results beyond 2 rows, speculative decoding with unchunked linears differs from
    vanilla; chunked at the measured bound it equals vanilla token for token (batch 1 and 3)."""
    inject_row_dependent_kernel(monkeypatch, above=2, strength=0.05)
    target = bf16_target()
    drafter = copy.deepcopy(fitted_drafter).to(torch.bfloat16)
    cpu_kernels.install_exact_engine(target, rows=64, pack=False)
    prompts = PROMPT_POOL[:1] + random_prompts(3, seed=11)
    config = DecodeConfig(max_new_tokens=32, tree=TreeShape(budget=16, depth=4, topk=4))

    def outputs(generate, *args):
        return [r.output_ids for r in generate(target, *args, prompts, config)]

    unchunked_differs = outputs(speculative_generate, drafter) != outputs(vanilla_generate)
    bound = cpu_kernels.measure_exact_rows(target, context=12)
    assert bound == 2
    cpu_kernels.install_exact_engine(target, rows=bound)
    spec = speculative_generate(target, drafter, prompts, config)
    assert [r.output_ids for r in spec] == outputs(vanilla_generate)
    batched = speculative_generate(target, drafter, prompts[1:], config)
    assert [r.output_ids for r in batched] == outputs(vanilla_generate)[1:]
    assert unchunked_differs and max(max(r.accept_lengths) for r in spec) >= 3
    assert target.engine == f"exact{cpu_kernels.ENGINE_VERSION}-rows2" and half_precision_warning(target) is None


def test_the_engine_is_for_half_precision_cpu_targets(tiny_target):
    with pytest.raises(ValueError, match="half-precision CPU targets, or fp32 ones on oneDNN's packed kernel"):
        cpu_kernels.install_exact_engine(tiny_target, rows=4)
    assert cpu_kernels.use_exact_engine(tiny_target) is False and tiny_target.engine == "stock"


def test_fp32_on_the_packed_kernel_decodes_as_vanilla_does(fitted_drafter):
    """The fp32 engine (oneDNN's packed kernel, float64 attention): speculative decoding equals vanilla on it token
    for token, and its logits stay the stock fp32 logits up to rounding. Rows 1 (each row alone) is exact on any
    CPU; the bound this CPU allows is what `--dtype auto` measures."""
    needs_fp32_packing()
    stock = Target(make_tiny_llama(0), None, "tiny-llama-fp32")
    target = Target(copy.deepcopy(stock.model), None, "tiny-llama-fp32")
    cpu_kernels.install_exact_engine(target, rows=1, pack=True)
    assert target.engine == f"exact{cpu_kernels.ENGINE_VERSION}-rows1-packed"
    prompts = PROMPT_POOL[:1] + random_prompts(2, seed=11)
    config = DecodeConfig(max_new_tokens=24, tree=TreeShape(budget=16, depth=4, topk=4))
    spec = speculative_generate(target, fitted_drafter, prompts, config)
    assert [r.output_ids for r in spec] == [r.output_ids for r in vanilla_generate(target, prompts, config)]
    assert max(max(r.accept_lengths) for r in spec) >= 3
    ids = torch.tensor([PROMPT_POOL[0]])
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, stock.model(ids).logits, atol=1e-4, rtol=1e-4)


def test_use_exact_engine_where_the_cpu_allows_it(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "measure_exact_rows", lambda target: 1)
    stock = bf16_target(seed=1)
    assert cpu_kernels.use_exact_engine(stock) is False and stock.engine == "stock"
    assert "near-ties" in half_precision_warning(stock)
    monkeypatch.setattr(cpu_kernels, "measure_exact_rows", lambda target: pytest.fail("measured twice"))
    assert cpu_kernels.use_exact_engine(bf16_target(seed=1)) is False  # the cached bound of this machine and target
    monkeypatch.setattr(cpu_kernels, "measure_exact_rows", lambda target: 16)
    exact = bf16_target(seed=2)
    version = cpu_kernels.ENGINE_VERSION
    assert cpu_kernels.use_exact_engine(exact) is True and exact.engine.startswith(f"exact{version}-rows16")


@pytest.mark.parametrize("rows,fp32_exact_ms,bf16_ms,chosen", [
    (32, None, (9.0, 11.0), ("bfloat16", "exact")),  # exact, as fast at one token, faster at 16
    (32, None, (10.5, 11.0), ("float32", "stock")),  # slower at one token: vanilla would lose
    (32, None, (9.0, 21.0), ("float32", "stock")),  # no faster at 16
    (2, None, (5.0, 6.0), ("float32", "stock")),  # exact only to 2 rows
    (32, (10.0, 15.0), (10.5, 11.0), ("float32", "exact")),  # the fp32 engine: as fast at one token, faster at 16
    (32, (10.0, 15.0), (9.0, 11.0), ("bfloat16", "exact")),  # bf16 beats the fp32 engine too
    (32, (10.0, 15.0), (9.0, 16.0), ("float32", "exact")),  # bf16 beats stock fp32, not the fp32 engine, at 16
    (32, (10.5, 15.0), (11.0, 21.0), ("float32", "stock")),  # neither engine is fast enough at one token
])
def test_auto_precision_on_the_cpu_is_chosen_by_measurement(monkeypatch, injected, rows, fp32_exact_ms, bf16_ms,
                                                            chosen):
    if fp32_exact_ms is not None:  # a CPU with oneDNN's fp32 kernel (the fixture takes it away)
        needs_fp32_packing()
        monkeypatch.setattr(cpu_kernels, "_packing_available", PACKING)
    injected.ms.update({"fp32": (10.0, 20.0), "fp32-exact": fp32_exact_ms, "bf16": bf16_ms})
    monkeypatch.setattr(cpu_kernels, "measure_exact_rows", lambda target: rows)
    fp32 = Target(make_tiny_llama(seed=3), None, "tiny-auto")
    chosen_target = cpu_kernels.choose_cpu_engine(fp32, progress=False)
    assert (str(chosen_target.dtype).removeprefix("torch."), "stock" if chosen_target.engine == "stock" else "exact"
            ) == chosen
    if chosen[1] == "exact":
        version = cpu_kernels.ENGINE_VERSION
        assert chosen_target is not fp32 and chosen_target.engine.startswith(f"exact{version}-rows{rows}")
        assert fp32.dtype == torch.float32 and fp32.engine == "stock"  # the fp32 model is left as it was
    else:
        assert chosen_target is fp32 and fp32.engine == "stock"
    monkeypatch.setattr(cpu_kernels, "_verify_ms", lambda target: pytest.fail("measured twice"))
    again = cpu_kernels.choose_cpu_engine(fp32, progress=False)  # cached per machine and target
    assert again.dtype == chosen_target.dtype and again.engine == chosen_target.engine


def test_a_drafter_is_packed_for_speed_and_keeps_its_weights(random_drafter):
    fp32 = copy.deepcopy(random_drafter)
    assert cpu_kernels.pack_for_cpu(fp32) is False  # fp32: nothing to pack
    if not cpu_kernels._packing_available():
        pytest.skip("this torch has no oneDNN linear")
    drafter = copy.deepcopy(random_drafter).to(torch.bfloat16)
    linears = {name: m.weight for name, m in drafter.named_modules() if isinstance(m, torch.nn.Linear)}
    x = torch.randn(3, drafter.fc.in_features).bfloat16()
    before = drafter.fc(x)
    assert cpu_kernels.pack_for_cpu(drafter) is True
    packed = {name: m for name, m in drafter.named_modules() if isinstance(m, cpu_kernels.RowChunkedLinear)}
    assert set(packed) == set(linears) and all(packed[n].weight is linears[n] for n in linears)
    assert torch.allclose(drafter.fc(x).float(), before.float(), atol=0.05)


def test_an_fp32_drafter_is_packed_beside_an_fp32_engine(random_drafter):
    needs_fp32_packing()
    drafter = copy.deepcopy(random_drafter)
    x = torch.randn(3, drafter.fc.in_features)
    before = drafter.fc(x)
    assert cpu_kernels.pack_for_cpu(drafter, fp32=True) is True
    assert isinstance(drafter.fc, cpu_kernels.RowChunkedLinear) and drafter.fc.packed is not None
    torch.testing.assert_close(drafter.fc(x), before, atol=1e-5, rtol=1e-5)


def candidate(target: Target) -> str:
    """Which of the choice's candidates `target` is: stock fp32, fp32 on the engine, or bf16 on it."""
    if target.dtype == torch.bfloat16:
        return "bf16"
    return "fp32" if target.engine == "stock" else "fp32-exact"


class InjectedSteps:
    """Stands in for `cpu_kernels._verify_ms`: the (1-token, 16-token) milliseconds of each candidate now, counting the
    timings taken per candidate."""

    def __init__(self, fp32_ms: tuple[float, float], bf16_ms: tuple[float, float],
                 fp32_exact_ms: tuple[float, float] | None = None) -> None:
        self.ms = {"fp32": fp32_ms, "bf16": bf16_ms, "fp32-exact": fp32_exact_ms}
        self.calls = {"fp32": 0, "bf16": 0, "fp32-exact": 0}

    def __call__(self, target: Target, repeats: int = 7) -> tuple[float, float]:
        self.calls[candidate(target)] += 1
        return self.ms[candidate(target)]


@pytest.fixture()
def injected(monkeypatch, tmp_path) -> InjectedSteps:
    """Choices measured from injected timings (exact bound 32) into a cache of this test's own; no fp32 engine
    unless a test asks for one."""
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path))
    no_fp32_packing(monkeypatch)
    steps = InjectedSteps((10.0, 20.0), (9.0, 11.0))
    monkeypatch.setattr(cpu_kernels, "_verify_ms", steps)
    monkeypatch.setattr(cpu_kernels, "measure_exact_rows", lambda target: 32)
    monkeypatch.setattr(cpu_kernels, "_measure_choice", MEASURE_CHOICE)  # conftest's stand-in keeps tests on fp32
    return steps


def test_stock_is_timed_before_and_after_the_engines_and_its_faster_timings_decide(monkeypatch, injected):
    """A machine slower while stock fp32 is timed first (a warming host, a neighbour's burst) must not hand the
    choice to an engine that is slower than stock at its best: stock is timed again last, its faster steps kept."""
    stock = iter([(12.0, 24.0), (10.0, 20.0)])
    real = injected.__call__
    monkeypatch.setattr(cpu_kernels, "_verify_ms", lambda target, repeats=7: next(stock) if candidate(target) == "fp32"
                        else real(target, repeats))
    injected.ms["bf16"] = (11.0, 15.0)  # no slower than the first stock timing, slower than the second
    fp32 = Target(make_tiny_llama(seed=3), None, "tiny-auto")
    assert cpu_kernels.choose_cpu_engine(fp32, progress=False) is fp32
    assert cpu_kernels._cached_choice(cpu_kernels._key(fp32, "cpu_engine")).fp32_ms == (10.0, 20.0)


def as_a_later_process(monkeypatch, hours: float = cpu_kernels.REMEASURE_HOURS + 1) -> None:
    """What a later process finds `hours` later: the cached choice, not yet spot-checked in this process."""
    monkeypatch.setattr(cpu_kernels.cost_cache, "_CHECKED", set())
    clock = cpu_kernels._now() + hours * 3600
    monkeypatch.setattr(cpu_kernels, "_now", lambda: clock)


def test_a_drifted_choice_is_kept_when_measured_recently_so_a_busy_machine_does_not_stall(monkeypatch, injected,
                                                                                          caplog):
    fp32 = Target(make_tiny_llama(seed=14), None, "tiny-busy")
    assert cpu_kernels.choose_cpu_engine(fp32, progress=False).dtype == torch.bfloat16
    injected.ms.update({"fp32": (30.0, 60.0), "bf16": (27.0, 33.0)})  # everything 3x slower: another job runs
    as_a_later_process(monkeypatch, hours=1.0)
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.choose_cpu_engine(fp32, progress=False).dtype == torch.bfloat16
    assert "kept, as it was measured 1.0 h ago" in caplog.text
    assert injected.calls == {"fp32": 2 + 1, "bf16": 1 + 1, "fp32-exact": 0}  # the spot check only
    as_a_later_process(monkeypatch)  # a day later the same drift is measured again
    cpu_kernels.choose_cpu_engine(fp32, progress=False)
    assert injected.calls == {"fp32": 3 + 3, "bf16": 2 + 2, "fp32-exact": 0}


@pytest.mark.parametrize("fp32_now, bf16_now, measured_again", [
    ((10.0, 20.0), (9.0, 11.0), False),  # as when chosen
    ((13.0, 26.0), (11.7, 14.3), False),  # 1.3x slower everywhere: inside the factor
    ((30.0, 20.0), (9.0, 11.0), False),  # one timing off alone: noise
    ((30.0, 6.0), (9.0, 11.0), False),  # off in opposite directions
    ((30.0, 60.0), (9.0, 11.0), True),  # fp32 3x slower at both sizes
    ((10.0, 20.0), (3.0, 4.0), True),  # bf16 faster at both sizes
])
def test_a_cached_choice_is_spot_checked_once_per_process_by_the_profiles_rule(monkeypatch, injected, caplog, fp32_now,
                                                                                bf16_now, measured_again):
    fp32 = Target(make_tiny_llama(seed=11), None, "tiny-spot")
    assert cpu_kernels.choose_cpu_engine(fp32, progress=False).dtype == torch.bfloat16  # measured: 9/11 beats 10/20
    assert injected.calls == {"fp32": 2, "bf16": 1, "fp32-exact": 0}  # stock timed before and after bf16
    as_a_later_process(monkeypatch)
    injected.ms.update({"fp32": fp32_now, "bf16": bf16_now})
    with caplog.at_level(logging.WARNING):
        cpu_kernels.choose_cpu_engine(fp32, progress=False)
        cpu_kernels.choose_cpu_engine(fp32, progress=False)  # checked already in this process
    timed = 2 if measured_again else 1  # the spot check, then the new measurement (stock twice in it)
    assert injected.calls == {"fp32": 2 + 2 * timed - 1, "bf16": 1 + timed, "fp32-exact": 0}
    assert ("no longer fits this machine" in caplog.text) == measured_again
    written = json.loads(cpu_kernels.engine_path(cpu_kernels._key(fp32, "cpu_engine")).read_text())
    assert tuple(written["fp32_ms"]) == (fp32_now if measured_again else (10.0, 20.0))  # the new reference


def test_a_drifted_choice_is_measured_again_and_may_flip_either_way(monkeypatch, injected):
    fp32 = Target(make_tiny_llama(seed=12), None, "tiny-flip")
    assert cpu_kernels.choose_cpu_engine(fp32, progress=False).dtype == torch.bfloat16
    as_a_later_process(monkeypatch)
    injected.ms["bf16"] = (30.0, 40.0)  # this host's bf16 is now 3x slower: fp32 wins
    assert cpu_kernels.choose_cpu_engine(fp32, progress=False) is fp32
    as_a_later_process(monkeypatch)
    injected.ms["fp32"] = (100.0, 200.0)  # and later fp32 10x slower (bf16 unchanged): bf16 wins again
    chosen = cpu_kernels.choose_cpu_engine(fp32, progress=False)
    assert chosen.dtype == torch.bfloat16 and chosen.engine.startswith(f"exact{cpu_kernels.ENGINE_VERSION}-rows32")
    # measured (stock twice), checked + measured, checked + measured
    assert injected.calls == {"fp32": 8, "bf16": 5, "fp32-exact": 0}


def test_a_choice_without_exact_bf16_spot_checks_fp32_alone(monkeypatch, injected):
    monkeypatch.setattr(cpu_kernels, "measure_exact_rows", lambda target: 2)  # bf16 not exact here: no bf16 timings
    fp32 = Target(make_tiny_llama(seed=13), None, "tiny-fp32")
    assert cpu_kernels.choose_cpu_engine(fp32, progress=False) is fp32
    as_a_later_process(monkeypatch)
    assert cpu_kernels.choose_cpu_engine(fp32, progress=False) is fp32
    assert injected.calls == {"fp32": 2, "bf16": 0, "fp32-exact": 0}
