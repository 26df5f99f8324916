"""Checkpoint layouts: EAGLE-3 export/import as vLLM and SGLang read it, `hf` round trips, `--init`."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PROMPT_POOL, make_tiny_llama, save_tiny_target
from mmvsd.decoding.decode import DecodeConfig, speculative_generate
from mmvsd.drafter_base import load_drafter
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.drafters.export_spec import run_export
from mmvsd.errors import UserError
from mmvsd.layouts.export import export_drafter
from mmvsd.layouts.export_cli import add_export_parser
from mmvsd.layouts.registry import LAYOUTS, layout
from mmvsd.target import Target
from mmvsd.training.config import TrainConfig
from mmvsd.training.drafter_init import resolve_init
from mmvsd.training.trainer import build_drafter, check_init

# the weight names of a released EAGLE-3 drafter (written out here, not taken from our code)
RELEASED_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
}
H, HEADS, KV_HEADS, HEAD_DIM, INTER, V = 64, 4, 2, 16, 128, 128  # the tiny target's sizes (conftest)
DRAFT_IDS = torch.tensor([0, 3, 4, 9, 17, 30, 31, 55, 64, 80, 99, 100, 101, 120, 126, 127])  # sorted, Vd = 16


def small_drafter(target: Target, seed: int = 5) -> Eagle3Drafter:
    """An EAGLE-3 drafter with a reduced, non-contiguous draft vocabulary."""
    drafter = Eagle3Drafter.from_target(target, draft_vocab_size=len(DRAFT_IDS), seed=seed)
    drafter.set_draft_vocab(DRAFT_IDS[torch.randperm(len(DRAFT_IDS))])
    return drafter.eval()


def draft_logprobs(drafter: Eagle3Drafter, seed: int = 0) -> torch.Tensor:
    """[2, 5, Vd] log-probs after one step from target features and one from the drafter's own hidden."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(2, 5, 3 * H, generator=gen)  # [B, Q, 3H]
    token_ids = torch.randint(0, V, (2, 5), generator=gen)
    positions = torch.arange(5).expand(2, 5)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None].expand(2, 1, 5, 5)  # [B, 1, Q, Q] causal
    with torch.no_grad():
        hidden = drafter.read_target(features, token_ids, positions, mask, None)
        hidden = drafter.read_draft(hidden, token_ids, positions, mask, None)
        return drafter.draft_logprobs(hidden)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key


def released_config(vocab: int = V, hidden: int = H, num_draft: int = len(DRAFT_IDS)) -> dict:
    """config.json as EAGLE's authors publish it: no eagle_config, no head_dim, no target_hidden_size."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": hidden,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "max_position_embeddings": 2048,
        "vocab_size": vocab, "draft_vocab_size": num_draft, "tie_word_embeddings": False, "torch_dtype": "float16",
    }


def released_tensors(hidden: int = H, draft_ids: torch.Tensor = DRAFT_IDS, seed: int = 1) -> dict:
    """fp16 weights with the released EAGLE-3 names and shapes; d2t holds offsets, t2d a mask."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,), "lm_head.weight": (len(draft_ids), hidden),
        "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": (INTER, hidden), "midlayer.mlp.up_proj.weight": (INTER, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, INTER), "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.input_layernorm.weight": (hidden,), "midlayer.post_attention_layernorm.weight": (hidden,),
    }
    tensors = {k: (0.1 * torch.randn(s, generator=gen)).half() for k, s in shapes.items()}
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool)
    tensors["t2d"][draft_ids] = True
    return tensors


def write_checkpoint(folder: Path, config: dict, tensors: dict, fmt: str = "bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def load_eagle3(path: Path, target: Target) -> Eagle3Drafter:
    return resolve_init(f"eagle3:{path}", target.name).load(target)


def test_eagle3_export_is_what_vllm_and_sglang_read(tiny_target, tmp_path):
    drafter = small_drafter(tiny_target)
    drafter.save_pretrained(tmp_path / "ours")
    out = export_drafter(tmp_path / "ours", "eagle3", tmp_path / "e3", target=tiny_target)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, V, len(DRAFT_IDS))
    assert (config["hidden_size"], config["target_hidden_size"], config["head_dim"]) == (H, H, HEAD_DIM)
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 2, 1], "use_aux_hidden_state": True}
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"
    assert "mmvsd_drafter_type" not in config
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == RELEASED_KEYS  # no embeddings
    assert tensors["fc.weight"].shape == (H, 3 * H) and tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * H)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,)
    assert_same_tensors(tensors, {k: v.contiguous() for k, v in drafter.state_dict().items()})


def test_exported_config_reads_as_a_llama_config(tiny_target, tmp_path):
    from transformers import AutoConfig

    drafter = small_drafter(tiny_target)
    drafter.save_pretrained(tmp_path / "ours")
    export_drafter(tmp_path / "ours", "eagle3", tmp_path / "e3", target=tiny_target)
    config = AutoConfig.from_pretrained(tmp_path / "e3")
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.head_dim) == ("llama", 1, H, 16)
    assert config.rope_parameters["rope_theta"] == drafter.config.rope_theta


def test_d2t_holds_offsets_into_the_target_vocabulary(tiny_target, tmp_path):
    drafter = small_drafter(tiny_target)
    drafter.save_pretrained(tmp_path / "ours")
    export_drafter(tmp_path / "ours", "eagle3", tmp_path / "e3", target=tiny_target)
    tensors = load_file(str(tmp_path / "e3" / "model.safetensors"))
    assert torch.equal(torch.arange(len(DRAFT_IDS)) + tensors["d2t"], DRAFT_IDS)  # target id = i + d2t[i]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), DRAFT_IDS)
    assert not torch.equal(tensors["d2t"], DRAFT_IDS)  # offsets, not absolute ids
    assert torch.equal(load_eagle3(tmp_path / "e3", tiny_target).draft_vocab_target_ids(), DRAFT_IDS)


def test_eagle3_round_trip_gives_identical_drafts(tiny_target, tmp_path):
    drafter = small_drafter(tiny_target)
    drafter.save_pretrained(tmp_path / "ours")
    export_drafter(tmp_path / "ours", "eagle3", tmp_path / "e3", target=tiny_target)
    reloaded = load_eagle3(tmp_path / "e3", tiny_target)
    assert reloaded.config == drafter.config  # aux layer ids, sizes, rope, target name
    assert_same_tensors(reloaded.state_dict(), drafter.state_dict())
    assert torch.equal(draft_logprobs(reloaded), draft_logprobs(drafter))
    config = DecodeConfig(max_new_tokens=12)
    before = speculative_generate(tiny_target, drafter, PROMPT_POOL[:2], config)
    after = speculative_generate(tiny_target, reloaded, PROMPT_POOL[:2], config)
    assert [r.output_ids for r in after] == [r.output_ids for r in before]
    assert [r.accept_lengths for r in after] == [r.accept_lengths for r in before]
    assert max(n for r in before for n in r.accept_lengths) > 1  # the drafts mattered


def test_feature_layer_ids_round_trip(tmp_path):
    target = Target(make_tiny_llama(), None, "tiny-llama-345", aux_layer_ids=(3, 4, 0))
    drafter = small_drafter(target)
    drafter.save_pretrained(tmp_path / "ours")
    export_drafter(tmp_path / "ours", "eagle3", tmp_path / "e3", target=target)
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 0]
    assert load_eagle3(tmp_path / "e3", target).config.aux_layer_ids == [3, 4, 0]
    default = Target(make_tiny_llama(), None, "tiny-llama")
    with pytest.raises(UserError, match=r"reads target hidden states \[3, 4, 0\], target gives \[2, 2, 1\]"):
        load_eagle3(tmp_path / "e3", default)


def test_specforge_output_of_layer_ids_are_shifted(tiny_target, tmp_path):
    config = {**released_config(), "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 0]}}
    folder = write_checkpoint(tmp_path / "specforge", config, released_tensors())
    assert load_eagle3(folder, tiny_target).config.aux_layer_ids == [2, 2, 1]  # outputs of layers 1, 1, 0


def test_hf_export_round_trips(tiny_target, tmp_path):
    drafter = small_drafter(tiny_target)
    drafter.save_pretrained(tmp_path / "ours")
    export_drafter(tmp_path / "ours", "hf", tmp_path / "hf", target=tiny_target)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (tmp_path / "ours" / "config.json").read_text())
    assert_same_tensors(load_file(str(tmp_path / "hf" / "model.safetensors")),
                        load_file(str(tmp_path / "ours" / "model.safetensors")))
    assert torch.equal(draft_logprobs(load_drafter(tmp_path / "hf", tiny_target)), draft_logprobs(drafter))


@pytest.mark.parametrize("variant", ["bin", "safetensors with vLLM's layers.0 names"])
def test_released_checkpoint_loads(tiny_target, tmp_path, variant):
    tensors = released_tensors()
    stored = dict(tensors)
    if variant != "bin":
        stored = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    stored["embed_tokens.weight"] = tiny_target.input_embeddings.weight.detach().half()  # some releases ship them
    folder = write_checkpoint(tmp_path / "release", released_config(), stored, "bin" if variant == "bin" else "st")
    drafter = load_eagle3(folder, tiny_target)
    params = drafter.state_dict()
    for key, value in tensors.items():
        expected = value if key in ("d2t", "t2d") else value.float()
        assert torch.equal(params[key], expected), key
    assert drafter.config.aux_layer_ids == [2, 2, 1]  # EAGLE-3's default layers for a 4-layer target
    assert (drafter.config.rope_theta, drafter.config.head_dim, drafter.config.target_hidden_size) == (5000.0, 16, H)
    assert torch.equal(drafter.draft_vocab_target_ids(), DRAFT_IDS)
    assert torch.equal(drafter.draft_to_target(torch.tensor([0, 15])), torch.tensor([0, 127]))
    assert draft_logprobs(drafter).shape == (2, 5, len(DRAFT_IDS))


def eagle1_tensors() -> dict:
    """An EAGLE-1 / MSD style drafter: decoder layer under layers.0, fc over [emb ; hidden] with a bias."""
    return {"embed_tokens.weight": torch.zeros(V, H), "fc.weight": torch.zeros(H, 2 * H), "fc.bias": torch.zeros(H),
            **{f"layers.0.self_attn.{p}_proj.weight": torch.zeros(H, H) for p in "qkvo"},
            "layers.0.post_attention_layernorm.weight": torch.ones(H)}


def bad_checkpoints() -> dict[str, tuple[dict, dict, str]]:
    """name -> (config, tensors, expected message) for checkpoints that must not load."""
    good, config = released_tensors(), released_config()
    absolute = {**good, "d2t": DRAFT_IDS.clone()}
    return {
        "missing key": (config, {k: v for k, v in good.items() if k != "midlayer.mlp.up_proj.weight"},
                        "missing midlayer.mlp.up_proj.weight"),
        "unexpected key": (config, {**good, "midlayer.self_attn.q_proj.bias": torch.zeros(64)},
                           "unexpected midlayer.self_attn.q_proj.bias"),
        "wrong shape": (config, {**good, "lm_head.weight": torch.zeros(17, H)}, "lm_head.weight [17, 64]"),
        "EAGLE-1 layout": ({**config, "architectures": ["LlamaForCausalLM"]}, eagle1_tensors(), "EAGLE-1 layout"),
        "MSD": ({**config, "model_type": "llava"}, eagle1_tensors(), "MSD drafter"),
        "ViSpec": (config, {**eagle1_tensors(), "imadpt.q": torch.zeros(2, 4, 16)}, "ViSpec"),
        "hidden size": (released_config(hidden=32), released_tensors(hidden=32), "hidden size 32 != target's 64"),
        "vocabulary": (released_config(vocab=256), good, "vocabulary 256 != target's 128"),
        "absolute d2t": (config, absolute, "d2t holds offsets"),
        "two layers": ({**config, "num_hidden_layers": 2}, good, "2 draft layers"),
        "rope scaling": ({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, good, "rope scaling"),
        "feature layers": ({**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 1]}}, good,
                           "reads target hidden states [2, 3, 1], target gives [2, 2, 1]"),
    }


@pytest.mark.parametrize("case", sorted(bad_checkpoints()))
def test_bad_checkpoint_is_one_clear_error(tiny_target, tmp_path, case):
    config, tensors, message = bad_checkpoints()[case]
    folder = write_checkpoint(tmp_path / "ckpt", config, tensors)
    with pytest.raises(UserError, match=None) as err:
        load_eagle3(folder, tiny_target)
    assert message in str(err.value) and str(folder) in str(err.value)


def fake_hf_cache(cache: Path, repo_id: str, files: Path) -> Path:
    """The hub cache structure snapshot_download(local_files_only=True) resolves: refs/main -> snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in files.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_init_released_drafter_from_the_hf_cache(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setitem(LAYOUTS["eagle3"].released, tiny_target.name, "someorg/tiny-eagle3")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError, match="someorg/tiny-eagle3.*huggingface-cli download someorg/tiny-eagle3"):
        resolve_init("eagle3", tiny_target.name)
    release = write_checkpoint(tmp_path / "release", released_config(), released_tensors())
    snapshot = fake_hf_cache(tmp_path / "hub", "someorg/tiny-eagle3", release)
    source = resolve_init("eagle3", tiny_target.name)
    assert source.layout is layout("eagle3") and source.path == snapshot
    assert torch.equal(source.load(tiny_target).draft_vocab_target_ids(), DRAFT_IDS)
    with pytest.raises(UserError, match="no released eagle3 drafter is known for target 'other'.*eagle3:PATH"):
        resolve_init("eagle3", "other")


def test_init_specs(tiny_target, tmp_path):
    assert resolve_init("none", "t") is None
    small_drafter(tiny_target).save_pretrained(tmp_path / "ours")
    assert resolve_init(str(tmp_path / "ours"), "t").layout is layout("hf")
    release = write_checkpoint(tmp_path / "release", released_config(), released_tensors())
    assert resolve_init(str(release), "t").layout is layout("eagle3")  # a plain folder is recognised
    with pytest.raises(UserError, match="folder .*nope not found"):
        resolve_init(f"eagle3:{tmp_path / 'nope'}", "t")
    with pytest.raises(UserError, match="not 'none', a layout name .*eagle3.*hf"):
        resolve_init("eagle4", "t")
    with pytest.raises(UserError, match="unknown checkpoint layout 'eagle4'; registered: eagle3, gguf, hf"):
        layout("eagle4")


def test_train_init_from_an_eagle3_folder(tiny_target, tmp_path):
    release = write_checkpoint(tmp_path / "release", released_config(), released_tensors())
    config = TrainConfig(target=tiny_target.name, init=f"eagle3:{release}", output=str(tmp_path / "out"))
    drafter = build_drafter(config, tiny_target, [])
    assert drafter.training and torch.equal(drafter.draft_vocab_target_ids(), DRAFT_IDS)
    assert torch.equal(drafter.fc.weight, released_tensors()["fc.weight"].float())


def export_cli(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers(dest="command"))
    run_export(parser.parse_args(["export", *argv]))


def test_export_command(tmp_path, capsys):
    folder = save_tiny_target(tmp_path / "target")
    target = Target(make_tiny_llama(), None, str(folder))  # the name a drafter trained on it records
    small_drafter(target).save_pretrained(tmp_path / "ours")
    out = tmp_path / "out"
    export_cli(["--drafter", str(tmp_path / "ours"), "--format", "eagle3", str(out)])  # target from the config
    assert "eagle3 drafter written to" in capsys.readouterr().out
    first = load_file(str(out / "model.safetensors"))
    with pytest.raises(UserError, match="is not empty; pass --force"):
        export_cli(["--drafter", str(tmp_path / "ours"), "--format", "eagle3", str(out)])
    export_cli(["--drafter", str(tmp_path / "ours"), "--format", "eagle3", "--force", str(out)])
    assert_same_tensors(load_file(str(out / "model.safetensors")), first)
    with pytest.raises(UserError, match="unknown checkpoint layout .vllm.; registered: eagle3, gguf, hf, msd, "
                                        "speculators"):
        export_cli(["--drafter", str(tmp_path / "ours"), "--format", "vllm", str(tmp_path / "x")])
    with pytest.raises(UserError, match="not an mmvsd drafter folder"):
        export_cli(["--drafter", str(out), "--format", "hf", str(tmp_path / "y")])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_train_init_keeps_the_errors_for_folders_of_ours(tiny_target, tmp_path):
    other = Target(make_tiny_llama(vocab=96), None, "tiny-llama-96")
    Eagle3Drafter.from_target(other).save_pretrained(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "other"): "does not fit target 'tiny-llama'", str(tmp_path / "empty"): "has no config.json"}
    for init, message in cases.items():
        config = TrainConfig(target=tiny_target.name, init=init, output=str(tmp_path / "out"))
        with pytest.raises(UserError, match=message):
            build_drafter(config, tiny_target, [])
    with pytest.raises(UserError, match="--init 'eagle4'"):  # before any target is loaded
        check_init(TrainConfig(target="no-such-target", init="eagle4"))


def test_eagle3_export_states_what_readers_would_otherwise_assume(tiny_target, tmp_path):
    drafter = small_drafter(tiny_target)
    drafter.config.max_position_embeddings = 256  # e.g. a drafter trained with a short context
    drafter.save_pretrained(tmp_path / "ours")
    export_drafter(tmp_path / "ours", "eagle3", tmp_path / "e3", target=tiny_target)
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["norm_before_residual"] is False  # vLLM assumes true when absent
    assert config["max_position_embeddings"] >= tiny_target.max_positions > 256
    assert config["eagle_aux_hidden_state_layer_ids"] == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] \
        == list(tiny_target.aux_layer_ids)
    broken = json.loads((tmp_path / "e3" / "config.json").read_text())
    (tmp_path / "e3" / "config.json").write_text(json.dumps({**broken, "norm_before_residual": True}))
    with pytest.raises(UserError, match="norm_before_residual"):
        load_eagle3(tmp_path / "e3", tiny_target)


def speculators_target() -> Target:
    return Target(make_tiny_llama(), None, "tiny-llama", aux_layer_ids=(0, 1, 2))  # speculators needs distinct ids


def test_speculators_export_is_the_speculators_layout_and_round_trips(tmp_path):
    target = speculators_target()
    drafter = small_drafter(target)
    drafter.save_pretrained(tmp_path / "ours")
    out = export_drafter(tmp_path / "ours", "speculators", tmp_path / "spec", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["hidden_size"], layer["vocab_size"]) == \
        ("llama", 1, H, V)
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (len(DRAFT_IDS), H)
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["norm_before_residual"] is False
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "eagle3" and speculators["default_proposal_method"] == "greedy"
    assert speculators["proposal_methods"][0]["proposal_type"] == "greedy"
    assert speculators["verifier"]["name_or_path"] == "tiny-llama"
    tensors = load_file(str(out / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0.") for k in RELEASED_KEYS}
    assert set(tensors) == renamed | {"embed_tokens.weight"}
    assert torch.equal(tensors["embed_tokens.weight"], target.input_embeddings.weight.detach())
    loaded = resolve_init(str(out), target.name).load(target)  # a plain PATH is recognised as speculators
    assert type(resolve_init(str(out), target.name).layout).__name__ == "SpeculatorsLayout"
    assert torch.equal(draft_logprobs(loaded), draft_logprobs(drafter))


@pytest.mark.parametrize(("fmt", "message"), [
    ("vllm", "unknown checkpoint layout 'vllm'; registered: eagle3, gguf, hf, msd, speculators, vispec"),
    ("eagle3", "--format eagle3 holds 'eagle3' drafters (vLLM and SGLang serve only EAGLE-3-style drafters); "),
    ("speculators", "--format speculators holds 'eagle3' drafters (vLLM and SGLang serve only EAGLE-3-style"),
])
def test_export_bad_input_is_one_clear_message(llava_target, tmp_path, fmt, message):
    from mmvsd.drafters.msd import MSDDrafter

    MSDDrafter.from_target(llava_target).save_pretrained(tmp_path / "msd")
    with pytest.raises(UserError) as err:
        export_drafter(tmp_path / "msd", fmt, tmp_path / "out", target=llava_target)
    assert message in str(err.value)
    assert fmt == "vllm" or "'msd' drafter, which it cannot represent (its own layouts: hf, msd)" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_speculators_export_refuses_repeated_feature_layers(tiny_target, tmp_path):
    small_drafter(tiny_target).save_pretrained(tmp_path / "ours")
    if len(set(tiny_target.aux_layer_ids)) == len(tiny_target.aux_layer_ids):
        pytest.skip("the tiny target's default feature layers are distinct")
    with pytest.raises(UserError, match="speculators refuses"):
        export_drafter(tmp_path / "ours", "speculators", tmp_path / "spec", target=tiny_target)


def test_train_init_for_a_bf16_target_trains_fp32_master_weights(tiny_target, tmp_path):
    """A drafter loaded for a bf16 target comes in bf16; its trainable weights train in fp32 (bf16 AdamW
    updates would lose their precision), values unchanged."""
    release = write_checkpoint(tmp_path / "release", released_config(), released_tensors())
    bf16_target = Target(copy.deepcopy(tiny_target.model).to(torch.bfloat16), None, tiny_target.name)
    config = TrainConfig(target=tiny_target.name, init=f"eagle3:{release}", output=str(tmp_path / "out"))
    drafter = build_drafter(config, bf16_target, [])
    assert {p.dtype for p in drafter.parameters() if p.requires_grad} == {torch.float32}
    assert torch.equal(drafter.fc.weight, released_tensors()["fc.weight"].to(torch.bfloat16).float())
