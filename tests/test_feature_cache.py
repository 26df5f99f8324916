"""The offline feature cache: same features as online capture, resumable, validated on read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import TINY_VOCAB
from mmvsd.data.render import RenderedExample
from mmvsd.errors import UserError
from mmvsd.target import Target
from mmvsd.training import feature_cache
from mmvsd.training.feature_cache import (
    FeatureCache,
    check_cache_matches,
    plan_feature_cache,
    write_feature_cache,
)
from mmvsd.training.features import capture_features, collate

SETTINGS = {"target": "tiny-llama", "data": "random:8", "max_length": 24, "seed": 0}


def random_examples(num: int, seed: int = 0) -> list[RenderedExample]:
    """Examples of varying lengths with random ids and a loss mask with at least one 1."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(num):
        length = int(torch.randint(2, 25, (1,), generator=gen))
        ids = torch.randint(0, TINY_VOCAB, (length,), generator=gen).tolist()
        mask = (torch.rand(length, generator=gen) < 0.5).long().tolist()
        mask[-1] = 1
        examples.append(RenderedExample(input_ids=ids, loss_mask=mask))
    return examples


@pytest.fixture(scope="module")
def examples() -> list[RenderedExample]:
    return random_examples(8)


def write(target: Target, examples, out_dir, **kwargs):
    kwargs.setdefault("shard_size", 3)
    kwargs.setdefault("settings", SETTINGS)
    return write_feature_cache(target, examples, out_dir, progress=False, **kwargs)


def per_example_capture(target: Target, examples, indices):
    """Online features of each example captured alone (no padding partners), right-padded by hand."""
    captured = [capture_features(target, collate([examples[i]])) for i in indices]
    tokens = collate([examples[i] for i in indices])
    batch, width = tokens.input_ids.shape
    features = torch.zeros(batch, width, captured[0].features.shape[-1])  # [B, T, F]
    target_hidden = torch.zeros(batch, width, captured[0].target_hidden.shape[-1])  # [B, T, H]
    for row, one in enumerate(captured):
        features[row, : one.features.shape[1]] = one.features[0]
        target_hidden[row, : one.target_hidden.shape[1]] = one.target_hidden[0]
    return tokens, features, target_hidden


def assert_tokens_equal(got, want) -> None:
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.loss_mask, want.loss_mask)
    assert torch.equal(got.lengths, want.lengths)


INDEX_LISTS = ([0], [7, 0, 3, 5, 2], list(range(8)))  # shards of 3: 0-2, 3-5, 6-7


def test_cache_equals_online_capture_exactly_across_shards(tiny_target, examples, tmp_path):
    cache = FeatureCache(write(tiny_target, examples, tmp_path / "cache", batch_size=1))
    assert len(cache) == 8 and cache.settings == SETTINGS
    assert sorted(p.name for p in (tmp_path / "cache").glob("shard-*")) == [
        "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"
    ]
    for indices in INDEX_LISTS:
        tokens, features, target_hidden = per_example_capture(tiny_target, examples, indices)
        cached = cache.batch(indices, dtype=torch.float32)
        assert_tokens_equal(cached.tokens, tokens)
        assert torch.equal(cached.features, features)  # [B, T, F], zeros on padding
        assert torch.equal(cached.target_hidden, target_hidden)  # [B, T, H]


def test_cache_matches_batched_online_capture(tiny_target, examples, tmp_path):
    """Batched capture with other padding partners: equal up to float reassociation (~1e-6 relative)."""
    cache = FeatureCache(write(tiny_target, examples, tmp_path / "cache", batch_size=4))
    for indices in INDEX_LISTS:
        online = capture_features(tiny_target, collate([examples[i] for i in indices]))
        cached = cache.batch(indices)
        assert_tokens_equal(cached.tokens, online.tokens)
        valid = online.tokens.valid  # [B, T]
        assert cached.features.shape == online.features.shape
        torch.testing.assert_close(cached.features[valid], online.features[valid], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(cached.target_hidden[valid], online.target_hidden[valid], rtol=1e-5, atol=1e-4)
        assert not cached.features[~valid].any() and not cached.target_hidden[~valid].any()


def test_resume_rewrites_only_missing_and_corrupt_shards(tiny_target, examples, tmp_path, monkeypatch):
    out_dir = write(tiny_target, examples, tmp_path / "cache")
    first = FeatureCache(out_dir).batch(list(range(8)))
    first = (first.tokens.input_ids.clone(), first.features.clone(), first.target_hidden.clone())
    shards = sorted(out_dir.glob("shard-*"))
    kept_mtime = shards[0].stat().st_mtime_ns
    shards[1].unlink()
    (out_dir / ".shard-00001.safetensors.killed").write_bytes(b"half")  # left by a killed run
    with open(shards[2], "r+b") as handle:
        handle.truncate(shards[2].stat().st_size // 2)

    captured = []
    real_capture = feature_cache.capture_features

    def counting_capture(target, tokens, **kwargs):
        captured.append(len(tokens.lengths))
        return real_capture(target, tokens, **kwargs)

    monkeypatch.setattr(feature_cache, "capture_features", counting_capture)
    with pytest.raises(UserError, match="shard-00001.safetensors, shard-00002.safetensors"):
        FeatureCache(out_dir)
    write(tiny_target, examples, out_dir)
    assert sum(captured) == 3 + 2  # shard 1 (examples 3-5) and shard 2 (examples 6-7)
    assert shards[0].stat().st_mtime_ns == kept_mtime
    again = FeatureCache(out_dir).batch(list(range(8)))
    assert torch.equal(again.tokens.input_ids, first[0])
    assert torch.equal(again.features, first[1]) and torch.equal(again.target_hidden, first[2])

    captured.clear()
    write(tiny_target, examples, out_dir)  # complete: nothing to do
    assert captured == []
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_rerun_with_other_settings_names_the_keys(tiny_target, examples, tmp_path):
    out_dir = write(tiny_target, examples, tmp_path / "cache")
    with pytest.raises(UserError, match=r"max_length \(24 in the cache, 32 now\)"):
        write(tiny_target, examples, out_dir, settings={**SETTINGS, "max_length": 32})
    with pytest.raises(UserError, match="dtype"):
        write(tiny_target, examples, out_dir, dtype="bf16")
    with pytest.raises(UserError, match="examples_sha256"):
        write(tiny_target, random_examples(8, seed=1), out_dir)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        write(tiny_target, examples, tmp_path / "other")


def test_reader_rejects_missing_or_incomplete_cache(tiny_target, examples, tmp_path):
    with pytest.raises(UserError, match="mmvsd prepare"):
        FeatureCache(tmp_path / "nothing")
    out_dir = write(tiny_target, examples, tmp_path / "cache")
    (out_dir / "shard-00002.safetensors").unlink()
    with pytest.raises(UserError, match=r"incomplete .*shard-00002\.safetensors.*same arguments"):
        FeatureCache(out_dir)
    (out_dir / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable feature-cache manifest"):
        FeatureCache(out_dir)


def test_check_cache_matches(tiny_target, examples, tmp_path):
    cache = FeatureCache(write(tiny_target, examples, tmp_path / "cache"))
    check_cache_matches(cache, tiny_target, {"data": "random:8", "max_length": 24})
    with pytest.raises(UserError, match="max_length"):
        check_cache_matches(cache, tiny_target, {"data": "random:8", "max_length": 48})
    with pytest.raises(UserError, match="data"):
        check_cache_matches(cache, tiny_target, {"data": "sharegpt", "max_length": 24})
    other = Target(tiny_target.model, None, "other-llama", aux_layer_ids=(0, 1, 2))
    with pytest.raises(UserError, match=r"aux_layer_ids .*target "):
        check_cache_matches(cache, other, {})


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_estimate_matches_bytes_on_disk(tiny_target, examples, tmp_path, dtype):
    out_dir = write(tiny_target, examples, tmp_path / "cache", dtype=dtype)
    actual = sum(p.stat().st_size for p in out_dir.iterdir())
    estimate = plan_feature_cache(tiny_target, examples, dtype=dtype, shard_size=3).num_bytes
    assert abs(estimate - actual) / actual < 0.03, (estimate, actual)
    plan = plan_feature_cache(tiny_target, examples, dtype=dtype, shard_size=3)
    assert plan.num_tokens == sum(len(ex.input_ids) for ex in examples) and plan.num_shards == 3
    assert f"to {out_dir} (8 examples, {plan.num_tokens} tokens" in plan.describe(out_dir)


def test_bf16_storage_round_trip(tiny_target, examples, tmp_path):
    fp32 = FeatureCache(write(tiny_target, examples, tmp_path / "fp32"))
    bf16 = FeatureCache(write(tiny_target, examples, tmp_path / "bf16", dtype=torch.bfloat16))
    assert json.loads((tmp_path / "bf16" / "manifest.json").read_text())["layout"]["dtype"] == "bfloat16"
    indices = [6, 1, 4]
    stored = bf16.batch(indices)
    assert stored.features.dtype == torch.bfloat16
    want, got = fp32.batch(indices), bf16.batch(indices, dtype=torch.float32)
    assert got.features.dtype == torch.float32
    torch.testing.assert_close(got.features, want.features, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.target_hidden, want.target_hidden, rtol=1e-2, atol=1e-2)
    assert torch.equal(got.tokens.loss_mask, want.tokens.loss_mask)


def test_reader_keeps_few_shards_open(tiny_target, examples, tmp_path):
    cache = FeatureCache(write(tiny_target, examples, tmp_path / "cache"))
    cache.batch([0, 3, 6, 1])
    assert len(cache._open) <= cache.max_open_shards
    with pytest.raises(IndexError):
        cache.batch([8])


def test_cache_folder_holds_only_manifest_and_shards(tiny_target, examples, tmp_path):
    out_dir = write(tiny_target, examples, tmp_path / "cache")
    assert {p.name for p in out_dir.iterdir()} == {"manifest.json"} | {f"shard-0000{i}.safetensors" for i in range(3)}
    assert os.path.getsize(out_dir / "manifest.json") < 2048
