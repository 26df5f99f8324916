"""The cost model: interpolation, real measurement on a tiny target, cache keying and corrupt caches."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from conftest import make_tiny_llama, save_tiny_target
from mmvsd.cli import main
from mmvsd.decoding import cost_cache, fingerprints
from mmvsd.decoding.cost_cache import cost_table_path, load_cost_table
from mmvsd.decoding.cost_measure import measure_costs, spot_check
from mmvsd.decoding.costs import CostTable
from mmvsd.decoding.fingerprints import cost_key
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.target import Target


def synthetic_table(key: dict | None = None) -> CostTable:
    return CostTable(
        key=key or {"target": "t", "drafter": "none"},
        target_tokens=(1, 2, 4, 8),
        target_seconds={1: (1.0, 2.0, 3.0, 5.0), 4: (2.0, 3.0, 5.0, 9.0)},
        draft_widths=(1, 4),
        draft_seconds={1: (0.1, 0.4), 4: (0.2, 0.8)},
        draft_fixed_seconds={1: 0.05, 4: 0.09},
        context=256,
    )


def test_interpolation_is_piecewise_linear_and_extrapolates():
    table = synthetic_table()
    assert table.target_step(1) == 1.0 and table.target_step(8) == 5.0
    assert table.target_step(3) == pytest.approx(2.5)
    assert table.target_step(6) == pytest.approx(4.0)
    assert table.target_step(12) == pytest.approx(7.0)  # last slope 0.5 per token
    assert table.target_step(3, batch=4) == pytest.approx(4.0)
    assert table.target_step(3, batch=2) == pytest.approx(2.5 + (4.0 - 2.5) / 3)  # between batches 1 and 4
    assert table.draft_expand(2) == pytest.approx(0.2)
    assert table.draft_expand(10, batch=4) == pytest.approx(0.8 + 0.2 * 6)
    assert table.draft_fixed(4) == 0.09 and table.draft_fixed(2) == pytest.approx(0.05 + 0.04 / 3)


def test_table_without_drafter_costs_nothing_to_draft():
    table = CostTable({"target": "t", "drafter": "none"}, (1, 4), {1: (1.0, 2.0)}, (), {1: ()}, {1: 0.0}, 64)
    assert table.draft_expand(8) == 0.0 and table.draft_fixed() == 0.0
    assert table.target_step(2, batch=3) == pytest.approx(4 / 3)  # one batch size measured: used for all


def test_json_round_trip_and_malformed_tables():
    table = synthetic_table()
    assert CostTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    bad = table.to_json()
    bad["target_seconds"]["1"] = [1.0, 2.0]  # one value short
    with pytest.raises(ValueError):
        CostTable.from_json(bad)
    bad = table.to_json()
    bad["draft_fixed_seconds"]["1"] = float("nan")
    with pytest.raises(ValueError):
        CostTable.from_json(bad)


@pytest.fixture()
def one_thread():
    """Measure on one thread: two OpenMP threads on a crowded 2-core machine mostly time the scheduler."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_measurement_on_a_tiny_target_is_sane(one_thread):
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    # wide enough that 64 verified tokens cost clearly more arithmetic than 1
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    target = Target(LlamaForCausalLM(config).eval(), None, "tiny-wide")
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=4096, seed=1).eval()
    table = measure_costs(target, drafter, batch_sizes=(1, 2), context=48, repeats=9,
                          target_tokens=(1, 4, 64), draft_widths=(1, 16))
    assert table.key["drafter"] == "eagle3" and table.key["batch_sizes"] == "1,2" and table.context == 48
    for batch in (1, 2):
        seconds = table.target_seconds[batch]
        assert all(0 < s < 5 for s in seconds)
        assert seconds[2] > seconds[0]  # 64 tokens cost more than 1
        # (drafter widths are not compared: at this size the difference drowns in a busy machine's noise)
        assert all(0 < s < 5 for s in table.draft_seconds[batch])
        assert 0 < table.draft_fixed(batch) < 5
    assert table.target_step(64, batch=2) > table.target_step(1, batch=1)


def test_measurement_leaves_no_state_behind(tiny_target, random_drafter, one_thread):
    """Measuring twice in a row gives tables of the same key and shape (caches are rewound)."""
    first = measure_costs(tiny_target, random_drafter, context=16, repeats=1, target_tokens=(1, 3), draft_widths=(2,))
    second = measure_costs(tiny_target, random_drafter, context=16, repeats=1, target_tokens=(1, 3),
                           draft_widths=(2,))
    assert first.key == second.key and len(second.target_seconds[1]) == 2 and second.context == 16


class FakeMeasure:
    """Stands in for `measure_costs`: counts calls and returns a table with the right key."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, target, drafter=None, batch_sizes=(1,), context=256, progress=False, **_):
        self.calls += 1
        return CostTable(cost_key(target, drafter, batch_sizes, context), (1, 2),
                         {b: (0.01, 0.015) for b in batch_sizes}, (), {b: () for b in batch_sizes},
                         {b: 0.0 for b in batch_sizes}, context)


class FakeSpotCheck:
    """Stands in for `spot_check`: counts calls and reports the table's steps times `factor`."""

    def __init__(self) -> None:
        self.factor, self.calls = 1.0, 0

    def __call__(self, target, drafter, table, tokens=(1, 16), **_):
        self.calls += 1
        return {n: table.target_step(n, min(table.target_seconds)) * self.factor for n in tokens}


@pytest.fixture()
def fake_measure(monkeypatch, tmp_path) -> FakeMeasure:
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path))
    fake = FakeMeasure()
    monkeypatch.setattr(cost_cache, "measure_costs", fake)
    monkeypatch.setattr(cost_cache, "spot_check", FakeSpotCheck())  # the table's own steps: never drifted
    return fake


def fingerprint_of(cpu: str):
    """`machine_fingerprint` as a machine with this CPU model would give it: every field set here, none read
    from the host, so the test means the same on any machine."""
    return lambda device: {"cpu": cpu, "cpu_flags": "0" * 16, "threads": "2", "torch": "2.0", "device": device.type}


def test_cache_is_reused_only_for_the_same_key(fake_measure, monkeypatch, tiny_target, random_drafter):
    monkeypatch.setattr(fingerprints, "machine_fingerprint", fingerprint_of("test machine A"))
    first = load_cost_table(tiny_target, random_drafter, progress=False)
    assert load_cost_table(tiny_target, random_drafter, progress=False) == first and fake_measure.calls == 1
    path = cost_table_path(first.key)
    assert path.is_file() and path.parent.name == "profiles"
    load_cost_table(tiny_target, None, progress=False)  # another drafter
    load_cost_table(tiny_target, random_drafter, (1, 4), progress=False)  # other batch sizes
    assert fake_measure.calls == 3
    other_weights = Target(make_tiny_llama(seed=5), None, "tiny-llama")  # same name, other weights
    assert cost_key(other_weights, None, (1,), 256)["target_weights"] != first.key["target_weights"]
    load_cost_table(other_weights, random_drafter, progress=False)
    bf16 = Target(make_tiny_llama().to(torch.bfloat16), None, "tiny-llama")  # another dtype
    load_cost_table(bf16, None, progress=False)
    assert fake_measure.calls == 5
    monkeypatch.setattr(fingerprints, "machine_fingerprint", fingerprint_of("test machine B"))
    load_cost_table(tiny_target, random_drafter, progress=False)  # another machine
    assert fake_measure.calls == 6
    monkeypatch.setattr(fingerprints, "machine_fingerprint", fingerprint_of("test machine A"))
    assert load_cost_table(tiny_target, random_drafter, progress=False) == first and fake_measure.calls == 6


def test_refresh_measures_again(fake_measure, tiny_target):
    load_cost_table(tiny_target, progress=False)
    load_cost_table(tiny_target, progress=False, refresh=True)
    assert fake_measure.calls == 2


def test_a_file_from_another_key_under_this_name_is_not_used(fake_measure, tiny_target, caplog):
    table = load_cost_table(tiny_target, progress=False)
    path = cost_table_path(table.key)
    data = json.loads(path.read_text())
    data["key"]["cpu"] = "some other machine"  # e.g. a profile folder copied from elsewhere
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        again = load_cost_table(tiny_target, progress=False)
    assert fake_measure.calls == 2 and again.key == table.key
    assert "another machine" in caplog.text
    assert json.loads(path.read_text())["key"] == table.key  # rewritten for this machine


def test_drift_needs_every_spot_checked_step_off_the_same_way():
    table = synthetic_table()  # batch 1: 1.0 s at 1 token, 3.0 at 4, 5.0 at 8
    assert cost_cache.drift(table, {1: 1.0, 8: 5.0}) is None
    assert cost_cache.drift(table, {1: 1.45, 8: 5.0 / 1.45}) is None  # inside the factor both ways
    assert cost_cache.drift(table, {1: 1.6, 8: 5.0}) is None  # one step off alone: noise
    assert cost_cache.drift(table, {1: 1.6, 8: 3.0}) is None  # off in opposite directions
    assert cost_cache.drift(table, {1: 1.6, 8: 8.0}) == ("a verify step over 1 token takes 1600.0 ms now, 1000.0 ms "
                                                         "when profiled; a verify step over 8 tokens takes 8000.0 ms "
                                                         "now, 5000.0 ms when profiled")
    assert "over 6 tokens takes 1000.0 ms now, 4000.0 ms" in cost_cache.drift(table, {1: 0.6, 6: 1.0})  # faster
    referenced = dataclasses.replace(table, spot_seconds={1: 2.0, 8: 10.0})  # timed as spot checks time them
    assert cost_cache.drift(referenced, {1: 2.0, 8: 10.0}) is None
    assert "2000.0 ms when profiled" in cost_cache.drift(referenced, {1: 1.0, 8: 5.0})


@pytest.mark.parametrize("factor, measured_again", [(1.0, False), (1.3, False), (3.0, True), (0.4, True)])
def test_a_cached_table_is_spot_checked_once_per_process(fake_measure, monkeypatch, tiny_target, caplog,
                                                         factor, measured_again):
    check = FakeSpotCheck()
    monkeypatch.setattr(cost_cache, "spot_check", check)
    table = load_cost_table(tiny_target, progress=False)
    assert check.calls == 1 and table.spot_seconds == pytest.approx({1: 0.01, 16: 0.085})  # its reference, stored
    path = cost_table_path(table.key)
    monkeypatch.setattr(cost_cache, "_CHECKED", set())  # as a later process finds it
    check.factor = factor
    with caplog.at_level(logging.WARNING):
        again = load_cost_table(tiny_target, progress=False)
        load_cost_table(tiny_target, progress=False)
    assert check.calls == 2 + measured_again and fake_measure.calls == 1 + measured_again
    assert ("no longer fits this machine" in caplog.text) == measured_again
    assert again.spot_seconds[1] == pytest.approx(0.01 * (factor if measured_again else 1))  # the reference
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_measured_table_keeps_a_real_spot_check_as_its_reference(fake_measure, tiny_target, monkeypatch):
    monkeypatch.setattr(cost_cache, "spot_check", spot_check)
    table = load_cost_table(tiny_target, progress=False)
    assert list(table.spot_seconds) == [1, 16] and all(0 < s < 5 for s in table.spot_seconds.values())
    assert CostTable.from_json(json.loads(cost_table_path(table.key).read_text())) == table


def test_spot_check_times_real_verify_steps_at_the_tables_context_twice_alike(tiny_target, random_drafter, one_thread):
    table = measure_costs(tiny_target, random_drafter, context=16, repeats=1, target_tokens=(1, 16), draft_widths=(2,))
    for _ in range(2):
        seconds = spot_check(tiny_target, random_drafter, table, repeats=2)
        assert list(seconds) == [1, 16] and all(0 < s < 5 for s in seconds.values())


@pytest.mark.parametrize("content", ["{not json", "", '{"key": {}, "target_tokens": [1]}', "[1, 2]"])
def test_corrupt_cache_is_measured_again_with_a_warning(fake_measure, tiny_target, caplog, content):
    table = load_cost_table(tiny_target, progress=False)
    path = cost_table_path(table.key)
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        again = load_cost_table(tiny_target, progress=False)
    assert again == table and fake_measure.calls == 2
    assert "unreadable" in caplog.text and str(path) in caplog.text
    assert CostTable.from_json(json.loads(path.read_text())) == table
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left


def test_profile_command_prints_table_and_writes_plot(fake_measure, tmp_path, capsys):
    folder = save_tiny_target(tmp_path / "tiny")
    plot = tmp_path / "out" / "costs.png"
    assert main(["profile", "--target", str(folder), "--drafter", "random", "--batch-size", "1",
                 "--batch-size", "2", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "verify step" in out and "B=2 ms" in out and "profile cached in" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fake_measure.calls == 1
    assert main(["profile", "--target", str(folder), "--drafter", "random", "--batch-size", "2",
                 "--batch-size", "1"]) == 0
    assert fake_measure.calls == 1  # same key: cached


@pytest.mark.parametrize("argv, message", [
    (["--target", "no-such-target"], "unknown target"),
    (["--drafter", "/no/such/drafter"], ""),
    (["--plot", "costs.txt"], "--plot must name a .png file"),
])
def test_profile_bad_input_is_one_error_line(fake_measure, tmp_path, capsys, argv, message):
    folder = save_tiny_target(tmp_path / "tiny")
    args = ["profile", "--target", str(folder), *argv] if argv[0] != "--target" else ["profile", *argv]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("mmvsd: error:")]  # (loading bars aside)
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err
    assert fake_measure.calls == 0


def test_profile_rejects_a_zero_batch_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--target", "smollm2-135m", "--batch-size", "0"])
    assert exit_info.value.code == 2
