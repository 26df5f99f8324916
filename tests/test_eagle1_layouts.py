"""The `msd` and `vispec` checkpoint layouts: released MSD / ViSpec folders in, our drafters out, and back."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from test_layouts import fake_hf_cache, write_checkpoint

from conftest import save_tiny_llava
from mmvsd.cli import main as cli_main
from mmvsd.drafter_base import DraftInputs, PairMedia
from mmvsd.drafters.eagle1 import Eagle1Drafter
from mmvsd.drafters.eagle3 import Eagle3Drafter
from mmvsd.drafters.msd import MSDDrafter
from mmvsd.drafters.vispec import ViSpecDrafter
from mmvsd.errors import UserError
from mmvsd.layouts.export import export_drafter
from mmvsd.layouts.registry import layout
from mmvsd.shipped import default_drafter, list_shipped
from mmvsd.target import Target
from mmvsd.target_loader import load_target
from mmvsd.training.config import TrainConfig
from mmvsd.training.drafter_init import resolve_init
from mmvsd.training.trainer import check_init

H, HEADS, KV_HEADS, HEAD_DIM, INTER, V = 64, 4, 2, 16, 128, 128  # the tiny LLaVA's language model (conftest)
NUM_Q = 3  # not ViSpec's default 2, so that reading it from imadpt.q is tested
DRAFTERS = {"msd": MSDDrafter, "vispec": ViSpecDrafter}
# weight names and shapes of the released checkpoints (written out here, not taken from our code)
EAGLE1_SHAPES = {
    "fc.weight": (H, 2 * H), "fc.bias": (H,),
    "layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
    "layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
    "layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
    "layers.0.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "layers.0.mlp.gate_proj.weight": (INTER, H), "layers.0.mlp.up_proj.weight": (INTER, H),
    "layers.0.mlp.down_proj.weight": (H, INTER), "layers.0.post_attention_layernorm.weight": (H,),
}
VISPEC_SHAPES = {
    "imadpt.q": (NUM_Q, HEADS, HEAD_DIM), "imadpt.k_proj.weight": (HEADS * HEAD_DIM, H),
    "imadpt.v_proj.weight": (HEADS * HEAD_DIM, H), "imadpt.o_proj.weight": (H, HEADS * HEAD_DIM),
    "img_fc.weight": (H, 2 * H), "img_fc.bias": (H,),
}


@pytest.fixture(scope="module")
def llava_target(tmp_path_factory) -> Target:
    return load_target(str(save_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))))


def released_config(hidden: int = H, vocab: int = V, nested: bool = False) -> dict:
    """config.json as MSD publishes it (a LLaVA config cut to one layer); `nested`: sizes under text_config."""
    sizes = {"hidden_size": hidden, "intermediate_size": INTER, "num_attention_heads": HEADS,
             "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
             "max_position_embeddings": 1024, "vocab_size": vocab, "hidden_act": "silu"}
    top = {"architectures": ["LlavaLlamaForCausalLM"], "model_type": "llava", "torch_dtype": "float16"}
    return {**top, "text_config": sizes} if nested else {**top, **sizes}


def released_tensors(name: str, target: Target, seed: int = 1) -> dict[str, torch.Tensor]:
    """fp16 weights with the released names and shapes, the target's embeddings included."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {**EAGLE1_SHAPES, **(VISPEC_SHAPES if name == "vispec" else {})}
    tensors = {k: (0.1 * torch.randn(s, generator=gen)).half() for k, s in shapes.items()}
    tensors["embed_tokens.weight"] = target.input_embeddings.weight.detach().half()
    return tensors


def release(folder: Path, name: str, target: Target, **config) -> Path:
    return write_checkpoint(folder, released_config(**config), released_tensors(name, target))


def draft_outputs(drafter: Eagle1Drafter, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits after feeding 2 rows of 10 pairs (an image span in row 0) and one tree expansion."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(2, 10, H, generator=gen)  # [B, Q, H] target hidden states
    next_ids = torch.randint(0, V, (2, 10), generator=gen)
    span_ids = torch.full((2, 10), -1)
    span_ids[0, 2:7] = 0  # the next tokens of pairs 2..6 of row 0 are one image's
    media = PairMedia(torch.randn(2, 10, H, generator=gen), span_ids)
    session = drafter.new_session(2)
    session.advance(DraftInputs(features, next_ids, torch.tensor([10, 8]), media))
    root_logits = drafter.draft_logits(session.last_hidden)  # [B, V]
    root_ids, _ = session.root_candidates(3)  # [B, 3]
    session.expand(root_ids, torch.zeros(2, 3, dtype=torch.long), torch.eye(3, dtype=torch.bool).expand(2, 3, 3), 3)
    return root_logits, drafter.draft_logits(session.frontier_hidden)  # [B, V], [B, 3, V]


def our_drafter(name: str, target: Target, folder: Path, seed: int = 4) -> Eagle1Drafter:
    """A freshly initialised drafter of ours (img_fc perturbed off its identity start), saved to `folder`."""
    drafter = DRAFTERS[name].from_target(target, seed=seed).eval()
    if name == "vispec":
        with torch.no_grad():
            drafter.img_fc.weight.add_(0.05 * torch.randn_like(drafter.img_fc.weight))
    drafter.save_pretrained(folder)
    return drafter


@pytest.mark.parametrize("nested", [False, True], ids=["flat config", "text_config"])
@pytest.mark.parametrize("spec", ["{name}:{path}", "{path}"], ids=["LAYOUT:PATH", "PATH"])
@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_released_checkpoint_loads(llava_target, tmp_path, name, spec, nested):
    folder = release(tmp_path / "release", name, llava_target, nested=nested)
    source = resolve_init(spec.format(name=name, path=folder), llava_target.name)
    assert source.layout is layout(name) and source.path == folder
    drafter = source.load(llava_target)
    assert type(drafter) is DRAFTERS[name] and not drafter.training
    params = drafter.state_dict()
    tensors = released_tensors(name, llava_target)
    del tensors["embed_tokens.weight"]  # ours are the target's, never parameters
    assert set(params) == set(tensors)
    for key, value in tensors.items():
        assert params[key].dtype == torch.float32 and torch.equal(params[key], value.float()), key
    config = drafter.config
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim, config.vocab_size) == (H, KV_HEADS, 16, V)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (5000.0, 1e-5, 1024)
    assert config.fc_bias and config.target_name == llava_target.name
    assert config.max_images == (1 if name == "msd" else None)  # MSD's drafters take one image per prompt
    if name == "vispec":
        assert config.num_q == NUM_Q  # from imadpt.q, not config.json
    else:
        assert config.media_rms is None  # MSD's releases read the image embeddings as the target does
    assert drafter.embed_tokens is llava_target.input_embeddings
    assert draft_outputs(drafter)[1].shape == (2, 3, V)


def test_msd_without_bias_loads(llava_target, tmp_path):
    tensors = {k: v for k, v in released_tensors("msd", llava_target).items() if k != "fc.bias"}
    drafter = layout("msd").load(write_checkpoint(tmp_path / "release", released_config(), tensors), llava_target)
    assert not drafter.config.fc_bias and drafter.fc.bias is None


@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_export_is_the_released_layout(llava_target, tmp_path, name):
    drafter = our_drafter(name, llava_target, tmp_path / "ours")
    out = export_drafter(tmp_path / "ours", name, tmp_path / "out", target=llava_target)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "pytorch_model.bin"]
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llava", 1, V)
    assert (config["hidden_size"], config["num_key_value_heads"], config["bias"], config["torch_dtype"]) == (
        H, KV_HEADS, True, "float32")
    assert "mmvsd_drafter_type" not in config
    tensors = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert set(tensors) == {*EAGLE1_SHAPES, *(VISPEC_SHAPES if name == "vispec" else ()), "embed_tokens.weight"}
    assert {k: tuple(v.shape) for k, v in tensors.items() if k != "embed_tokens.weight"} == {
        **EAGLE1_SHAPES, **({**VISPEC_SHAPES, "imadpt.q": (2, HEADS, HEAD_DIM)} if name == "vispec" else {})}
    assert torch.equal(tensors["embed_tokens.weight"], llava_target.input_embeddings.weight)
    for key, value in drafter.state_dict().items():
        assert torch.equal(tensors[key], value), key


@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_round_trip_gives_identical_drafts(llava_target, tmp_path, name):
    drafter = our_drafter(name, llava_target, tmp_path / "ours")
    export_drafter(tmp_path / "ours", name, tmp_path / "out", target=llava_target)
    reloaded = resolve_init(str(tmp_path / "out"), llava_target.name).load(llava_target)  # recognised as `name`
    assert reloaded.config == drafter.config
    before, after = draft_outputs(drafter), draft_outputs(reloaded)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    other = our_drafter(name, llava_target, tmp_path / "other", seed=5)
    assert not torch.equal(draft_outputs(other)[1], after[1])  # the drafts depend on the weights


@pytest.mark.parametrize("name", ["msd", "vispec"])
def test_a_narrowed_drafter_exports_its_whole_vocabulary(llava_target, tmp_path, name, caplog):
    """The released layouts draft over the whole vocabulary: a narrowed drafter exports the same weights without
    its draft vocabulary (and says so), and drafts as the drafter it was narrowed from."""
    drafter = our_drafter(name, llava_target, tmp_path / "full")
    drafter.restricted(torch.arange(0, V, 2)).save_pretrained(tmp_path / "narrow")
    export_drafter(tmp_path / "narrow", name, tmp_path / "out", target=llava_target)
    assert "draft vocabulary is not written" in caplog.text
    reloaded = layout(name).load(tmp_path / "out", llava_target)
    assert reloaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(draft_outputs(drafter), draft_outputs(reloaded)))


def test_vispec_drafts_depend_on_the_image(llava_target, tmp_path):
    """The exported adaptor weights are used: the image span changes what a ViSpec drafter drafts."""
    drafter = our_drafter("vispec", llava_target, tmp_path / "ours")
    export_drafter(tmp_path / "ours", "vispec", tmp_path / "out", target=llava_target)
    reloaded = layout("vispec").load(tmp_path / "out", llava_target)
    with torch.no_grad():
        reloaded.imadpt.o_proj.weight.mul_(-1.0)
    assert not torch.equal(draft_outputs(reloaded)[1][0], draft_outputs(drafter)[1][0])  # row 0 has the image
    assert torch.equal(draft_outputs(reloaded)[0][1], draft_outputs(drafter)[0][1])  # row 1 has none


def test_smaller_released_vocabulary_is_accepted_when_the_target_extends_it(llava_target, tmp_path, caplog):
    """LLaVA-1.5 drafters trained on the original 32000-token LLaVA fit llava-hf's 32064-token model."""
    tensors = released_tensors("msd", llava_target)
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"][:120]
    folder = write_checkpoint(tmp_path / "release", released_config(vocab=120), tensors)
    assert layout("msd").load(folder, llava_target).config.vocab_size == V
    tensors["embed_tokens.weight"] = torch.randn(120, H).half()
    write_checkpoint(folder, released_config(vocab=120), tensors)
    with pytest.raises(UserError, match="vocabulary 120 != target's 128 and its embed_tokens.weight are not"):
        layout("msd").load(folder, llava_target)
    tensors["embed_tokens.weight"] = torch.randn(V, H).half()
    write_checkpoint(folder, released_config(), tensors)
    with caplog.at_level(logging.WARNING):
        layout("msd").load(folder, llava_target)
    assert "differs from the target's embeddings" in caplog.text


def eagle3_export(target: Target, folder: Path) -> Path:
    Eagle3Drafter.from_target(target).save_pretrained(folder / "ours")
    return export_drafter(folder / "ours", "eagle3", folder / "e3", target=target)


def bad_checkpoints(target: Target, tmp_path: Path) -> dict[str, tuple[str, Path, list[str]]]:
    """case -> (layout, folder, expected message parts) for checkpoints that must not load."""
    msd, vispec, config = released_tensors("msd", target), released_tensors("vispec", target), released_config()
    cases = {  # case -> (layout, config.json, weights, message parts)
        "vispec as msd": ("msd", config, vispec, [f"unexpected {', '.join(sorted(VISPEC_SHAPES))}", "'vispec' layout"]),
        "msd as vispec": ("vispec", config, msd, ["missing imadpt.k_proj.weight", "img_fc.bias", "'msd' layout"]),
        "missing key": ("msd", config, {k: v for k, v in msd.items() if k != "layers.0.mlp.up_proj.weight"},
                        ["missing layers.0.mlp.up_proj.weight"]),
        "two layers": ("msd", config, {**msd, "layers.1.mlp.up_proj.weight": torch.zeros(INTER, H)},
                       ["unexpected layers.1.mlp.up_proj.weight"]),
        "wrong shape": ("vispec", config, {**vispec, "imadpt.q": torch.zeros(NUM_Q, 2, 32)},
                        ["imadpt.q [3, 2, 32] (expected [3, 4, 16])"]),
        "hidden size": ("msd", released_config(hidden=32), msd, ["hidden size 32 != target's 64"]),
        "vocabulary": ("vispec", released_config(vocab=256), {**vispec, "embed_tokens.weight": torch.zeros(256, H)},
                       ["vocabulary 256 != target's 128"]),
        "embeddings shape": ("vispec", released_config(vocab=256), vispec,
                             ["embed_tokens.weight has shape [128, 64], config.json says [256, 64]"]),
        "no sizes": ("msd", {"model_type": "llava"}, msd, ["lacks hidden_size, intermediate_size"]),
        "rope scaling": ("msd", {**config, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, msd,
                         ["rope scaling 'linear'"]),
        "missing weights file": ("msd", config, {}, ["holds no weights"]),
    }
    folders = {case: (name, write_checkpoint(tmp_path / case, raw, tensors), parts)
               for case, (name, raw, tensors, parts) in cases.items()}
    (folders["missing weights file"][1] / "pytorch_model.bin").unlink()
    e3 = eagle3_export(target, tmp_path / "eagle3")
    return {
        **folders,
        "eagle3 as msd": ("msd", e3, ["unexpected d2t", "midlayer.hidden_norm.weight", "'eagle3' layout"]),
        "eagle3 as vispec": ("vispec", e3, ["missing imadpt.k_proj.weight", "'eagle3' layout"]),
    }


def test_bad_checkpoints_are_one_clear_error(llava_target, tmp_path):
    for case, (name, folder, parts) in bad_checkpoints(llava_target, tmp_path).items():
        with pytest.raises(UserError) as err:
            resolve_init(f"{name}:{folder}", llava_target.name).load(llava_target)
        for part in [*parts, str(folder)]:
            assert part in str(err.value), (case, str(err.value))


def test_training_init_must_match_the_drafter_type(llava_target, tmp_path):
    folder = release(tmp_path / "release", "vispec", llava_target)
    assert check_init(TrainConfig(target=llava_target.name, drafter="vispec", init=f"vispec:{folder}")) is not None
    with pytest.raises(UserError, match="holds a 'vispec' drafter, not 'msd'"):
        check_init(TrainConfig(target=llava_target.name, drafter="msd", init=str(folder)))


def test_init_released_drafter_from_the_hf_cache(llava_target, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for name, target_name, repo_id in [("vispec", "llava-1.5-7b", "JLKang/ViSpec-llava-1.5-7b-hf"),
                                       ("vispec", "llava-hf/llava-1.5-7b-hf", "JLKang/ViSpec-llava-1.5-7b-hf"),
                                       ("msd", "llava-1.5-13b", "lucylyn/MSD-LLaVA1.5-13B"),
                                       ("msd", "llava-hf/llava-1.5-7b-hf", "lucylyn/MSD-LLaVA1.5-7B")]:
        with pytest.raises(UserError, match=f"is {repo_id}, which is not in the local HF cache"):
            resolve_init(name, target_name)
    with pytest.raises(UserError, match="no released vispec drafter is known for target 'smol-llava'.*vispec:PATH"):
        resolve_init("vispec", "smol-llava")
    snapshot = fake_hf_cache(tmp_path / "hub", "JLKang/ViSpec-llava-1.5-7b-hf",
                             release(tmp_path / "release", "vispec", llava_target))
    source = resolve_init("vispec", "llava-1.5-7b")
    assert source.layout is layout("vispec") and source.path == snapshot
    drafter = source.load(llava_target)
    assert torch.equal(drafter.imadpt.q, released_tensors("vispec", llava_target)["imadpt.q"].float())


def test_export_command(llava_target, tmp_path, capsys):
    our_drafter("vispec", llava_target, tmp_path / "vispec")  # records the target folder as its target
    out = tmp_path / "out"
    assert cli_main(["export", "--drafter", str(tmp_path / "vispec"), "--format", "vispec", str(out)]) == 0
    assert "vispec drafter written to" in capsys.readouterr().out
    assert layout("vispec").detect(json.loads((out / "config.json").read_text()),
                                   set(torch.load(out / "pytorch_model.bin", weights_only=True)))
    our_drafter("msd", llava_target, tmp_path / "msd")
    assert cli_main(["export", "--drafter", str(tmp_path / "msd"), "--format", "vispec", str(tmp_path / "x")]) == 2
    assert "--format vispec holds 'vispec' drafters" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_init_names_a_shipped_drafter_of_the_target():
    """`--init eagle3-ce` (or `default`) continues a drafter shipped for the target, its files verified first."""
    for drafter in [d for d in list_shipped() if d.target == "smollm2-135m"]:
        source = resolve_init(drafter.name, "smollm2-135m")
        assert source.path == drafter.folder and source.layout is layout("hf")
    assert resolve_init("default", "smollm2-135m").path == default_drafter("smollm2-135m").folder
    with pytest.raises(UserError, match=r"a shipped drafter of 'smollm2-135m' \(eagle3-accept, "):
        resolve_init("no-such-drafter", "smollm2-135m")
