"""The `eagle3` checkpoint layout: EAGLE-3 drafters as vLLM and SGLang load them (and as released).

config.json: `architectures: ["LlamaForCausalLMEagle3"]`, Llama sizes of the one draft layer,
`vocab_size` (the target's), `draft_vocab_size`, `target_hidden_size`,
`eagle_config.eagle_aux_hidden_state_layer_ids`, and, written explicitly because readers' defaults differ,
`norm_before_residual: false` (our residual is the hidden state BEFORE hidden_norm, as EAGLE-3's own
code; vLLM 0.32 reads the key as false when absent here, but true when absent in the speculators format)
and `max_position_embeddings` at least the target's (vLLM caps the context at the draft's). Weights (no
embeddings: they are the target's):
    fc.weight [H, 3H]; midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]; midlayer.self_attn.o_proj.weight;
    midlayer.mlp.{gate,up,down}_proj.weight; midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}
    .weight; norm.weight; lm_head.weight [Vd, H]; d2t [Vd] int64 offsets (draft id i is target id
    i + d2t[i]); t2d [V] bool (target id is in the draft vocabulary).
Our `Eagle3Drafter` uses these very names and the same d2t/t2d meaning, so the key map is the identity.

The `speculators` layout (PyPI `speculators` 0.9, whose `Eagle3DraftModel` loads it with
`from_pretrained`): config.json with `speculators_model_type: "eagle3"`, `architectures:
["Eagle3Speculator"]`, `transformer_layer_config` (a full one-layer Llama config), `draft_vocab_size`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (distinct ids: speculators refuses repeats),
`norm_before_residual`, `speculators_config` (algorithm eagle3, a greedy proposal of 5 tokens,
the verifier's folder and architectures); weights as above with `layers.0.*` for `midlayer.*`, plus the
target's `embed_tokens.weight` so that the folder loads without the verifier's weights.

Feature layer ids: ours index the target's HF `hidden_states` (id k = the input of decoder layer k),
which is how vLLM reads `eagle_aux_hidden_state_layer_ids` and how SGLang reads them unless the first
id is 1. Ids starting at 1 follow SpecForge's "output of layer k" convention (SGLang adds 1 to them), so
on import those are shifted by one, and a drafter whose first id is 1 cannot be exported unambiguously.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import save_file
from torch import Tensor

from mmvsd.checkpoints import CONFIG_FILE, read_config, read_tensors
from mmvsd.drafters.eagle3 import Eagle3Config, Eagle3Drafter, check_one_layer
from mmvsd.errors import UserError
from mmvsd.layouts.base import Layout, NotThisLayout, load_checked_state
from mmvsd.target import default_aux_layer_ids
from mmvsd.target_loader import resolve_target_folder

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
REQUIRED_CONFIG = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
EMBEDDINGS = "embed_tokens.weight"  # included by some releases; ours come from the target
SUPPORTED_ROPE = (None, "default")


class Eagle3Layout(Layout):
    """EAGLE-3 checkpoints for vLLM / SGLang, and the ones EAGLE's authors released."""

    name = "eagle3"
    drafter_type = "eagle3"
    released: ClassVar[dict[str, str]] = {  # target name (an HF id, as `--target` takes it) -> released EAGLE-3 drafter
        "lmsys/vicuna-13b-v1.3": "yuhuili/EAGLE3-Vicuna1.3-13B",
        "meta-llama/Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "meta-llama/Meta-Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "meta-llama/Llama-3.3-70B-Instruct": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B",
    }

    serving_note = "vLLM and SGLang serve only EAGLE-3-style drafters"

    def export(self, drafter: Eagle3Drafter, out_dir: Path) -> None:
        """config.json + model.safetensors as vLLM / SGLang read them."""
        self.write(drafter, out_dir, drafter.config.max_position_embeddings)

    def export_for(self, drafter: Eagle3Drafter, out_dir: Path, target) -> None:
        """As `export`, with `max_position_embeddings` raised to the target's context window."""
        self.write(drafter, out_dir, max(drafter.config.max_position_embeddings, target_positions(target)))

    def write(self, drafter: Eagle3Drafter, out_dir: Path, max_positions: int) -> None:
        config = released_config(drafter.config, next(drafter.parameters()).dtype, max_positions)
        tensors = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
        (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})

    def load(self, path: Path, target) -> Eagle3Drafter:
        """Read an EAGLE-3 folder (safetensors or pytorch_model.bin) for `target`; embeddings from the target."""
        path = Path(path)
        return self.load_raw(path, read_config(path), target)

    def load_raw(self, path: Path, raw: dict, target) -> Eagle3Drafter:
        """Our drafter from an EAGLE-3 config dict (research layout keys) and the folder's weights."""
        state = normalise_keys(read_tensors(path))
        if has_foreign_keys(set(state)) or not Eagle3Layout.detect(self, raw, set(state)):
            raise NotThisLayout(f"{path} is not an EAGLE-3 checkpoint", raw, set(state),
                                foreign_layout(set(state), raw))
        config = eagle3_config(raw, target, path)
        drafter = Eagle3Drafter(config, target.input_embeddings)
        state = complete_state(state, config, target, path)
        check_state(state, drafter, path)
        return load_checked_state(drafter, state, target)

    def detect(self, config: dict, keys: set[str]) -> bool:
        if config.get("speculators_model_type"):
            return False  # the speculators layout (below)
        keys = set(normalise_keys(dict.fromkeys(keys)))
        return "midlayer.hidden_norm.weight" in keys or ARCHITECTURE in (config.get("architectures") or [])


def target_positions(target) -> int:
    """The target's context window (0 when it does not say)."""
    positions = getattr(target, "max_positions", 0) or 0
    return positions if positions < 1 << 30 else 0


def released_config(config: Eagle3Config, dtype: torch.dtype, max_positions: int | None = None) -> dict:
    """The config.json vLLM / SGLang expect for an EAGLE-3 drafter with our `config`."""
    check_one_layer(config, "the eagle3 and speculators layouts' config")
    if config.aux_layer_ids and config.aux_layer_ids[0] == 1:
        raise UserError(f"feature layers {config.aux_layer_ids} start at 1, which SGLang reads as 'output of layer 1' "
                        f"(one layer later than ours); the eagle3 layout cannot hold them unambiguously")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,  # transformers 4 style; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": max(max_positions or 0, config.max_position_embeddings),
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,  # residual = hidden before hidden_norm (see the module docstring)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def normalise_keys(state: dict) -> dict:
    """Accept the naming variants seen in the wild: a `model.` prefix, and `layers.0.` for `midlayer.`."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if "layers.0.hidden_norm.weight" in state:  # vLLM's internal name of the EAGLE-3 layer
        state = {("midlayer." + k.removeprefix("layers.0.")) if k.startswith("layers.0.") else k: v
                 for k, v in state.items()}
    return state


def has_foreign_keys(keys: set[str]) -> bool:
    """Keys of the EAGLE-1 family (decoder layers under `layers.`, ViSpec's image adaptor)."""
    return any(k.startswith(("layers.", "imadpt.", "img_fc.")) for k in keys)


def foreign_layout(keys: set[str], config: dict) -> str:
    """What a non-EAGLE-3 checkpoint that no registered layout recognises seems to be, for the error message."""
    if any(k.startswith("imadpt.") for k in keys):
        return "a ViSpec drafter (EAGLE-1 layout with an image adaptor, imadpt.* keys)"
    if any(k.startswith("layers.0.") for k in keys):
        family = "an MSD drafter, " if config.get("model_type") == "llava" else ""
        return f"{family}the EAGLE-1 layout (layers.0.* keys, no midlayer.hidden_norm)"
    return f"an unknown layout (keys: {', '.join(sorted(keys)[:8])}{', ...' if len(keys) > 8 else ''})"


def eagle3_config(raw: dict, target, path: Path) -> Eagle3Config:
    """Our Eagle3Config from a released config.json; UserError if unsupported or not made for `target`."""
    missing = [k for k in REQUIRED_CONFIG if k not in raw]
    if missing:
        raise UserError(f"{path / CONFIG_FILE} lacks {', '.join(missing)}")
    check_supported(raw, path)
    heads = raw["num_attention_heads"]
    config = Eagle3Config(
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        vocab_size=raw["vocab_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
        aux_layer_ids=aux_layer_ids(raw, target.num_layers),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_settings(raw).get("rope_theta", 10000.0)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        target_name=target.name,
    )
    check_fits_target(config, target, path)
    return config


def rope_settings(raw: dict) -> dict:
    """Rope type and theta from either config style (transformers 5 `rope_parameters` or 4's keys)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "rope_theta" in raw:
        params.setdefault("rope_theta", raw["rope_theta"])
    params.setdefault("rope_type", params.get("type"))
    return params


def check_supported(raw: dict, path: Path) -> None:
    """Refuse what our one-layer, plain-rope, bias-free drafter cannot compute the same way."""
    problems = []
    layers = next((raw[key] for key in ("num_hidden_layers", "num_layers") if raw.get(key, 1) != 1), 1)
    if layers != 1:  # released configs say num_hidden_layers; mmvsd's own folders num_layers
        problems.append(f"{layers} draft layers (this format holds 1; a multi-layer folder of mmvsd's loads as "
                        f"the plain folder, the hf layout)")
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {raw['hidden_act']!r} (ours is silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        problems.append("bias terms in the draft layer")
    if raw.get("norm_before_residual"):
        problems.append("norm_before_residual (ours keeps the hidden state before hidden_norm as the residual)")
    if rope_settings(raw).get("rope_type") not in SUPPORTED_ROPE:
        problems.append(f"rope scaling {rope_settings(raw)['rope_type']!r} (ours is plain rope)")
    if problems:
        raise UserError(f"{path} is an EAGLE-3 drafter our implementation does not support: {'; '.join(problems)}")


def aux_layer_ids(raw: dict, num_layers: int) -> list[int]:
    """Target `hidden_states` indices the drafter reads (see the module docstring for the conventions)."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids or raw.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return list(default_aux_layer_ids(num_layers))
    if ids[0] == 1:  # SpecForge's "output of layer k" ids
        return [i + 1 for i in ids]
    return list(ids)


def check_fits_target(config: Eagle3Config, target, path: Path) -> None:
    """Sizes and feature layers must match the target (embeddings and features come from it)."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {target.hidden_size} "
                        f"(the draft layer reads the target's embeddings)")
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != target's {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} != target's {target.vocab_size}")
    if config.draft_vocab_size > config.vocab_size:
        problems.append(f"draft vocabulary {config.draft_vocab_size} larger than the vocabulary {config.vocab_size}")
    if list(config.aux_layer_ids) != list(target.aux_layer_ids):
        problems.append(f"reads target hidden states {config.aux_layer_ids}, target gives {list(target.aux_layer_ids)}")
    if problems:
        raise UserError(f"EAGLE-3 drafter {path} does not fit target {target.name!r}: " + "; ".join(problems))


def complete_state(state: dict[str, Tensor], config: Eagle3Config, target, path: Path) -> dict[str, Tensor]:
    """Drop optional embeddings; fill d2t (full vocab only) and t2d when a release leaves them out."""
    state = dict(state)
    embeddings = state.pop(EMBEDDINGS, None)
    if embeddings is not None:
        check_embeddings(embeddings, target, path)
    if "d2t" not in state and config.draft_vocab_size == config.vocab_size:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)  # identity map
    if "d2t" in state:
        target_ids = check_d2t(state["d2t"], config, path)  # [Vd]
        derived = torch.zeros(config.vocab_size, dtype=torch.bool)
        derived[target_ids] = True
        if "t2d" in state and not torch.equal(state["t2d"].to(torch.bool), derived):
            raise UserError(f"{path}: t2d does not mark the target ids that d2t maps the draft vocabulary to")
        state["t2d"] = derived
    return state


def check_d2t(d2t: Tensor, config: Eagle3Config, path: Path) -> Tensor:
    """[Vd] target ids of the draft vocabulary (i + d2t[i]); UserError unless distinct and in range."""
    if d2t.shape != (config.draft_vocab_size,) or d2t.is_floating_point():
        raise UserError(f"{path}: d2t must be integer offsets of shape [{config.draft_vocab_size}], "
                        f"got {d2t.dtype} {list(d2t.shape)}")
    target_ids = torch.arange(config.draft_vocab_size) + d2t.long()
    if target_ids.min() < 0 or target_ids.max() >= config.vocab_size or target_ids.unique().numel() != d2t.numel():
        raise UserError(f"{path}: d2t maps draft ids outside the target vocabulary [0, {config.vocab_size}) or onto "
                        f"the same target id twice (d2t holds offsets: target id = i + d2t[i])")
    return target_ids


def check_embeddings(embeddings: Tensor, target, path: Path) -> None:
    """A release's own embeddings are dropped for the target's; say so when they differ."""
    ours = target.input_embeddings.weight.detach()  # [V, H]
    if embeddings.shape != ours.shape:
        raise UserError(f"{path}: {EMBEDDINGS} has shape {list(embeddings.shape)}, target's is {list(ours.shape)}")
    rows = torch.linspace(0, ours.shape[0] - 1, min(1024, ours.shape[0])).long()  # a sample keeps memory small
    if not torch.allclose(embeddings[rows].float(), ours[rows.to(ours.device)].float().cpu(), atol=1e-2, rtol=1e-2):
        logger.warning("%s: %s differs from the target's embeddings; the target's are used", path, EMBEDDINGS)


def check_state(state: dict[str, Tensor], drafter: Eagle3Drafter, path: Path) -> None:
    """Every key present, none extra, every shape right: one UserError listing all that is wrong."""
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k} {list(state[k].shape)} (expected {list(expected[k].shape)})"
              for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)}")
    if shapes:
        problems.append(f"wrong shapes: {'; '.join(shapes)}")
    if problems:
        raise UserError(f"EAGLE-3 weights in {path} do not match the layout: " + " | ".join(problems))


SPECULATORS_VERSION = "0.9.0"
SPECULATORS_UNSUPPORTED = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class SpeculatorsLayout(Eagle3Layout):
    """EAGLE-3 drafters in the `speculators` package's format (see the module docstring)."""

    name = "speculators"
    released: ClassVar[dict[str, str]] = {}
    detect_first = True  # its weights also match the EAGLE-1 family's `layers.0.*` patterns

    def export_for(self, drafter: Eagle3Drafter, out_dir: Path, target) -> None:
        config = speculators_config(drafter.config, next(drafter.parameters()).dtype, target)
        tensors = {speculators_key(k): v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
        tensors[EMBEDDINGS] = drafter.embed_tokens.weight.detach().to("cpu", tensors["fc.weight"].dtype).contiguous()
        (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})

    def export(self, drafter: Eagle3Drafter, out_dir: Path) -> None:
        raise UserError("the speculators layout records the verifier (target): export with a target")

    def load(self, path: Path, target) -> Eagle3Drafter:
        path = Path(path)
        raw = read_config(path)
        layer = raw.get("transformer_layer_config") or {}
        flags = [k for k in SPECULATORS_UNSUPPORTED if raw.get(k)]
        if flags or layer.get("model_type", "llama") != "llama":
            raise UserError(f"{path} is a speculators EAGLE-3 drafter our implementation does not support "
                            f"({', '.join(flags) or 'a ' + str(layer.get('model_type')) + ' layer'})")
        research = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"),
                    "target_hidden_size": raw.get("target_hidden_size"),
                    "eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids")}
        return self.load_raw(path, {k: v for k, v in research.items() if v is not None}, target)

    def detect(self, config: dict, keys: set[str]) -> bool:
        return config.get("speculators_model_type") == "eagle3"


def speculators_key(name: str) -> str:
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def speculators_config(config: Eagle3Config, dtype: torch.dtype, target) -> dict:
    """config.json of the speculators package's Eagle3 format for our drafter and its target (verifier)."""
    if len(set(config.aux_layer_ids)) != len(config.aux_layer_ids):
        raise UserError(f"feature layers {config.aux_layer_ids} repeat a layer, which speculators refuses "
                        f"(its target_layer_ids must be distinct); use --format eagle3 for vLLM / SGLang")
    research = released_config(config, dtype, target_positions(target))
    layer = {k: research[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                      "head_dim", "hidden_act", "attention_bias", "mlp_bias", "rms_norm_eps",
                                      "rope_parameters", "max_position_embeddings", "vocab_size",
                                      "tie_word_embeddings")}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1)
    verifier = verifier_folder(target)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(verifier)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "torch_dtype": research["torch_dtype"],
    }


def verifier_folder(target) -> str:
    """Where speculators finds the verifier's config: the target's HF folder (its name if none is known)."""
    try:
        return str(resolve_target_folder(target.name).resolve())
    except UserError:
        return target.name


def verifier_architectures(verifier: str) -> list[str]:
    config_file = Path(verifier) / CONFIG_FILE
    if config_file.is_file():
        return list(json.loads(config_file.read_text()).get("architectures") or [])
    return ["LlamaForCausalLM"]
