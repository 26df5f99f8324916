"""The `msd` and `vispec` checkpoint layouts: EAGLE-1-style drafters as MSD's and ViSpec's authors release them.

Both are EAGLE-1 checkpoints: config.json in the style of the original LLaVA config (`model_type: "llava"`,
flat Llama keys; a nested `text_config` is read too) and `pytorch_model.bin` with
    fc.weight [H, 2H] (+ fc.bias); layers.0.self_attn.{q,k,v,o}_proj.weight; layers.0.mlp.{gate,up,down}_proj.weight;
    layers.0.post_attention_layernorm.weight; embed_tokens.weight [V, H] (the target's frozen embeddings)
and for ViSpec, its image adaptor and global-feature projection:
    imadpt.q [num_q, heads, head_dim]; imadpt.{k,v,o}_proj.weight; img_fc.weight [H, 2H] (+ img_fc.bias).
Our `MSDDrafter` / `ViSpecDrafter` use these very names, so the key map is the identity. Loading is strict:
every key present, none extra, every shape right. num_q is not in ViSpec's config.json: it is imadpt.q's
first dimension.

Embeddings: ours are always the target's, so `embed_tokens.weight` is checked and dropped. Values that
differ from the target's only warn (a release may store them in another precision); a shape that does
not fit is an error. The target's vocabulary may EXTEND the drafter's (LLaVA-1.5 releases trained on the
original LLaVA have 32000 tokens; llava-hf appends `<image>` and padding up to 32064): a smaller vocabulary
is accepted when its embeddings are the first rows of the target's, since the drafter has no LM head of
its own. Exports write the target's whole embedding matrix and vocabulary size.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from mmvsd.checkpoints import CONFIG_FILE, read_config, read_tensors
from mmvsd.drafters.eagle1 import Eagle1Config, Eagle1Drafter
from mmvsd.drafters.eagle3_layout import EMBEDDINGS, REQUIRED_CONFIG, SUPPORTED_ROPE, rope_settings
from mmvsd.drafters.msd import MSDDrafter
from mmvsd.drafters.vispec import ViSpecDrafter
from mmvsd.errors import UserError
from mmvsd.layouts.base import Layout, NotThisLayout, load_checked_state

logger = logging.getLogger(__name__)

WEIGHTS = "pytorch_model.bin"
ARCHITECTURE = "LlavaLlamaForCausalLM"  # what the original LLaVA configs (which MSD's copies) name
EAGLE1_KEYS = (
    "fc.weight", *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")), "layers.0.post_attention_layernorm.weight",
)
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")  # written as our config has them
OPTIONAL_KEYS = ("rms_norm_eps", "max_position_embeddings")  # read when present, else our defaults


class Eagle1Layout(Layout):
    """What MSD's and ViSpec's releases share; subclasses name their drafter and extra weights."""

    drafter_class: ClassVar[type[Eagle1Drafter]]
    description: ClassVar[str] = ""
    extra_keys: ClassVar[tuple[str, ...]] = ()  # required beyond EAGLE-1's
    bias_keys: ClassVar[tuple[str, ...]] = ("fc.bias",)  # all present or all absent (config `bias`)
    foreign_prefixes: ClassVar[tuple[str, ...]] = ("midlayer.",)  # keys this layout never has

    def export(self, drafter: Eagle1Drafter, out_dir: Path) -> None:
        """config.json + pytorch_model.bin as released, with the target's embeddings included."""
        config = {**released_config(drafter.config, next(drafter.parameters()).dtype), **self.extra_config(drafter)}
        if drafter.config.draft_vocab_size is not None:  # mmvsd's decode-time narrowing: the weights are the same
            logger.warning("mmvsd: the %s layout drafts over the whole vocabulary: this drafter's %d-token draft "
                           "vocabulary is not written", self.name, drafter.config.draft_vocab_size)
        tensors = {EMBEDDINGS: drafter.embed_tokens.weight, **drafter.state_dict()}
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items() if k != "draft_ids"}
        (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        torch.save(tensors, out_dir / WEIGHTS)

    def load(self, path: Path, target) -> Eagle1Drafter:
        """Read a released folder (pytorch_model.bin or safetensors, sharded or not) for `target`."""
        path = Path(path)
        raw = read_config(path)
        state = read_tensors(path)
        self.check_keys(raw, set(state), path)
        text = text_config(raw, path)
        embeddings = state.pop(EMBEDDINGS, None)
        check_fits_target(text, embeddings, target, path)
        config = self.drafter_class.config_class(
            **config_sizes(text), vocab_size=target.vocab_size, fc_bias="fc.bias" in state,
            max_images=self.drafter_class.default_max_images, target_name=target.name,
            **self.extra_sizes(state, raw, path),
        )
        drafter = self.drafter_class(config, target.input_embeddings, target.model.get_output_embeddings())
        check_shapes(state, drafter, path)
        return load_checked_state(drafter, state, target)

    def detect(self, config: dict, keys: set[str]) -> bool:
        required = {*EAGLE1_KEYS, *self.extra_keys}
        return required <= keys and not any(k.startswith(self.foreign_prefixes) for k in keys)

    def expected_keys(self, bias: bool) -> set[str]:
        """The weight names of this layout (embeddings aside), with or without the bias terms."""
        return {*EAGLE1_KEYS, *self.extra_keys, *(self.bias_keys if bias else ())}

    def check_keys(self, raw: dict, keys: set[str], path: Path) -> None:
        """Every weight name of the layout present and none extra: one UserError listing what is not."""
        expected = self.expected_keys("fc.bias" in keys)
        missing, unexpected = sorted(expected - keys), sorted(keys - expected - {EMBEDDINGS})
        if not missing and not unexpected:
            return
        problems = [f"{label} {', '.join(names)}" for label, names in (("missing", missing), ("unexpected", unexpected))
                    if names]
        raise NotThisLayout(f"{path} does not hold {self.description}: " + " | ".join(problems), raw, keys)

    def extra_sizes(self, state: dict[str, Tensor], raw: dict, path: Path) -> dict:
        """Config fields beyond the shared ones, from the weights or the released config.json (`raw`)."""
        return {}

    def extra_config(self, drafter: Eagle1Drafter) -> dict:
        """config.json keys beyond the shared ones."""
        return {}


class MSDLayout(Eagle1Layout):
    """MSD's releases (lucylyn/MSD-LLaVA1.5-*): plain EAGLE-1 weights for a LLaVA target."""

    name = "msd"
    drafter_type = "msd"
    drafter_class = MSDDrafter
    description = "an MSD drafter (EAGLE-1 layout)"
    foreign_prefixes = ("midlayer.", "imadpt.", "img_fc.")
    released: ClassVar[dict[str, str]] = {  # target name (ours or its HF id) -> released MSD drafter
        "llava-1.5-7b": "lucylyn/MSD-LLaVA1.5-7B",
        "llava-hf/llava-1.5-7b-hf": "lucylyn/MSD-LLaVA1.5-7B",
        "llava-1.5-13b": "lucylyn/MSD-LLaVA1.5-13B",
        "llava-hf/llava-1.5-13b-hf": "lucylyn/MSD-LLaVA1.5-13B",
    }

    def extra_sizes(self, state: dict[str, Tensor], raw: dict, path: Path) -> dict:
        """MSD's releases read the image embeddings raw; an export of ours records its `media_rms`."""
        return {"media_rms": raw.get("media_rms")}

    def extra_config(self, drafter: MSDDrafter) -> dict:
        rms = drafter.config.media_rms
        return {} if rms is None else {"media_rms": rms}  # read by mmvsd only: MSD's own code ignores it


class ViSpecLayout(Eagle1Layout):
    """ViSpec's releases (JLKang/ViSpec-*): EAGLE-1 weights plus the image adaptor and img_fc."""

    name = "vispec"
    drafter_type = "vispec"
    drafter_class = ViSpecDrafter
    description = "a ViSpec drafter (EAGLE-1 layout with imadpt.* and img_fc.*)"
    extra_keys = ("imadpt.q", "imadpt.k_proj.weight", "imadpt.v_proj.weight", "imadpt.o_proj.weight", "img_fc.weight")
    bias_keys = ("fc.bias", "img_fc.bias")
    released: ClassVar[dict[str, str]] = {
        "llava-1.5-7b": "JLKang/ViSpec-llava-1.5-7b-hf",
        "llava-hf/llava-1.5-7b-hf": "JLKang/ViSpec-llava-1.5-7b-hf",
        # ViSpec's authors released no LLaVA-1.5-13B drafter: their LLaVA-1.6-Vicuna-13B one reads the same
        # Vicuna-13B language model (its widths are checked against the target when it loads)
        "llava-1.5-13b": "JLKang/ViSpec-llava-v1.6-vicuna-13b-hf",
        "llava-hf/llava-1.5-13b-hf": "JLKang/ViSpec-llava-v1.6-vicuna-13b-hf",
    }
    released_notes: ClassVar[dict[str, str]] = dict.fromkeys(
        ("llava-1.5-13b", "llava-hf/llava-1.5-13b-hf"),
        "ViSpec's authors released no LLaVA-1.5-13B drafter; starting from their LLaVA-1.6-Vicuna-13B one "
        "(JLKang/ViSpec-llava-v1.6-vicuna-13b-hf), which reads the same Vicuna-13B language model (hidden 5120, "
        "40 layers); its widths and vocabulary are checked against the target before training")

    def extra_sizes(self, state: dict[str, Tensor], raw: dict, path: Path) -> dict:
        queries = state["imadpt.q"]
        if queries.ndim != 3:
            raise UserError(f"{path}: imadpt.q must be [num_q, heads, head_dim], got {list(queries.shape)}")
        return {"num_q": queries.shape[0]}

    def extra_config(self, drafter: ViSpecDrafter) -> dict:
        return {"num_q": drafter.config.num_q}  # informative only: loading reads imadpt.q


def released_config(config: Eagle1Config, dtype: torch.dtype) -> dict:
    """The shared part of the config.json MSD and ViSpec release (one draft layer, LLaVA-style keys)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llava",
        "num_hidden_layers": 1,
        **{key: getattr(config, key) for key in SIZE_KEYS},
        "hidden_act": "silu",
        "rope_scaling": None,
        "bias": config.fc_bias,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def text_config(raw: dict, path: Path) -> dict:
    """The language-model keys of a released config: flat, or under a LLaVA-style `text_config`."""
    text = {**raw, **(raw.get("text_config") or {})}
    missing = [k for k in REQUIRED_CONFIG if k not in text]
    if missing:
        raise UserError(f"{path / CONFIG_FILE} lacks {', '.join(missing)}")
    problems = []
    if text.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {text['hidden_act']!r} (ours is silu)")
    if rope_settings(text).get("rope_type") not in SUPPORTED_ROPE:
        problems.append(f"rope scaling {rope_settings(text)['rope_type']!r} (ours is plain rope)")
    if problems:
        raise UserError(f"{path} is a drafter our EAGLE-1 implementation does not support: {'; '.join(problems)}")
    return text


def config_sizes(text: dict) -> dict:
    """Our config's size fields from a released config's language-model keys."""
    heads = text["num_attention_heads"]
    sizes = {
        "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": text.get("num_key_value_heads") or heads,
        "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
        **{key: text[key] for key in OPTIONAL_KEYS if text.get(key) is not None},
    }
    theta = rope_settings(text).get("rope_theta")
    return sizes if theta is None else {**sizes, "rope_theta": float(theta)}


def check_fits_target(text: dict, embeddings: Tensor | None, target, path: Path) -> None:
    """Hidden size must be the target's; the target's vocabulary must be the drafter's or extend it."""
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    if hidden != target.hidden_size:
        raise UserError(f"{path} does not fit target {target.name!r}: hidden size {hidden} != target's "
                        f"{target.hidden_size} (the drafter reads the target's hidden states)")
    if embeddings is not None and list(embeddings.shape) != [vocab, hidden]:
        raise UserError(f"{path}: {EMBEDDINGS} has shape {list(embeddings.shape)}, "
                        f"config.json says [{vocab}, {hidden}]")
    ours = target.input_embeddings.weight.detach()  # [V, H]
    same = embeddings is None or (vocab <= ours.shape[0] and same_rows(embeddings, ours[:vocab]))
    if vocab == target.vocab_size:
        if not same:
            logger.warning("%s: %s differs from the target's embeddings; the target's are used", path, EMBEDDINGS)
        return
    if vocab < target.vocab_size and embeddings is not None and same:
        logger.info("%s: vocabulary %d is the first part of the target's %d (same embeddings)", path, vocab,
                    target.vocab_size)
        return
    why = "" if vocab > target.vocab_size else f" and its {EMBEDDINGS} are not the first rows of the target's"
    raise UserError(f"{path} does not fit target {target.name!r}: vocabulary {vocab} != target's "
                    f"{target.vocab_size}{why}")


def same_rows(released: Tensor, ours: Tensor) -> bool:
    """Whether two [n, H] embedding matrices agree (on a sample of rows, to half-precision tolerance)."""
    rows = torch.linspace(0, ours.shape[0] - 1, min(1024, ours.shape[0])).long()
    return torch.allclose(released[rows].float(), ours[rows.to(ours.device)].float().cpu(), atol=1e-2, rtol=1e-2)


def check_shapes(state: dict[str, Tensor], drafter: Eagle1Drafter, path: Path) -> None:
    """Every tensor the shape our drafter (built from config.json) expects."""
    expected = drafter.state_dict()
    wrong = [f"{k} {list(v.shape)} (expected {list(expected[k].shape)})" for k, v in sorted(state.items())
             if v.shape != expected[k].shape]
    if wrong:
        raise UserError(f"weights in {path} do not match its {CONFIG_FILE}: wrong shapes: {'; '.join(wrong)}")
