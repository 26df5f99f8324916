"""EAGLE-3 drafter: fc over low/mid/high target features, one decoder layer (or more), reduced draft vocab.

Layout (matches the EAGLE-3 checkpoints that vLLM and SGLang load, minus their config keys):
    fc            [H, 3H]   target features -> hidden
    midlayer.*    one Llama decoder layer whose q/k/v read [input_layernorm(emb) ; hidden_norm(h)] (2H)
    extra_layers.i.*  with num_layers > 1: plain Llama decoder layers on midlayer's output (as speculators' multi-
                  layer EAGLE-3 stacks them); the hidden state carried to the next draft step is the last one's
    norm          final RMSNorm
    lm_head       [Vd, H]   logits over the draft vocabulary
    d2t           [Vd] long draft id i is target id i + d2t[i];  t2d [V] bool: target id in draft vocab
Token embeddings are borrowed from the target and never saved.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from mmvsd.decoding.kv import RaggedCache
from mmvsd.drafter_base import (
    Drafter,
    PairMedia,
    check_fits_target,
    load_drafter_weights,
    read_drafter_config,
    save_drafter_folder,
)
from mmvsd.drafters.layers import MLP, Attention, RMSNorm, layer_sizes
from mmvsd.errors import UserError


@dataclass
class Eagle3Config:
    """Sizes of an EAGLE-3 drafter and the target it was made for."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_name: str = ""
    num_layers: int = 1  # decoder layers: midlayer, then num_layers - 1 plain ones

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, num_layers: int = 1) -> Eagle3Config:
        """A drafter config sized like `target`'s decoder layers."""
        return cls(
            **layer_sizes(target),
            draft_vocab_size=min(draft_vocab_size or target.vocab_size, target.vocab_size),
            target_hidden_size=target.hidden_size,
            aux_layer_ids=list(target.aux_layer_ids),
            num_layers=num_layers,
        )


def check_one_layer(config: Eagle3Config, where: str) -> None:
    """Refuse a multi-layer drafter where a format holds EAGLE-3's one layer."""
    if config.num_layers != 1:
        raise UserError(f"{where} holds one EAGLE-3 decoder layer; this drafter has {config.num_layers} "
                        f"(num_layers): decode it with mmvsd")


class MidLayer(nn.Module):
    """EAGLE-3's decoder layer: attention reads [normed embedding ; normed hidden]."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.hidden_norm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.self_attn = Attention(config, 2 * size)
        self.mlp = MLP(size, config.intermediate_size)

    def forward(
        self, embeds: Tensor, hidden: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None
    ) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, positions, attention_mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderLayer(nn.Module):
    """A plain Llama decoder layer: the second and later layers of a multi-layer EAGLE-3 drafter."""

    def __init__(self, config: Eagle3Config, layer_idx: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.self_attn = Attention(config, size, layer_idx)
        self.mlp = MLP(size, config.intermediate_size)

    def forward(self, hidden: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None) -> Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, attention_mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(Drafter):
    """The EAGLE-3 draft model."""

    drafter_type = "eagle3"
    stacks_layers = True

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.config = config
        self.__dict__["embed_tokens"] = embed_tokens  # borrowed from the target, not a parameter
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        if config.num_layers < 1:
            raise UserError(f"an EAGLE-3 drafter has at least one decoder layer, not {config.num_layers}")
        self.extra_layers = nn.ModuleList(DecoderLayer(config, i) for i in range(1, config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(config.draft_vocab_size))

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = 32000, seed: int = 0,
                    num_layers: int = 1) -> Eagle3Drafter:
        """A freshly initialised drafter sized for `target` (draft vocab: its first ids until trained)."""
        with torch.random.fork_rng(devices=[]):  # a local stream: the caller's global RNG is left as it was
            torch.manual_seed(seed)
            drafter = cls(Eagle3Config.from_target(target, draft_vocab_size, num_layers), target.input_embeddings)
            drafter.apply(init_linear_weights)
        return drafter.to(device=target.device, dtype=target.dtype)

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Use `target_ids` ([Vd], e.g. the most frequent tokens) as the draft vocabulary."""
        target_ids = torch.sort(target_ids.to(torch.long)).values
        if target_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} draft tokens, got {target_ids.numel()}")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel()))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Draft LM head = the target's LM-head rows of the draft vocabulary, final norm = the target's:
        the drafter's output space starts as the target's own, so training spends no steps finding it."""
        head = target.model.get_output_embeddings().weight
        self.lm_head.weight.copy_(head[self.draft_vocab_target_ids().to(head.device)].to(self.lm_head.weight))
        final_norm = getattr(target.model.get_decoder(), "norm", None)
        weight = getattr(final_norm, "weight", None)
        if weight is not None and weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(weight.to(self.norm.weight))

    @torch.no_grad()
    def init_layers_from_target(self, target) -> None:
        """Draft decoder layers = the target's last `num_layers` decoder layers, where shapes allow: midlayer's
        q/k/v take the target layer's weights on their hidden half and zeros on the embedding half (an input the
        target's layer does not have), its hidden_norm the layer's input norm; the later layers are plain copies.
        fc, the head and the embedding norm stay as they are; q/k/v biases (Qwen2's) have no place here."""
        layers = list(target.model.get_decoder().layers)
        if self.config.num_layers > len(layers):
            raise UserError(f"draft_layers={self.config.num_layers}: the target has {len(layers)} decoder layers to "
                            f"start them from")
        theirs = layers[-self.config.num_layers:]
        first, hidden = self.midlayer, self.config.hidden_size
        state = _layer_state(theirs[0], set(first.state_dict()))
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(first.self_attn, name).weight
            weight.zero_()
            _copy(weight[:, hidden:], state[f"self_attn.{name}.weight"], f"{name} of layer 0")
        _copy(first.hidden_norm.weight, state["input_layernorm.weight"], "the input norm of layer 0")
        for key, weight in first.state_dict().items():
            if not key.startswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "hidden_norm",
                                   "input_layernorm")):
                _copy(weight, state.get(key), key)
        for mine, source in zip(self.extra_layers, theirs[1:], strict=True):
            state = _layer_state(source, set(mine.state_dict()))
            for key, weight in mine.state_dict().items():
                _copy(weight, state.get(key), key)

    def read_target(
        self, features: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor,
        cache: RaggedCache | None, media: PairMedia | None = None,
    ) -> Tensor:
        """EAGLE-3 reads media spans as their placeholder tokens' embeddings (`media` is unused)."""
        return self.read_draft(self.fc(features), token_ids, positions, attention_mask, cache)

    def read_draft(
        self, hidden: Tensor, token_ids: Tensor, positions: Tensor, attention_mask: Tensor, cache: RaggedCache | None,
    ) -> Tensor:
        embeds = self.embed_tokens(token_ids).to(hidden.dtype)
        hidden = self.midlayer(embeds, hidden, positions, attention_mask, cache)
        for layer in self.extra_layers:
            hidden = layer(hidden, positions, attention_mask, cache)
        return hidden

    def draft_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def draft_logprobs(self, hidden: Tensor) -> Tensor:
        return torch.log_softmax(self.draft_logits(hidden).float(), dim=-1)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab_target_ids(self) -> Tensor:
        return self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    def check_target(self, target) -> None:
        cfg = self.config
        extra = []
        if max(cfg.aux_layer_ids, default=0) > target.num_layers:
            extra.append(f"feature layers {cfg.aux_layer_ids} beyond the target's {target.num_layers} layers")
        check_fits_target(target, cfg.target_hidden_size, cfg.vocab_size, cfg.target_name, extra)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write config.json + model.safetensors atomically (a temporary folder, then rename)."""
        save_drafter_folder(self, asdict(self.config), out_dir)

    @classmethod
    def from_pretrained(cls, path: str | Path, target) -> Eagle3Drafter:
        drafter = cls(read_drafter_config(path, Eagle3Config, "an EAGLE-3"), target.input_embeddings)
        drafter.check_target(target)
        load_drafter_weights(drafter, path, "EAGLE-3")
        return drafter.to(device=target.device, dtype=target.dtype).eval()


def _layer_state(layer: nn.Module, wanted: set[str]) -> dict[str, Tensor]:
    """A target decoder layer's weights, refused when it holds any the draft layer has no place for (q/k/v biases
    apart: Qwen2's, left out) or keeps none (weights packed for decoding's exact kernels)."""
    state = layer.state_dict()
    extra = sorted(k for k in state if k not in wanted and not k.endswith("_proj.bias"))
    if extra or not any(k.endswith("q_proj.weight") for k in state):
        found = f"weights a Llama layer does not have ({', '.join(extra[:4])})" if extra else "no q_proj weight"
        raise UserError(f"cannot start the draft layers from the target's: its decoder layer holds {found}")
    return state


def _copy(dst: Tensor, src: Tensor | None, what: str) -> None:
    if src is None or src.shape != dst.shape:
        raise UserError(f"cannot start the draft layers from the target's: {what} is "
                        f"{'missing' if src is None else tuple(src.shape)} where the drafter's is {tuple(dst.shape)}")
    dst.copy_(src.to(dst))


def init_linear_weights(module: nn.Module) -> None:
    """A fresh drafter's linear layers: weights N(0, 1/in_features) (module.apply; the controls start from it too)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))

