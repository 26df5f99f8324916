"""`mmvsd export --format gguf`: the EAGLE-3 GGUF file llama.cpp loads, read back with the `gguf` package and
checked against the drafter's weights and the target's own GGUF; draft models export as their GGUF file; target
folders mmvsd writes carry a tokenizer config that transformers 4 reads too."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import save_tiny_target
from mmvsd.drafter_base import load_drafter
from mmvsd.drafters.eagle3_gguf import TENSOR_NAMES, rope_pairs
from mmvsd.drafters.export_spec import export_spec
from mmvsd.errors import UserError
from mmvsd.shipped import resolve_drafter
from mmvsd.target_loader import portable_tokenizer_config, target_gguf_file

gguf = pytest.importorskip("gguf")


def fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_rope_pairs_matches_the_definition():
    """Row 2i of a head is rotate-half row i, row 2i + 1 is row i + d/2 (GGML rotates adjacent pairs)."""
    heads, dim, cols = 3, 8, 5
    weight = torch.arange(heads * dim * cols, dtype=torch.float32).reshape(heads * dim, cols)
    out = rope_pairs(weight, heads)
    for h in range(heads):
        for i in range(dim // 2):
            assert torch.equal(out[h * dim + 2 * i], weight[h * dim + i])
            assert torch.equal(out[h * dim + 2 * i + 1], weight[h * dim + dim // 2 + i])


@pytest.fixture(scope="module")
def exported(smollm2_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "draft.gguf"
    export_spec("default", "gguf", out, "smollm2-135m")
    return out, load_drafter(resolve_drafter("default", "smollm2-135m"), smollm2_target)


@pytest.mark.smollm2
def test_gguf_holds_the_eagle3_hparams_and_the_targets_tokenizer(exported):
    path, drafter = exported
    got, target = fields(path), fields(target_gguf_file("smollm2-135m"))
    config = drafter.config
    assert got["general.architecture"] == "eagle3" and got["eagle3.block_count"] == 1
    assert list(got["eagle3.target_layers"]) == list(config.aux_layer_ids)
    assert got["eagle3.target_hidden_size"] == config.target_hidden_size == 576
    assert got["eagle3.embedding_length"] == config.hidden_size
    assert got["eagle3.attention.head_count_kv"] == config.num_key_value_heads
    assert got["eagle3.rope.freq_base"] == pytest.approx(config.rope_theta)
    assert got["eagle3.norm_before_residual"] is False or got["eagle3.norm_before_residual"] == 0
    tokenizer_keys = {k for k in target if k.startswith("tokenizer.")}
    assert tokenizer_keys and tokenizer_keys == {k for k in got if k.startswith("tokenizer.")}
    for key in tokenizer_keys:
        assert got[key] == target[key], key


@pytest.mark.smollm2
def test_gguf_tensors_are_the_drafters_weights(exported):
    path, drafter = exported
    found = tensors(path)
    state = {k: v.float() for k, v in drafter.state_dict().items()}
    assert set(found) == set(TENSOR_NAMES.values()) | {"d2t"}
    heads, kv_heads = drafter.config.num_attention_heads, drafter.config.num_key_value_heads
    expected = {TENSOR_NAMES[k]: v for k, v in state.items() if k in TENSOR_NAMES}
    expected["blk.0.attn_q.weight"] = rope_pairs(expected["blk.0.attn_q.weight"], heads)
    expected["blk.0.attn_k.weight"] = rope_pairs(expected["blk.0.attn_k.weight"], kv_heads)
    for name, want in expected.items():
        tensor = found[name]
        assert tuple(int(n) for n in tensor.shape) == tuple(reversed(want.shape)), name  # GGUF: ne reversed
        data = torch.tensor(np.asarray(tensor.data, dtype=np.float32).reshape(want.shape))
        assert torch.allclose(data, want, atol=1e-3, rtol=1e-3), name  # f16 matrices, f32 norms
        assert (tensor.tensor_type.name == "F32") == (want.dim() == 1), name
    d2t = torch.tensor(np.asarray(found["d2t"].data, dtype=np.int64))  # a copy: the reader maps the file read-only
    assert torch.equal(d2t, drafter.draft_vocab_target_ids().cpu())  # absolute target ids
    assert torch.equal(d2t, state["d2t"].long() + torch.arange(len(d2t)))


@pytest.mark.smollm2
def test_q8_0_matrices(exported, tmp_path):
    out = export_spec("default", "gguf", tmp_path / "q8.gguf", "smollm2-135m", out_type="q8_0")
    kinds = {t.name: t.tensor_type.name for t in tensors(out).values()}
    assert kinds["output.weight"] == kinds["fc.weight"] == "Q8_0" and kinds["output_norm.weight"] == "F32"


@pytest.mark.smollm2
def test_export_refuses_what_it_cannot_write_and_leaves_nothing(exported, tmp_path):
    path, _ = exported
    with pytest.raises(UserError, match="pass --force"):
        export_spec("default", "gguf", path, "smollm2-135m")
    with pytest.raises(UserError, match="--target"):
        export_spec("default", "gguf", tmp_path / "x.gguf")
    with pytest.raises(UserError, match="only as --format gguf"):
        export_spec("model:smollm2-135m", "eagle3", tmp_path / "e3")
    with pytest.raises(UserError, match="--outtype"):
        export_spec("default", "eagle3", tmp_path / "e3", "smollm2-135m", out_type="f16")
    with pytest.raises(UserError, match="no such drafter folder"):
        export_spec(str(tmp_path / "missing"), "gguf", tmp_path / "m.gguf", "smollm2-135m")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.smollm2
def test_a_draft_model_exports_as_its_gguf_file(tmp_path):
    out = export_spec("model:smollm2-135m", "gguf", tmp_path / "draft.gguf")
    assert out.read_bytes() == target_gguf_file("smollm2-135m").read_bytes()
    folder_out = export_spec("model:smollm2-135m", "gguf", tmp_path / "folder")
    assert folder_out == tmp_path / "folder" / target_gguf_file("smollm2-135m").name and folder_out.is_file()


def test_portable_tokenizer_config(tmp_path):
    """transformers 5 saves `TokenizersBackend`; the folder is rewritten to a class 4.x reads, same ids."""
    from transformers import AutoTokenizer

    folder = save_tiny_target(tmp_path / "target")
    before = AutoTokenizer.from_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "TokenizersBackend"
    config_path.write_text(json.dumps(config))
    portable_tokenizer_config(folder)
    assert json.loads(config_path.read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    text = "w1 w2 w3"
    assert AutoTokenizer.from_pretrained(folder)(text).input_ids == before(text).input_ids
